"""Joining or starting the Ray instance the Serve application runs on, with the pose replicas at normal CPU priority.

Ray starts its worker processes, and so every Serve replica, at nice 15 (Ray's ``worker_niceness``). On a host where
anything else keeps the cores busy, a replica at nice 15 gets a few percent of a core and every register and track
waits behind that other work. A Ray started here sets ``worker_niceness`` to 0; a cluster started by hand needs
``RAY_worker_niceness=0 ray start ...`` for the same, and a replica that finds itself deprioritised says so once in
its log (:func:`warn_if_deprioritised`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

__all__ = ["REPLICA_NICENESS", "init_ray", "warn_if_deprioritised"]

log = logging.getLogger(__name__)

REPLICA_NICENESS = 0


def init_ray(address: str | None, **options: Any) -> None:
    """``ray.init(address=address, **options)``: join the cluster at ``address`` (or ``RAY_ADDRESS``); without
    either, start a local Ray whose workers run at :data:`REPLICA_NICENESS`."""
    import ray

    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address, **options)
    else:
        ray.init(_system_config={"worker_niceness": REPLICA_NICENESS}, **options)


def warn_if_deprioritised(niceness: int | None = None) -> bool:
    """Log a warning when this process runs at a niceness above :data:`REPLICA_NICENESS` (``os.nice(0)`` unless
    given); True when it does."""
    niceness = os.nice(0) if niceness is None else niceness
    if niceness <= REPLICA_NICENESS:
        return False
    log.warning("this pose replica runs at nice %d: any other busy process on the host takes the CPU first and "
                "requests wait behind it; start the Ray cluster with RAY_worker_niceness=%d ray start ...",
                niceness, REPLICA_NICENESS)
    return True
