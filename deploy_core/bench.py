"""Pipeline overhead benchmark: ``python -m deploy_core.bench`` prints JSON.

For each stage count it pushes ``--packages`` packages through no-op stages and reports:

* ``direct_us_per_pkg``: calling the same no-op stage functions directly (baseline);
* ``sync_us_per_pkg``: ``pipeline.run`` (inline path, with timing) per package;
* ``async_pkgs_per_s``: sustained throughput of ``submit`` from one producer thread;
* ``per_hop_us``: (async wall time - direct wall time) / (packages x stages), i.e. the
  host cost one queue hop (hand-off + stage timing + bookkeeping) adds per package;
* ``latency_us_p50`` / ``_p90``: one package at a time, ``submit(...).result()``.

Each figure is the median over ``--repeats`` runs (``per_hop_us_runs`` lists every run):
thread hand-offs on a shared, virtualised machine are noisy. On CPython with the GIL a
hop costs two thread wake-ups at most; most of it is OS scheduling, and it is several
times cheaper when the threads share one core (``taskset -c 0``).

Nothing here is asserted; tests never depend on timings. The timing logger is left
unconfigured (as in production without ``FP_TIMING_LOG``), so records are collected
but not formatted.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from deploy_core.pipeline import BaseAsyncPipeline, Package, PipelineConfig, Stage
from deploy_core.report import emit_json_report
from deploy_core.timing import percentile


def _noop(pkg: Package) -> None:
    return None


def _bench_one(n_stages: int, packages: int, queue_capacity: int, latency_packages: int) -> dict[str, Any]:
    stages = [Stage(f"s{i}", _noop) for i in range(n_stages)]
    config = PipelineConfig(queue_capacity=queue_capacity, log_summary=False)

    probe = Package(None)
    fns = [s.fn for s in stages]
    t0 = time.perf_counter()
    for _ in range(packages):
        for fn in fns:
            fn(probe)
    direct_s = time.perf_counter() - t0

    with BaseAsyncPipeline(stages, config, name=f"bench{n_stages}") as pipe:
        t0 = time.perf_counter()
        for i in range(min(packages, 5000)):
            pipe.run(i)
        sync_s = (time.perf_counter() - t0) / min(packages, 5000) * packages

        for i in range(200):  # warm up threads and allocator
            pipe.submit(i)
        pipe.submit(-1).result()

        t0 = time.perf_counter()
        futures = [pipe.submit(i) for i in range(packages)]
        for f in futures:
            f.result()
        async_s = time.perf_counter() - t0

        lat: list[float] = []
        for i in range(latency_packages):
            t1 = time.perf_counter_ns()
            pipe.submit(i).result()
            lat.append((time.perf_counter_ns() - t1) / 1e3)
        lat.sort()
        errors = sum(s.errors for s in pipe.stats().stages)

    return {
        "stages": n_stages,
        "packages": packages,
        "direct_us_per_pkg": round(direct_s / packages * 1e6, 3),
        "sync_us_per_pkg": round(sync_s / packages * 1e6, 3),
        "async_us_per_pkg": round(async_s / packages * 1e6, 3),
        "async_pkgs_per_s": round(packages / async_s, 1),
        "per_hop_us": round((async_s - direct_s) / (packages * n_stages) * 1e6, 3),
        "latency_us_p50": round(percentile(lat, 50), 1),
        "latency_us_p90": round(percentile(lat, 90), 1),
        "stage_errors": errors,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy_core.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--packages", type=int, default=20_000, help="packages per stage count (default 20000)")
    parser.add_argument("--stages", default="1,2,4", help="comma-separated stage counts (default 1,2,4)")
    parser.add_argument("--queue-capacity", type=int, default=2, help="queue capacity per stage (default 2)")
    parser.add_argument("--latency-packages", type=int, default=1000,
                        help="sequential round trips for the latency figures (default 1000)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per stage count; figures are medians over runs (default 3)")
    parser.add_argument("--json-out", default=None, help="also write the JSON to this file")
    args = parser.parse_args(argv)
    try:
        counts = [int(x) for x in args.stages.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--stages must be comma-separated integers, got {args.stages!r}")
    if not counts or min(counts) < 1 or args.packages < 1 or args.repeats < 1:
        parser.error("--stages values, --packages and --repeats must be >= 1")

    results = []
    for n in counts:
        runs = [_bench_one(n, args.packages, args.queue_capacity, args.latency_packages)
                for _ in range(args.repeats)]
        merged: dict[str, Any] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        merged["per_hop_us_runs"] = [r["per_hop_us"] for r in runs]
        results.append(merged)
    report = {
        "bench": "deploy_core.pipeline overhead (no-op stages)",
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "switch_interval_s": sys.getswitchinterval(),
        "queue_capacity": args.queue_capacity,
        "results": results,
    }
    emit_json_report(report, args.json_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
