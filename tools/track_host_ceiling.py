"""The host's ceiling for in-process tracking: the graphed track lane with its step reduced to one copy.

Everything a track request costs the host stays as in ``python -m foundationpose.bench``'s session runs: validation,
the batcher, the lane's staging, the copy-in to the static buffers, the launch (a replay of the reduced step on
CUDA), the copy-out, the event and the results. Only the step's GPU work is gone (its output is its start pose).
So the frames/s printed is what this host can feed at most; compare it with the bench's 64-session figure to see
how far the host, not the GPU, bounds it. A diagnostic, not a benchmark of poses: every pose stays put.

    python tools/track_host_ceiling.py --device cuda --image 640x480 --sessions 64 --frames 100
    python tools/track_host_ceiling.py --device cpu --image 160x120 --sessions 8 --frames 20   # CPU: copies only

Prints JSON: frames_per_s, host_us_per_frame (wall per frame over all sessions), latency p50/p90/p99 ms, batches,
mean_batch, elapsed_s, the lane's stage walls (``stage_wall_p50_ms``: step, finish) and the settings.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

from deploy_core.timing import percentile
from foundationpose.bench.sessions import SESSION_MODELS, run_sessions
from foundationpose.estimator import EstimatorConfig, PoseEstimator
from foundationpose.mesh import load_object
from foundationpose.service import PoseService, ServiceConfig
from foundationpose.synthetic.meshes import make_procedural_mesh
from foundationpose.track_graph import TrackBuffers, TrackGraphRunner


def reduced_step(self: TrackGraphRunner, entry) -> None:
    """The step's one output write, without its work: ``out = start`` (capturable on CUDA)."""
    buffers: TrackBuffers = entry.buffers
    buffers.out.copy_(buffers.cam_from_centred)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--image", default="640x480", help="WxH (default 640x480)")
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--frames", type=int, default=100, help="frames per session (default 100)")
    parser.add_argument("--max-batch", type=int, default=32, help="track_max_batch (default 32, as the bench)")
    parser.add_argument("--session-model", choices=SESSION_MODELS, default="threads",
                        help="a thread per session, or coroutines of one event loop (foundationpose.bench.sessions)")
    parser.add_argument("--switch-interval-ms", type=float, default=None, help="sys.setswitchinterval (default 5)")
    args = parser.parse_args(argv)
    w, h = (int(v) for v in args.image.lower().split("x"))
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    original = TrackGraphRunner._step
    TrackGraphRunner._step = reduced_step  # the diagnostic's point; restored at the end (callable from tests)
    try:
        report = _measure(args, w, h)
    finally:
        TrackGraphRunner._step = original
    print(json.dumps(report, indent=1))
    return 0


def _measure(args: argparse.Namespace, w: int, h: int) -> dict:
    renderer = "triton" if args.device.startswith("cuda") else "cpu"
    est = PoseEstimator.create(device=args.device, renderer=renderer, config=EstimatorConfig(
        num_hypotheses=4, register_iterations=1, track_iterations=1))
    obj = load_object(make_procedural_mesh("textured_asym"), device=est.device)
    rgb = np.zeros((h, w, 3), np.uint8)
    depth = np.full((h, w), 0.5, np.float32)
    K = np.array([[500.0, 0.0, w / 2], [0.0, 500.0, h / 2], [0.0, 0.0, 1.0]])
    pose = np.eye(4)
    pose[2, 3] = 0.5
    config = ServiceConfig(track_max_batch=args.max_batch, max_image_hw=(h, w))
    with PoseService(est, config) as service:
        service.prepare_track(obj, (h, w))
        service.track(obj, rgb, depth, K, pose)
        sequence = [(rgb, depth)]
        run_sessions(service, obj, sequence, K, pose, sessions=args.sessions, frames=2, model=args.session_model)
        before = service.stats().track_batcher
        launches_before = service.stats().track_driver_launches
        run = run_sessions(service, obj, sequence, K, pose, sessions=args.sessions, frames=args.frames,
                           model=args.session_model)
        if run.errors:
            raise RuntimeError(f"{len(run.errors)} session(s) failed") from run.errors[0]
        elapsed = run.elapsed_s
        latencies = run.latencies_ms
        after = service.stats().track_batcher
        stages = {st.name: round(st.wall_p50_ms, 3) for st in service.stats().track.stages}
        driver_launches = service.stats().track_driver_launches - launches_before
    frames = len(latencies)
    ordered = sorted(latencies)
    batches = after.batches - before.batches
    return {
        "device": str(est.device), "image": f"{w}x{h}", "sessions": args.sessions, "frames": frames,
        "max_batch": args.max_batch, "driver_launches": driver_launches, "session_model": args.session_model,
        "switch_interval_ms": sys.getswitchinterval() * 1e3,
        "frames_per_s": round(frames / elapsed, 1),
        "host_us_per_frame": round(elapsed / frames * 1e6, 1),
        "latency_p50_ms": round(percentile(ordered, 50), 3), "latency_p90_ms": round(percentile(ordered, 90), 3),
        "latency_p99_ms": round(percentile(ordered, 99), 3),
        "batches": batches, "mean_batch": round((after.items - before.items) / batches, 2) if batches else None,
        "elapsed_s": round(elapsed, 3), "stage_wall_p50_ms": stages,
    }


if __name__ == "__main__":
    sys.exit(main())
