"""End-to-end benchmark of register and track as a user runs them; prints JSON.

    python -m foundationpose.bench [--device auto] [--weights DIR] [--sessions 1,64] [--out FILE]

With no flags it measures the product's defaults (:class:`foundationpose.runtime.RuntimeConfig`: on CUDA the
compiled half-precision networks, the Triton rasteriser, captured register and track steps) on a synthetic
sequence: the procedural textured object moving through ``SEQUENCE_FRAMES`` distinct 640x480 frames rendered with
the demo intrinsics (spec §7.1). Weights are deterministic random ones unless ``--weights`` is given (the same
compute; poses are meaningless). Every figure's conditions are in the JSON's ``conditions``: device, the runtime
(what each speed setting resolved to), the algorithm's numbers, the frames (how many distinct images, how the
sessions read them, pageable or page-locked memory), session counts and how the sessions wait, the GIL switch
interval. Reported:

* ``register``: the synchronous latency (``PoseEstimator.register``, each run on the next frame of the sequence),
  the service's latency of a lone register, and the throughput of a burst, measured both ways: back to back
  (synchronous) and all submitted at once (the service's lane), frames/s over the whole burst;
* ``track``: the synchronous latency (``PoseEstimator.track``), the service's lone track, and per session count and
  waiting model (``asyncio``: coroutines of one event loop, as the HTTP service; ``threads``: a thread per session)
  the aggregate frames/s, latency p50/p90/p99, the GPU-busy fraction and where a frame's latency went; every
  padded batch size's step timed alone (GPU vs host launch time);
* ``agreement``: the service's poses against the estimator's (zero on the CPU), and a register burst against the
  lone register; peak GPU memory; each lane's per-stage p50.

``headline`` repeats the figures the README quotes, each next to the conditions it was measured under.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deploy_core.report import emit_json_report
from deploy_core.timing import percentile
from foundationpose.bench.sessions import run_sessions

__all__ = ["SEQUENCE_FRAMES", "SWITCH_INTERVAL_S", "main", "runtime_from_args"]

log = logging.getLogger(__name__)

DEMO_K = np.array(  # spec §7.1
    [[319.5820007324219, 0.0, 320.2149847676956], [0.0, 417.1186828613281, 244.3486680871047], [0.0, 0.0, 1.0]]
)
SEQUENCE_FRAMES = 32  # distinct images the sessions read (32 x 2.1 MB at 640x480: more than a host's L3 cache)
SWITCH_INTERVAL_S = 0.0005  # the GIL switch interval the server runs with (Python's default is 5 ms)
MODELS = ("asyncio", "threads")  # how the sessions wait; the first is the headline (the HTTP service's shape)
TINY = {"hypotheses": 6, "register_iterations": 1, "track_iterations": 1, "image": "160x120", "sessions": "1,2",
        "track_frames": 2, "runs": 2, "frames": 4}


def runtime_from_args(args: argparse.Namespace) -> Any:
    """The :class:`RuntimeConfig` the bench runs with: the defaults, changed only by the flags given."""
    from foundationpose.runtime_options import runtime_from_options

    return runtime_from_options(args)


def _sequence(estimator, obj, hw: tuple[int, int], K: np.ndarray, count: int) -> list[dict[str, np.ndarray]]:
    """``count`` frames of the object moving on a smooth path: rgb, depth (metres), mask and the true pose."""
    from foundationpose.render import render_full_frame

    frames = []
    for i in range(count):
        phase = 2 * np.pi * i / count
        angle = 0.5 + 0.3 * np.sin(phase)
        pose = torch.eye(4)
        pose[:3, :3] = torch.tensor(
            [[np.cos(angle), 0, np.sin(angle)], [0, 1, 0], [-np.sin(angle), 0, np.cos(angle)]], dtype=torch.float32)
        pose[:3, 3] = torch.tensor([0.02 + 0.01 * np.cos(phase), -0.01 + 0.005 * np.sin(phase), 0.6])
        out = render_full_frame(obj.tensors, pose[None].to(estimator.device), K, hw, pixel_centre_exact=True,
                                renderer=estimator.renderer)
        frames.append({
            "rgb": (out.rgb[0].cpu().numpy() * 255).round().astype(np.uint8),
            "depth": out.xyz_cam[0, ..., 2].cpu().numpy().astype(np.float32),
            "mask": out.mask[0].cpu().numpy(),
            "cam_from_centred": pose.numpy(),
        })
    return frames


def latency_stats(times_ms: list[float]) -> dict[str, float | int]:
    """p50 / p90 / p99 / min (ms, 3 decimals) and the count of a list of timings."""
    ordered = sorted(times_ms)
    return {"p50_ms": round(percentile(ordered, 50), 3), "p90_ms": round(percentile(ordered, 90), 3),
            "p99_ms": round(percentile(ordered, 99), 3), "min_ms": round(ordered[0], 3), "runs": len(ordered)}


def _latency(fn, runs: int) -> dict[str, float | int]:
    """``fn(i)`` for i in range(runs), each timed alone."""
    times = []
    for i in range(runs):
        t0 = time.perf_counter()
        fn(i)
        times.append((time.perf_counter() - t0) * 1e3)
    return latency_stats(times)


class _GpuBusySampler:
    """Mean NVML GPU utilisation (fraction of time a kernel ran) over a block, sampled every 20 ms.

    NVML reports over its own sample period (1/6 s to 1 s on recent GPUs), so short runs read coarse; None on the
    CPU or without pynvml."""

    def __init__(self, device: torch.device, period_s: float = 0.02) -> None:
        self._device, self._period_s = device, period_s
        self._samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> _GpuBusySampler:
        if self._device.type == "cuda":
            try:
                torch.cuda.utilization(self._device)
            except Exception as exc:  # noqa: BLE001 - pynvml missing or NVML unusable: no figure
                log.warning("GPU-busy sampling unavailable: %s", exc)
            else:
                self._thread = threading.Thread(target=self._run, name="fp-bench-nvml")
                self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            self._samples.append(torch.cuda.utilization(self._device) / 100.0)

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def busy_fraction(self) -> float | None:
        return round(sum(self._samples) / len(self._samples), 3) if self._samples else None


def _sessions_row(service, obj, sequence, K, pose, sessions: int, frames: int, model: str) -> dict[str, Any]:
    """One timed run of ``sessions`` concurrent sessions (:func:`run_sessions`) with its figures."""
    sampler = _GpuBusySampler(service.device)
    before = service.stats()
    with sampler:
        run = run_sessions(service, obj, sequence, K, pose, sessions=sessions, frames=frames, model=model)
    after = service.stats()
    batches = after.track_batcher.batches - before.track_batcher.batches
    batched = after.track_batcher.items - before.track_batcher.items
    n = len(run.latencies_ms)
    row: dict[str, Any] = {"sessions": sessions, "model": model, "frames": n,
                           "frames_per_s": round(n / run.elapsed_s, 1) if n else 0.0}
    if n:
        row.update({f"latency_{k}": v for k, v in latency_stats(run.latencies_ms).items() if k.endswith("_ms")})
    row.update({
        "gpu_busy_fraction": sampler.busy_fraction(),
        "inline_fraction": round((after.track_inline - before.track_inline) / n, 3) if n else None,
        "driver_launches": after.track_driver_launches - before.track_driver_launches,
        "captures": after.track_captures - before.track_captures,  # graphs captured inside the timed run (want 0)
        "batches": batches,
        "mean_batch": round(batched / batches, 2) if batches else None,
        # mean ms per frame: its submit call (validation, staging), in the batcher, in the lane's step / finish
        # stages, and the rest of its latency (stage queues, the GPU wait, hand-offs, the session's wake-up)
        "latency_parts_mean_ms": run.parts_mean_ms(),
        "errors": [f"{type(e).__name__}: {e}" for e in run.errors[:3]],
    })
    return row


def _profile(fn, path: Path, device: torch.device, what: str, requests: int) -> None:
    """torch.profiler over ``requests`` calls of ``fn``: the top 25 ops by CUDA and by CPU time, appended as text."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(requests):
            fn()
    averages = prof.key_averages()
    sort_cuda = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    text = (f"{requests} {what}\n\n== top 25 by CUDA time ==\n" + averages.table(sort_by=sort_cuda, row_limit=25)
            + "\n\n== top 25 by CPU time ==\n" + averages.table(sort_by="cpu_time_total", row_limit=25) + "\n\n")
    with Path(path).open("a", encoding="utf-8") as f:
        f.write(text)


def _parser() -> argparse.ArgumentParser:
    from foundationpose.runtime_options import add_runtime_options

    parser = argparse.ArgumentParser(prog="python -m foundationpose.bench", description=__doc__.split("\n\n")[0])
    add_runtime_options(parser)
    parser.add_argument("--pageable-frames", action="store_true",
                        help="the sessions' frames in ordinary memory (each request then takes a staging copy) "
                        "instead of page-locked slots (PoseService.page_locked_frames)")
    parser.add_argument("--image", default="640x480", help="WxH of the synthetic frames (default 640x480)")
    parser.add_argument("--sessions", default="1,64", help="track session counts (default 1,64)")
    parser.add_argument("--track-frames", type=int, default=20, help="frames per session per run (default 20)")
    parser.add_argument("--runs", type=int, default=10, help="timed runs per latency figure (default 10)")
    parser.add_argument("--tiny", action="store_true",
                        help="a quick check on a CPU: 6 hypotheses, 1 register and 1 track iteration, 160x120 "
                        "frames, 1 and 2 sessions, 2 runs (track latencies too), one warm-up call, one timing of "
                        "each step (figures are not comparable with the full settings)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="write torch.profiler summaries of 3 registers and 20 tracks here (text)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.tiny:
        for key in ("image", "sessions", "track_frames", "runs"):
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, TINY[key])
    try:
        w, h = (int(v) for v in args.image.lower().split("x"))
        sessions = [int(s) for s in args.sessions.split(",") if s]
    except ValueError:
        parser.error(f"--image WxH and --sessions N,N,...: got {args.image!r} and {args.sessions!r}")
    if not sessions or min(sessions) < 1 or args.runs < 1 or args.track_frames < 1 or min(w, h) < 16:
        parser.error("--sessions, --runs and --track-frames must be >= 1, the image at least 16x16")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        runtime = runtime_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    emit_json_report(run(args, runtime, (h, w), sessions), args.out)
    return 0


def run(args: argparse.Namespace, runtime: Any, hw: tuple[int, int], sessions: list[int]) -> dict[str, Any]:
    """The whole benchmark (see the module docstring); returns the report."""
    from engines.files import engine_files  # an application: it wires the engines package in
    from foundationpose.estimator import EstimatorConfig, PoseEstimator
    from foundationpose.mesh import load_object
    from foundationpose.service import PoseService, ServiceConfig
    from foundationpose.synthetic.meshes import make_procedural_mesh

    device = runtime.resolved_device()
    cuda = device.type == "cuda"
    previous_interval = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    config = EstimatorConfig(**({k: TINY[k] for k in ("register_iterations", "track_iterations")} if args.tiny else {}),
                             num_hypotheses=TINY["hypotheses"] if args.tiny else None)
    t0 = time.perf_counter()
    est = PoseEstimator.create(runtime=runtime, config=config, engine_files=engine_files)
    startup_s = time.perf_counter() - t0
    h, w = hw
    K = DEMO_K.copy()
    K[0] *= w / 640.0  # the demo intrinsics, scaled to the requested image size
    K[1] *= h / 480.0
    obj = load_object(make_procedural_mesh("textured_asym"), device=est.device)
    n_frames = TINY["frames"] if args.tiny else SEQUENCE_FRAMES
    seq = _sequence(est, obj, hw, K, n_frames)
    # --tiny checks the command, not its figures: one warm-up call, --runs track samples and one timing of each
    # captured step (else 2, >= 20 and the step timers' own repeats)
    warmup = 1 if args.tiny else 2
    track_runs = args.runs if args.tiny else max(args.runs, 20)
    step_repeats: dict[str, int] = {"repeats": 1} if args.tiny else {}

    def frame(i: int) -> dict[str, np.ndarray]:
        return seq[i % n_frames]

    def sync_register(i: int):
        f = frame(i)
        return est.register(obj, f["rgb"], f["depth"], f["mask"], K)

    for i in range(warmup):
        reg = sync_register(i)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    register_sync = _latency(sync_register, args.runs)
    peak_register_gib = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    burst = max(2, args.runs)
    t0 = time.perf_counter()
    for i in range(burst):
        sync_register(i)
    sync_fps = burst / (time.perf_counter() - t0)
    reg = sync_register(0)
    f0 = frame(0)
    register_step = est.register_runner.time_step(obj, *_register_inputs(est, f0, K), config.register_iterations,
                                                  **step_repeats)
    if args.profile is not None:
        args.profile.write_text("", encoding="utf-8")
        _profile(lambda: sync_register(0), args.profile, device, "registers", requests=3)

    def sync_track(i: int):
        f = frame(i)
        return est.track(obj, f["rgb"], f["depth"], K, reg.cam_from_mesh)

    for i in range(warmup):
        sync_track(i)
    track_sync = _latency(sync_track, track_runs)

    track_max = max(1, min(32, max(sessions)))
    service_config = ServiceConfig(track_max_batch=track_max, max_image_hw=hw)
    service = PoseService(est, service_config)
    locked = None
    try:
        for _ in range(warmup):
            service.register(obj, f0["rgb"], f0["depth"], f0["mask"], K)
            service.track(obj, f0["rgb"], f0["depth"], K, reg.cam_from_mesh)
        agreement = _agreement(est, service, obj, seq, K, reg)
        register_pipe_single = _latency(
            lambda i: service.register(obj, frame(i)["rgb"], frame(i)["depth"], frame(i)["mask"], K), args.runs)
        t0 = time.perf_counter()
        futures = [service.submit_register(obj, frame(i)["rgb"], frame(i)["depth"], frame(i)["mask"], K)
                   for i in range(burst)]
        burst_poses = [fut.result().cam_from_mesh for fut in futures]
        pipe_fps = burst / (time.perf_counter() - t0)
        lone = [service.register(obj, frame(i)["rgb"], frame(i)["depth"], frame(i)["mask"], K).cam_from_mesh
                for i in range(min(burst, n_frames))]
        agreement["register_burst_differing_from_lone"] = sum(
            not np.array_equal(p, lone[i % len(lone)]) for i, p in enumerate(burst_poses) if i < len(lone))
        peak_pipelined_gib = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
        track_single = _latency(
            lambda i: service.track(obj, frame(i)["rgb"], frame(i)["depth"], K, reg.cam_from_mesh), track_runs)
        prepared = service.prepare_track(obj, hw)  # every padded batch size now, not inside a timed run
        sequence = [(f["rgb"], f["depth"]) for f in seq]
        if not args.pageable_frames:
            locked = service.page_locked_frames(n_frames, hw)
            for slot, (rgb, depth) in enumerate(sequence):
                np.copyto(locked[slot][0], rgb)
                np.copyto(locked[slot][1], depth)
            sequence = [locked[slot] for slot in range(n_frames)]
        rows = []
        for s in sessions:
            for model in MODELS:  # an untimed short run first (the lane's threads and caches warm)
                _sessions_row(service, obj, sequence, K, reg.cam_from_mesh, s, min(3, args.track_frames), model)
                rows.append(_sessions_row(service, obj, sequence, K, reg.cam_from_mesh, s, args.track_frames, model))
        locked_kind = locked is not None and locked.locked  # on the CPU the slots are ordinary memory
        step_by_batch = service.time_track_steps(obj, hw, **step_repeats)
        if args.profile is not None:
            _profile(lambda: service.track(obj, f0["rgb"], f0["depth"], K, reg.cam_from_mesh), args.profile, device,
                     "tracks", requests=20)
        stats = service.stats()
    finally:
        if locked is not None:
            locked.close()
        service.close()
        sys.setswitchinterval(previous_interval)

    conditions = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "runtime": runtime.describe(device) | {"renderer": est.renderer.name,
                                                "captured_steps": est.register_runner.capturable},
        "algorithm": {"hypotheses": len(est.rotation_grid()), "register_iterations": config.register_iterations,
                      "track_iterations": config.track_iterations},
        "random_weights": est.networks.random_weights,
        "frames": {"image": f"{w}x{h}", "distinct": n_frames,
                   "sessions_read": "session i sends image (i + t) mod distinct at its step t",
                   "memory": "page-locked" if locked_kind else "pageable"},
        "sessions": sessions, "session_models": list(MODELS), "track_frames_per_session": args.track_frames,
        "track_max_batch": track_max, "switch_interval_ms": SWITCH_INTERVAL_S * 1e3, "tiny": args.tiny,
    }
    headline_rows = [r for r in rows if r["model"] == MODELS[0]]
    report = {
        "conditions": conditions,
        "headline": {
            "register_p50_ms": register_sync["p50_ms"],
            "track_p50_ms": track_single["p50_ms"],
            "track_sessions": {str(r["sessions"]): {"frames_per_s": r["frames_per_s"],
                                                     "latency_p99_ms": r.get("latency_p99_ms")} for r in headline_rows},
        },
        "startup_s": round(startup_s, 2),
        "register": {
            "sync": register_sync, "sync_breakdown_ms": {k: round(v, 3) for k, v in reg.timings_ms.items()},
            "step": register_step, "service_single": register_pipe_single,
            "throughput_fps": {"burst": burst, "sync": round(sync_fps, 2), "service": round(pipe_fps, 2),
                               "speedup": round(pipe_fps / sync_fps, 3)},
        },
        "track": {"sync": track_sync, "service_single": track_single, "sessions": rows,
                  "prepared_steps": prepared, "step_by_batch": step_by_batch},
        "agreement": agreement,
        "peak_gpu_mem_gib": {"register_sync": None if peak_register_gib is None else round(peak_register_gib, 3),
                             "service": None if peak_pipelined_gib is None else round(peak_pipelined_gib, 3)},
        "service_stage_p50_ms": {
            lane: {s.name: {"wall": round(s.wall_p50_ms, 3), "gpu": s.gpu_p50_ms} for s in pipe.stages}
            for lane, pipe in (("register", stats.register), ("track", stats.track))
        },
    }
    if est.compile_cache is not None:
        report["compile_cache"] = {"path": est.compile_cache.path, "loaded": est.compile_cache.loaded,
                                   "artifacts": est.compile_cache.artifacts, "reason": est.compile_cache.reason}
    return report


def _register_inputs(est, f: dict[str, np.ndarray], K: np.ndarray) -> tuple[Any, Any]:
    """The prepared frame and the hypotheses of one register (what the register step takes)."""
    from foundationpose.observation import prepare_frame

    prepared = prepare_frame(f["rgb"], f["depth"], K, est.device, xyz_float64=True, constants=est.constants)
    return prepared, est.hypotheses(prepared, torch.as_tensor(f["mask"], device=est.device))


def _agreement(est, service, obj, seq, K, reg) -> dict[str, Any]:
    """The service's register and track poses against the estimator's on the same frames (0.0 on the CPU)."""
    f = seq[1 % len(seq)]
    piped_reg = service.register(obj, f["rgb"], f["depth"], f["mask"], K)
    sync_reg = est.register(obj, f["rgb"], f["depth"], f["mask"], K)
    piped_trk = service.track(obj, f["rgb"], f["depth"], K, reg.cam_from_centred, prev_frame="centred")
    sync_trk = est.track(obj, f["rgb"], f["depth"], K, reg.cam_from_centred, prev_frame="centred")
    return {
        "register_pose_max_abs_diff": float(np.abs(piped_reg.cam_from_mesh - sync_reg.cam_from_mesh).max()),
        "register_score_abs_diff": abs(piped_reg.score - sync_reg.score),
        "track_pose_max_abs_diff": float(np.abs(piped_trk.cam_from_mesh - sync_trk.cam_from_mesh).max()),
    }


if __name__ == "__main__":
    raise SystemExit(main())
