"""Benchmarks, each a command that prints JSON:

* ``python -m foundationpose.bench``: register/track end to end (:mod:`.e2e`);
* ``python -m foundationpose.bench.filters``: depth filters, torch reference vs Triton (:mod:`.filters`);
* ``python -m foundationpose.bench.render_parity``: renderer backends against each other (:mod:`.render_parity`);
* ``python -m foundationpose.bench.roofline``: per-layer roofline of both networks (:mod:`.roofline`);
* ``python -m foundationpose.bench.validity``: the cost of the track step's validity measurements (:mod:`.validity`).
"""

from foundationpose.bench.e2e import main

__all__ = ["main"]
