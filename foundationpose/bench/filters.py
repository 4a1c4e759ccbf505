"""Benchmark and parity check of the depth filters: torch reference vs Triton kernels.

Run on a CUDA machine::

    python -m foundationpose.bench.filters            # 480x640, batch 1 and 8
    python -m foundationpose.bench.filters --sweep    # also time a few tile configs

Prints one JSON object: per batch size, per stage (``erode``, ``bilateral``, ``full`` = erosion +
bilateral + float32 back-projection, ``full_f64`` = same with the register path's float64
back-projection), the GPU time per call (CUDA events around ``iters`` back-to-back calls) and the
host wall time per call (median, synchronised), for ``torch`` and ``triton``; plus parity of the
Triton results against the torch ones on the same input (erosion must be equal, bilateral max abs
difference <= 1e-6, ideally 0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from foundationpose.sampling.depth_filters import (
    bilateral_filter_depth,
    erode_depth,
    filter_depth_and_backproject,
)

__all__ = ["K_BENCH", "main", "synthetic_depth"]

K_BENCH = np.array([[615.3, 0.0, 323.7], [0.0, 612.9, 239.1], [0.0, 0.0, 1.0]])  # (3, 3) float64 pixels


def synthetic_depth(batch: int, height: int, width: int, seed: int = 0) -> Tensor:
    """Millimetre-quantised depth (k/1000 rounded to float32 metres) with the features the filters see.

    A tilted plane with 1-2 mm noise, a raised box and a disc (steps of 3-30 cm), rows of isolated
    holes and a few blocky holes, and some readings beyond zfar = 100 m.

    Returns:
        (batch, height, width) float32 CPU tensor, metres, 0 = invalid.
    """
    rng = np.random.default_rng(seed)
    rows, cols = np.mgrid[0:height, 0:width]
    out = np.empty((batch, height, width), dtype=np.float32)
    for b in range(batch):
        mm = 700 + (cols * rng.uniform(0.5, 1.5) + rows * rng.uniform(0.2, 1.0)).astype(np.int64)
        mm += rng.integers(-2, 3, size=(height, width))
        top, left = rng.integers(0, height // 2), rng.integers(0, width // 2)
        mm[top : top + height // 3, left : left + width // 3] -= rng.integers(30, 300)  # box in front
        cy, cx, radius = rng.integers(0, height), rng.integers(0, width), rng.integers(5, max(6, height // 4))
        mm[(rows - cy) ** 2 + (cols - cx) ** 2 < radius**2] += rng.integers(30, 300)  # disc behind
        mm[rng.random((height, width)) < 0.08] = 0  # isolated holes
        for _ in range(4):  # blocky holes
            r0, c0 = rng.integers(0, height), rng.integers(0, width)
            mm[r0 : r0 + rng.integers(1, 9), c0 : c0 + rng.integers(1, 9)] = 0
        mm[rng.random((height, width)) < 0.005] = 150_000  # beyond zfar
        out[b] = (mm.astype(np.float64) / 1000.0).astype(np.float32)
    return torch.from_numpy(out)


def _time(fn: Callable[[], Any], device: torch.device, iters: int, warmup: int) -> dict[str, float]:
    """GPU ms per call (events around ``iters`` calls) and median synchronised host wall ms per call."""
    for _ in range(warmup):
        fn()
    result: dict[str, float] = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        result["gpu_ms"] = start.elapsed_time(end) / iters
    walls = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        walls.append((time.perf_counter() - t0) * 1e3)
    result["wall_ms"] = statistics.median(walls)
    return result


def _max_abs(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).abs().max().item()) if a.numel() else 0.0


def _parity(depth: Tensor) -> dict[str, Any]:
    eroded_t = erode_depth(depth, impl="torch")
    eroded_k = erode_depth(depth, impl="triton")
    filtered_t = bilateral_filter_depth(eroded_t, impl="torch")
    filtered_k = bilateral_filter_depth(eroded_t, impl="triton")
    report: dict[str, Any] = {
        "erode_equal": bool(torch.equal(eroded_t, eroded_k)),
        "bilateral_equal": bool(torch.equal(filtered_t, filtered_k)),
        "bilateral_max_abs": _max_abs(filtered_t, filtered_k),
        "bilateral_pixels_differing": int((filtered_t != filtered_k).sum().item()),
    }
    for name, f64 in (("xyz_f32", False), ("xyz_f64", True)):
        ft, xyz_t = filter_depth_and_backproject(depth, K_BENCH, xyz_float64=f64, impl="torch")
        fk, xyz_k = filter_depth_and_backproject(depth, K_BENCH, xyz_float64=f64, impl="triton")
        report[f"full_{name}_depth_equal"] = bool(torch.equal(ft, fk))
        report[f"full_{name}_equal"] = bool(torch.equal(xyz_t, xyz_k))
        report[f"full_{name}_max_abs"] = _max_abs(xyz_t, xyz_k)
    return report


def _stages(depth: Tensor, impl: str) -> dict[str, Callable[[], Any]]:
    eroded = erode_depth(depth, impl="torch")
    return {
        "erode": lambda: erode_depth(depth, impl=impl),
        "bilateral": lambda: bilateral_filter_depth(eroded, impl=impl),
        "full": lambda: filter_depth_and_backproject(depth, K_BENCH, xyz_float64=False, impl=impl),
        "full_f64": lambda: filter_depth_and_backproject(depth, K_BENCH, xyz_float64=True, impl=impl),
    }


def _sweep(depth: Tensor, iters: int, warmup: int) -> list[dict[str, Any]]:
    from foundationpose.sampling import _depth_filters_triton as kernels

    eroded = erode_depth(depth, impl="torch")
    rows = []
    for block_h, block_w, num_warps in [
        (1, 64, 2),
        (2, 64, 4),
        (4, 32, 4),
        (4, 64, 4),
        (8, 32, 8),
        (8, 64, 8),
    ]:
        tile = kernels.TileConfig(block_h, block_w, num_warps)
        erode_t = _time(
            lambda tile=tile: kernels.erode_depth_triton(depth, 2, 0.001, 0.8, 100.0, 0.001, tile=tile),
            depth.device,
            iters,
            warmup,
        )
        bilateral_t = _time(
            lambda tile=tile: kernels.bilateral_filter_depth_triton(
                eroded, 2, 2.0, 1e5, 100.0, 0.001, 0.01, K=K_BENCH, tile=tile
            ),
            depth.device,
            iters,
            warmup,
        )
        rows.append({"tile": [block_h, block_w, num_warps], "erode": erode_t, "bilateral_xyz": bilateral_t})
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sweep", action="store_true", help="also time a few Triton tile configs")
    args = parser.parse_args(argv)
    device = torch.device(args.device)

    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "hw": [args.height, args.width],
        "iters": args.iters,
    }
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError:
        report["triton"] = None
    impls = ["torch"] + (["triton"] if report["triton"] and device.type == "cuda" else [])

    for batch in args.batches:
        depth = synthetic_depth(batch, args.height, args.width, seed=batch).to(device)
        entry: dict[str, Any] = {}
        for impl in impls:
            entry[impl] = {
                name: _time(fn, device, args.iters, args.warmup) for name, fn in _stages(depth, impl).items()
            }
        if "triton" in impls:
            entry["parity"] = _parity(depth)
            if args.sweep:
                entry["sweep"] = _sweep(depth, args.iters, args.warmup)
        report[f"batch_{batch}"] = entry
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
