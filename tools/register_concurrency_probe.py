"""Concurrent registers (and tracks) through ``PoseService`` against the synchronous path, per configuration.

    python tools/register_concurrency_probe.py [--renderer triton] [--concurrent 16] [--out FILE]

Every register of one frame must give the same pose whether it runs alone or beside others (the algorithm is
deterministic), so any difference under concurrency is a data race of the pipelined lanes (a buffer rewritten
while another stream still reads it, a tensor freed across streams, shared scratch). Per configuration the
probe submits ``--concurrent`` registers of the bench scene at once, then the same number one at a time, and
compares each pose with :meth:`PoseEstimator.register`'s: non-finite poses, poses differing, the largest
difference. Configurations (each a fresh ``PoseService`` over the one estimator):

* ``fif1`` / ``fif2`` / ``fif4``: 1, 2 or 4 register frames in flight (per-stage CUDA streams);
* ``fif2_one_stream``: 2 in flight, every stage on one shared stream (threads still concurrent);
* ``fif2_triton_inputs``: 2 in flight, the fused Triton network-input kernel;
* ``track_<n>``: ``n`` concurrent stateless tracks through the graphed track lane against the sync track.

(``--device cpu --renderer cpu --hypotheses 6 --concurrent 3 --image 64x48``: a smoke run of the script.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from engines.files import engine_files
from foundationpose.bench.e2e import DEMO_K, _scene
from foundationpose.estimator import EstimatorConfig, PoseEstimator, resolve_device
from foundationpose.networks import NetworkConfig
from foundationpose.service import PoseService, ServiceConfig
from foundationpose.service.lane import LaneContext


def _compare(poses: list[np.ndarray], reference: np.ndarray, tol: float) -> dict:
    diffs = [float(np.abs(p - reference).max()) if np.isfinite(p).all() else float("inf") for p in poses]
    return {
        "n": len(poses),
        "non_finite": int(sum(not np.isfinite(p).all() for p in poses)),
        "differing": int(sum(d > tol for d in diffs)),
        "max_abs_diff": max((d for d in diffs if np.isfinite(d)), default=None),
    }


@contextmanager
def _one_stream(device: torch.device) -> Iterator[None]:
    """Every lane stage of the services built inside this block runs on one shared CUDA stream."""
    original = LaneContext.stream_factory
    shared = torch.cuda.Stream(device) if device.type == "cuda" else None
    LaneContext.stream_factory = lambda self: (lambda: shared) if shared is not None else None
    try:
        yield
    finally:
        LaneContext.stream_factory = original


def _register_case(est: PoseEstimator, scene, reference: np.ndarray, config: ServiceConfig, n: int,
                   tol: float) -> dict:
    obj, rgb, depth, mask, K = scene
    started = time.perf_counter()
    with PoseService(est, config) as service:
        futures = [service.submit_register(obj, rgb, depth, mask, K) for _ in range(n)]
        concurrent = [f.result().cam_from_mesh for f in futures]
        alone = [service.register(obj, rgb, depth, mask, K).cam_from_mesh for _ in range(min(n, 4))]
    return {"concurrent": _compare(concurrent, reference, tol), "one_at_a_time": _compare(alone, reference, tol),
            "seconds": round(time.perf_counter() - started, 2)}


def _track_case(est: PoseEstimator, scene, start: np.ndarray, n: int, tol: float) -> dict:
    obj, rgb, depth, _, K = scene
    reference = est.track(obj, rgb, depth, K, start).cam_from_mesh
    config = ServiceConfig(track_max_batch=min(n, 16), max_image_hw=depth.shape)
    with PoseService(est, config) as service:
        futures = [service.submit_track(obj, rgb, depth, K, start, key=i) for i in range(n)]
        poses = [f.result().cam_from_mesh for f in futures]
        stats = service.stats().track_batcher
    # batched refiner calls may round differently from the lone one (another batch size, other kernels)
    return {**_compare(poses, reference, tol), "batches": stats.batches}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--renderer", default="triton", choices=("auto", "cpu", "nvdiffrast", "triton"))
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--hypotheses", type=int, default=None, help="register hypotheses (default 252)")
    parser.add_argument("--image", default="640x480", help="WxH (default 640x480)")
    parser.add_argument("--concurrent", type=int, default=16, help="registers submitted at once per case")
    parser.add_argument("--tracks", type=int, default=32, help="concurrent tracks of the track case (0: skip)")
    parser.add_argument("--register-tol", type=float, default=0.0,
                        help="a register pose differing by more than this counts as differing (default 0: bits)")
    parser.add_argument("--track-tol", type=float, default=1e-3, help="the same for batched tracks (default 1e-3)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)

    device = resolve_device(args.device)
    w, h = (int(v) for v in args.image.lower().split("x"))
    cuda = device.type == "cuda"
    net_cfg = NetworkConfig(precision=args.precision, track_graph_batches=(1, 2, 4, 8, 16) if cuda else ())
    config = EstimatorConfig(num_hypotheses=args.hypotheses, network_input_impl="torch")
    est = PoseEstimator.create(device=device, config=config, network_config=net_cfg, renderer=args.renderer,
                               engine_files=engine_files)
    K = DEMO_K.copy()
    K[0] *= w / 640.0
    K[1] *= h / 480.0
    obj, rgb, depth, mask = _scene(est, (h, w), K)
    scene = (obj, rgb, depth, mask, K)
    est.register(obj, rgb, depth, mask, K)  # warm-up
    reference = est.register(obj, rgb, depth, mask, K).cam_from_mesh
    repeat = est.register(obj, rgb, depth, mask, K).cam_from_mesh
    report: dict = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "renderer": args.renderer,
                    "precision": est.networks.precision, "image": [h, w],
                    "sync_repeat_max_abs_diff": float(np.abs(repeat - reference).max()), "cases": {}}
    base = ServiceConfig(max_image_hw=(h, w))
    triton_est = PoseEstimator(est.networks, est.renderer, device=device,
                               config=dataclasses.replace(config, network_input_impl="triton")) if cuda else est
    cases = [
        ("fif1", lambda: _register_case(est, scene, reference, dataclasses.replace(base, frames_in_flight=1),
                                        args.concurrent, args.register_tol)),
        ("fif2", lambda: _register_case(est, scene, reference, base, args.concurrent, args.register_tol)),
        ("fif4", lambda: _register_case(est, scene, reference, dataclasses.replace(base, frames_in_flight=4),
                                        args.concurrent, args.register_tol)),
        ("fif2_triton_inputs", lambda: _register_case(triton_est, scene, reference, base, args.concurrent,
                                                      args.register_tol)),
    ]
    for name, run in cases:
        report["cases"][name] = run()
        print(name, json.dumps(report["cases"][name]), file=sys.stderr, flush=True)
    with _one_stream(device):
        report["cases"]["fif2_one_stream"] = _register_case(est, scene, reference, base, args.concurrent,
                                                           args.register_tol)
    print("fif2_one_stream", json.dumps(report["cases"]["fif2_one_stream"]), file=sys.stderr, flush=True)
    if args.tracks:
        graphed = PoseEstimator(est.networks, est.renderer, device=device,
                                config=dataclasses.replace(config, track_graphs=cuda))
        report["cases"][f"track_{args.tracks}"] = _track_case(graphed, scene, reference, args.tracks, args.track_tol)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
