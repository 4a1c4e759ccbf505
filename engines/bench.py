"""Benchmark the refiner and scorer through an inference core; prints JSON.

    python -m engines.bench [--backend torch] [--precision auto] [--batch 1,252] [--no-compile] [--compare-fp32]
        [--iters 20] [--warmup 3] [--weights DIR] [--out FILE]

The networks run as the estimator runs them (:func:`foundationpose.networks.load_networks` with a
:class:`~foundationpose.runtime.RuntimeConfig`: the fast path on CUDA).

Per network and batch: latency p50/p90 (ms, CUDA-event timed on GPU), throughput (samples/s),
achieved TFLOP/s from the spec's FLOP counts (refiner 23.946 GFLOP/sample, scorer 21.940
GFLOP/sample, §4.5), start-up cost (warm-up, compile, graph capture) and peak GPU memory. With
``--compare-fp32`` it also reports the max abs difference of the outputs against an fp32 run on
the same random inputs (the accuracy cost of the precision). Weights are deterministic random
ones unless ``--weights`` is given: the compute is the same.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

from deploy_core.report import emit_json_report
from deploy_core.timing import percentile
from engines.files import engine_files
from foundationpose.networks import load_networks
from foundationpose.runtime import RuntimeConfig, resolve_device

__all__ = ["FLOP_PER_SAMPLE", "main", "bench_core"]

FLOP_PER_SAMPLE = {"refiner": 23.946e9, "scorer": 21.940e9}  # spec §4.5 (2 FLOP per MAC)


def _inputs(batch: int, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    shape = (batch, 160, 160, 6)
    return {
        "render_input": torch.rand(shape, generator=g).to(device),
        "transf_input": torch.rand(shape, generator=g).to(device),
    }


def bench_core(core, batch: int, *, iters: int, warmup: int, seed: int = 0) -> dict:
    """Time ``core.infer`` at ``batch``; returns latency stats in ms."""
    device = core.device
    inputs = _inputs(batch, device, seed)
    cuda = device.type == "cuda"
    for _ in range(warmup):
        core.infer(inputs)
    if cuda:
        torch.cuda.synchronize(device)
    times_ms: list[float] = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            core.infer(inputs)
            end.record()
            end.synchronize()
            times_ms.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            core.infer(inputs)
            times_ms.append((time.perf_counter() - t0) * 1e3)
    return {
        "p50_ms": round(percentile(sorted(times_ms), 50), 4),
        "p90_ms": round(percentile(sorted(times_ms), 90), 4),
        "mean_ms": round(statistics.fmean(times_ms), 4),
        "iters": iters,
    }


def _max_abs_diff(core, reference, batch: int, seed: int = 1) -> float:
    inputs = _inputs(batch, core.device, seed)
    got = core.infer(inputs)
    want = reference.infer(inputs)
    return max(float((got[k].float() - want[k].float()).abs().max()) for k in want)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engines.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="torch", choices=["torch", "onnxruntime", "tensorrt"])
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "fp16", "bf16"])
    parser.add_argument("--batch", default="1,252", help="comma-separated batch sizes (default 1,252)")
    parser.add_argument("--networks", default="refiner,scorer", help="which networks (default both)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda[:i] (default auto)")
    parser.add_argument("--weights", type=Path, default=None, help="weights root (default: random weights)")
    parser.add_argument("--engine-dir", type=Path, default=None, help="ONNX/plan directory (file backends)")
    parser.add_argument("--no-compile", action="store_true", help="no torch.compile (CUDA, torch backend)")
    parser.add_argument("--compare-fp32", action="store_true", help="report max abs diff vs an fp32 run")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations per case (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations first (default 3)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON to this file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    device = resolve_device(args.device)
    batches = [int(b) for b in args.batch.split(",") if b]
    names = [n for n in args.networks.split(",") if n]
    config = RuntimeConfig(weights=args.weights, backend=args.backend, precision=args.precision,
                           max_batch=max(batches), engine_dir=args.engine_dir, compile=not args.no_compile,
                           compile_cache=None)
    t0 = time.perf_counter()
    nets = load_networks(config, device, engine_files=engine_files)
    load_s = time.perf_counter() - t0
    cores = {"refiner": nets.refiner, "scorer": nets.scorer}
    startup: dict[str, float] = {}
    for name in names:
        t0 = time.perf_counter()
        cores[name].warmup(batches)
        startup[name] = round(time.perf_counter() - t0, 3)
    reference = None
    if args.compare_fp32:
        reference = load_networks(RuntimeConfig(weights=args.weights, backend=args.backend, precision="fp32",
                                                max_batch=max(batches), engine_dir=args.engine_dir, compile=False,
                                                compile_cache=None), device, engine_files=engine_files)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    results = []
    for name in names:
        for batch in batches:
            stats = bench_core(cores[name], batch, iters=args.iters, warmup=args.warmup)
            flop = FLOP_PER_SAMPLE[name] * batch
            row = {
                "network": name,
                "batch": batch,
                **stats,
                "samples_per_s": round(batch / (stats["p50_ms"] / 1e3), 1),
                "tflops": round(flop / (stats["p50_ms"] / 1e3) / 1e12, 2),
            }
            if reference is not None:
                ref_core = reference.refiner if name == "refiner" else reference.scorer
                row["max_abs_diff_vs_fp32"] = _max_abs_diff(cores[name], ref_core, batch)
            results.append(row)

    report = {
        "backend": args.backend,
        "precision": nets.precision,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "runtime": config.describe(device),
        "random_weights": nets.random_weights,
        "load_s": round(load_s, 3),
        "startup_s": startup,
        "peak_gpu_mem_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if device.type == "cuda" else None,
        "results": results,
    }
    emit_json_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
