"""End-to-end benchmark of register and track, synchronous vs pipelined; prints JSON.

    python -m foundationpose.bench [--device auto] [--precision auto] [--runs 10]
        [--frames-in-flight 2] [--sessions 1,64] [--hypotheses 252] [--register-iterations 5]
        [--track-iterations 2] [--fast] [--renderer auto] [--graphs both] [--profile FILE] [--out FILE]

Scene: the procedural textured object rendered at 640x480 with the demo intrinsics (spec §7.1),
so inputs are realistic in size; weights are deterministic random ones unless ``--weights``
is given (same compute, meaningless poses). Reported:

* ``register_sync`` / ``track_sync``: latency p50/p90 of the reference path (one call at a time);
* ``register_pipelined``: latency of one frame alone, and sustained throughput with
  ``--frames-in-flight`` frames submitted at once (vs the synchronous frames/s);
* ``track_pipelined``: one session's latency, and aggregate frames/s for each ``--sessions`` count
  (each session doing submit -> result -> next frame, as a robot would: a thread per session, and coroutines of
  one event loop, ``--session-models``);
* peak GPU memory during register, and the per-stage breakdown (p50 ms) of each lane;
* ``track_modes``: the track figures with whole track steps captured as CUDA graphs (``graphs_on``,
  :mod:`foundationpose.track_graph`) and stage by stage (``graphs_off``) in the same run: reference-path
  latency with its per-stage wall and GPU p50, pipelined latency of a lone session, and per session count the
  aggregate frames/s, latency p50/p90/p99 and the GPU-busy fraction (NVML utilisation sampled every 20 ms;
  None without pynvml) during the run. The first mode also fills the top-level ``track_*`` keys.
  Graphs capture with the ``triton`` renderer only (``--renderer triton``); elsewhere ``graphs_on`` runs the same
  step eagerly on its static buffers.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from deploy_core.report import emit_json_report
from deploy_core.timing import percentile
from foundationpose.bench.sessions import SESSION_MODELS, run_sessions

__all__ = ["main"]

log = logging.getLogger(__name__)

DEMO_K = np.array(  # spec §7.1
    [[319.5820007324219, 0.0, 320.2149847676956], [0.0, 417.1186828613281, 244.3486680871047], [0.0, 0.0, 1.0]]
)


def _scene(estimator, hw: tuple[int, int], K: np.ndarray):
    from foundationpose.mesh import load_object
    from foundationpose.render import render_full_frame
    from foundationpose.synthetic.meshes import make_procedural_mesh

    obj = load_object(make_procedural_mesh("textured_asym"), device=estimator.device)
    pose = torch.eye(4)
    angle = 0.5
    pose[:3, :3] = torch.tensor(
        [[np.cos(angle), 0, np.sin(angle)], [0, 1, 0], [-np.sin(angle), 0, np.cos(angle)]], dtype=torch.float32
    )
    pose[:3, 3] = torch.tensor([0.02, -0.01, 0.6])
    out = render_full_frame(obj.tensors, pose[None].to(estimator.device), K, hw, pixel_centre_exact=True,
                            renderer=estimator.renderer)
    rgb = (out.rgb[0].cpu().numpy() * 255).round().astype(np.uint8)
    depth = out.xyz_cam[0, ..., 2].cpu().numpy().astype(np.float32)
    mask = out.mask[0].cpu().numpy()
    return obj, rgb, depth, mask


def _register_path(est) -> str:
    """How the estimator ran its registers: "graph" (captured), "eager runner" (the runner, not captured), "stages"."""
    runner = est.register_runner
    if runner is None:
        return "stages"
    return "graph" if runner.captures and not runner.capture_failures else "eager runner"


def _register_step_times(est, obj, rgb, depth, mask, K) -> dict | None:
    """``RegisterGraphRunner.time_step`` on the bench frame: whether the captured register is GPU- or host-bound."""
    runner = est.register_runner
    if runner is None:
        return None
    from foundationpose.observation import prepare_frame

    frame = prepare_frame(rgb, depth, K, est.device, xyz_float64=True, impl=est.config.depth_filter_impl,
                          constants=est.constants)
    poses = est.hypotheses(frame, torch.as_tensor(mask, device=est.device))
    return runner.time_step(obj, frame, poses, est.config.register_iterations)


def _latency(fn, runs: int) -> dict[str, float]:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"p50_ms": round(percentile(sorted(times), 50), 3), "p90_ms": round(percentile(sorted(times), 90), 3),
            "min_ms": round(min(times), 3), "runs": runs}


def _sessions_throughput(service, obj, rgb, depth, K, pose, sessions: int, frames_per_session: int,
                         model: str = "threads") -> dict:
    """One run of ``sessions`` concurrent sessions (:mod:`foundationpose.bench.sessions`: threads or asyncio)."""
    sampler = _GpuBusySampler(service.device)
    before = service.stats()
    with sampler:
        run = run_sessions(service, obj, rgb, depth, K, pose, sessions=sessions, frames=frames_per_session,
                           model=model)
    after = service.stats()
    batches = after.track_batcher.batches - before.track_batcher.batches
    batched = after.track_batcher.items - before.track_batcher.items
    latencies = run.latencies_ms
    ordered = sorted(latencies)
    return {
        "sessions": sessions,
        "model": model,
        "frames": len(latencies),
        "frames_per_s": round(len(latencies) / run.elapsed_s, 1),
        "latency_p50_ms": round(percentile(ordered, 50), 3) if latencies else None,
        "latency_p90_ms": round(percentile(ordered, 90), 3) if latencies else None,
        "latency_p99_ms": round(percentile(ordered, 99), 3) if latencies else None,
        "gpu_busy_fraction": sampler.busy_fraction(),
        "inline_fraction": round((after.track_inline - before.track_inline) / len(latencies), 3) if latencies else None,
        "driver_launches": after.track_driver_launches - before.track_driver_launches,
        "captures": after.track_captures - before.track_captures,  # graphs captured inside the timed run (want 0)
        "batches": batches,
        "mean_batch": round(batched / batches, 2) if batches else None,
        # mean ms per frame: its submit call (validation, staging), in the batcher, in the lane's step / finish stages
        # (wall), and the rest of its latency (stage queues, the GPU wait, hand-offs, the session's wake-up)
        "latency_parts_mean_ms": run.parts_mean_ms(),
        "errors": [f"{type(e).__name__}: {e}" for e in run.errors[:3]],
    }


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

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def busy_fraction(self) -> float | None:
        return round(sum(self._samples) / len(self._samples), 3) if self._samples else None


def _session_models(text: str) -> list[str]:
    models = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in models if m not in SESSION_MODELS]
    if unknown or not models:
        raise ValueError(f"--session-models: a comma-separated list of {SESSION_MODELS}, got {text!r}")
    return models


def _stage_breakdown(summary: dict) -> dict[str, dict[str, float | None]]:
    """``{stage: {wall_p50_ms, gpu_p50_ms}}`` from a TimingRecorder summary."""
    return {
        name: {"wall_p50_ms": round(row["p50"], 3),
               "gpu_p50_ms": None if row["gpu_p50"] is None else round(row["gpu_p50"], 3)}
        for name, row in summary.items()
    }


def _track_figures(variant, service_config, obj, rgb, depth, K, reg, sessions, args, reference_pose) -> dict:
    """Track figures of one estimator variant (graphs on or off): reference path, then its pipelined service."""
    from foundationpose.service import PoseService

    session_models = _session_models(args.session_models)

    def sync_track():
        return variant.track(obj, rgb, depth, K, reg.cam_from_mesh)

    for _ in range(args.warmup):
        sync_track()
    variant.recorder.summary()  # drop nothing, but resolve pending GPU records of the warm-up
    before = {k: v["count"] for k, v in variant.recorder.summary().items()}
    track_sync = _latency(sync_track, max(args.runs, 20))
    summary = {k: v for k, v in variant.recorder.summary().items() if v["count"] > before.get(k, 0)}
    last = sync_track()
    runner = variant.track_runner
    out = {
        "graphs": runner is not None,
        "captured": bool(runner is not None and runner.captures > 0),
        "capture_failures": runner.capture_failures if runner is not None else 0,
        "track_sync": track_sync,
        "track_sync_breakdown_ms": {k: round(v, 3) for k, v in last.timings_ms.items()},
        "track_sync_stage_ms": _stage_breakdown(summary),
        "track_pose_max_abs_diff_vs_graphs_off": float(np.abs(last.cam_from_mesh - reference_pose).max()),
    }
    service = PoseService(variant, service_config)
    try:
        for _ in range(args.warmup):
            service.track(obj, rgb, depth, K, reg.cam_from_mesh)
        pipelined = service.track(obj, rgb, depth, K, reg.cam_from_mesh)
        out["pipelined_track_pose_max_abs_diff"] = float(np.abs(pipelined.cam_from_mesh - last.cam_from_mesh).max())
        out["track_pipelined_single"] = _latency(lambda: service.track(obj, rgb, depth, K, reg.cam_from_mesh),
                                                 max(args.runs, 20))
        out["track_sessions"] = []
        out["track_prepared_steps"] = service.prepare_track(obj, depth.shape)  # every padded batch size, now
        frames = service.page_locked_frames(1, depth.shape) if args.page_locked_frames else None
        try:
            session_rgb, session_depth = rgb, depth
            if frames is not None:  # one slot read by every session (nobody writes it while they run)
                session_rgb, session_depth = frames[0]
                np.copyto(session_rgb, rgb)
                np.copyto(session_depth, depth)
            for s in sessions:
                for model in session_models:  # an untimed burst first (the lane's threads and caches warm)
                    for n_frames, timed in ((min(3, args.track_frames), False), (args.track_frames, True)):
                        row = _sessions_throughput(service, obj, session_rgb, session_depth, K, reg.cam_from_mesh, s,
                                                   n_frames, model)
                        if timed:
                            out["track_sessions"].append(row)
        finally:
            if frames is not None:
                frames.close()
        # per padded batch size of the lane (not the estimator's batch-1 runner): one step's GPU time vs the host's
        # launch time
        by_batch = service.time_track_steps(obj, depth.shape)
        if by_batch is not None:
            out["track_step_by_batch"] = by_batch
        stages = service.stats().track.stages
        out["pipelined_track_stage_ms"] = {
            s.name: {"wall_p50_ms": round(s.wall_p50_ms, 3), "gpu_p50_ms": s.gpu_p50_ms} for s in stages
        }
        if args.profile is not None and runner is not None:
            _profile(lambda: variant.track(obj, rgb, depth, K, reg.cam_from_mesh), args.profile, variant.device,
                     "track requests through the captured step")
            out["profile"] = str(args.profile)
    finally:
        service.close()
    return out


def _profile(fn, path: Path, device: torch.device, what: str, requests: int = 20) -> None:
    """torch.profiler over ``requests`` calls of ``fn``: the top 25 ops by CUDA and by CPU time, appended as text."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(requests):
            fn()
    averages = prof.key_averages()
    sort_cuda = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    text = (
        f"{requests} {what}\n\n== top 25 by CUDA time ==\n"
        + averages.table(sort_by=sort_cuda, row_limit=25)
        + "\n\n== top 25 by CPU time ==\n"
        + averages.table(sort_by="cpu_time_total", row_limit=25)
        + "\n\n"
    )
    with Path(path).open("a", encoding="utf-8") as f:
        f.write(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m foundationpose.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda (default auto)")
    parser.add_argument("--backend", default="torch", choices=["torch", "onnxruntime", "tensorrt"])
    parser.add_argument("--precision", default="auto", help="auto (fp16 on CUDA) | fp32 | fp16 | bf16")
    parser.add_argument("--weights", type=Path, default=None, help="weights root (default: random weights)")
    parser.add_argument("--fast", action="store_true",
                        help="torch fast path on CUDA: half weights, channels-last, torch.compile for the register "
                        "batch, CUDA graphs for track batches up to --track-max-batch (NetworkConfig.fast_path)")
    parser.add_argument("--no-compile", action="store_true", help="with --fast: skip torch.compile (faster start-up)")
    parser.add_argument("--compile-track", action="store_true",
                        help="with --fast: torch.compile the track refiner too (captured inside the track graphs)")
    parser.add_argument("--compile-track-step", action="store_true",
                        help="torch.compile the pose update and crop windows of each captured track step (fewer "
                        "launches per replay; values within rounding; EstimatorConfig.compile_track_step)")
    parser.add_argument("--pad-input", action="store_true",
                        help="torch: the first conv on 8 input channels (2 zero planes; another cuDNN kernel)")
    parser.add_argument("--fold-bn", action="store_true",
                        help="torch: fold the batch norms into the convolutions (values within rounding; opt-in)")
    parser.add_argument("--switch-interval-ms", type=float, default=None,
                        help="sys.setswitchinterval for the run (process-wide; Python's default 5 ms): how long a "
                        "thread holding the GIL keeps it while others wait, e.g. 0.5 with 64 session threads")
    parser.add_argument("--compile-cache", type=Path, default=None,
                        help="a torch.compile cache file (foundationpose.compile_cache): loaded before start-up when "
                        "it exists, written at the end when it did not (startup_s then shows a fresh machine's "
                        "start with the file); unpickled: only a file a run of this wrote")
    parser.add_argument("--compile-mode", default=None,
                        help="with --fast: the torch.compile mode of the register refiner and scorer, e.g. "
                        "max-autotune-no-cudagraphs (inductor times Triton templates against cuDNN per conv and "
                        "matmul: slower start-up, kernels that may round differently: opt-in)")
    parser.add_argument("--cudnn-benchmark", action="store_true",
                        help="let cuDNN time its algorithms per conv shape (torch.backends.cudnn.benchmark, process-wide;"
                        " the chosen kernels may round differently, and may differ between runs: opt-in)")
    parser.add_argument("--register-graphs", choices=("auto", "on", "off"), default="auto",
                        help="a register's refine iterations and scorer as one CUDA graph (foundationpose."
                        "register_graph): auto = where they can be captured (CUDA, --renderer triton, torch "
                        "networks), on = the graph runner everywhere (eager off CUDA), off = iteration by iteration")
    parser.add_argument("--hypotheses", type=int, default=None, help="register hypotheses (default 252)")
    parser.add_argument("--register-iterations", type=int, default=5, help="default 5")
    parser.add_argument("--track-iterations", type=int, default=2, help="default 2")
    parser.add_argument("--image", default="640x480", help="WxH of the synthetic frames (default 640x480)")
    parser.add_argument("--runs", type=int, default=10, help="timed runs per latency figure (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs first (default 2)")
    parser.add_argument("--frames-in-flight", type=int, default=2, help="pipelined register frames (default 2)")
    parser.add_argument("--register-frames", type=int, default=12, help="frames for the throughput run")
    parser.add_argument("--sessions", default="1,64", help="track session counts (default 1,64)")
    parser.add_argument("--track-frames", type=int, default=20, help="frames per session (default 20)")
    parser.add_argument("--session-models", default="threads,asyncio,asyncio-pool",
                        help="how the concurrent sessions wait (foundationpose.bench.sessions): threads (a thread "
                        "per session), asyncio (coroutines of one event loop, as the server), asyncio-pool (the "
                        "same, each submit in a pool of 4 threads); default all three")
    parser.add_argument("--track-max-batch", type=int, default=32,
                        help="sessions merged per refiner call (default 32: as fast as 64 at 64 sessions on the H200, "
                        "0.65 GiB less memory)")
    parser.add_argument("--track-batches-in-flight", type=int, default=3,
                        help="track batches in the lane at once (ServiceConfig.track_batches_in_flight, default 3): "
                        "more lets the host stage batch k+1.. while the GPU runs batch k")
    parser.add_argument("--no-track-inline", action="store_true",
                        help="a track into an idle lane still goes through the batcher (ServiceConfig.track_inline=False)")
    parser.add_argument("--stage-in-caller", default=True, action=argparse.BooleanOptionalAction,
                        help="each track request stages its images in its own thread (ServiceConfig.track_stage_in_caller; "
                        "default on; --no-stage-in-caller: the lane stacks whole batches)")
    parser.add_argument("--page-locked-frames", action="store_true",
                        help="the sessions' frames lie in page-locked memory (PoseService.page_locked_frames, as a "
                        "producer writing its frames there would leave them): no staging copy per request")
    parser.add_argument("--step-in-batcher", default=True, action=argparse.BooleanOptionalAction,
                        help="the graphed track lane's step runs in the batcher's thread (ServiceConfig."
                        "track_step_in_batcher; default on; --no-step-in-batcher: a stage thread of its own)")
    parser.add_argument("--no-driver-launch", action="store_true",
                        help="staged track batches go to the GPU by PyTorch calls, not driver calls that keep the GIL "
                        "(ServiceConfig.track_driver_launch=False; driver launches need staged images: --stage-in-caller)")
    parser.add_argument("--depth-filter-impl", choices=("auto", "torch", "triton"), default=None,
                        help="depth-filter implementation: auto = Triton kernels on CUDA when triton imports, else torch "
                        "(default: $FP_DEPTH_FILTER_IMPL, else auto)")
    parser.add_argument("--network-input-impl", choices=("auto", "torch", "triton"), default="auto",
                        help="how the refiner/scorer inputs are written: auto = one Triton launch per branch on CUDA "
                        "when triton imports, else the eager torch ops (same bits; default auto)")
    parser.add_argument("--renderer", default="auto", choices=["auto", "cpu", "nvdiffrast", "triton"],
                        help="render backend (default auto: nvdiffrast on CUDA); triton is the capturable one")
    parser.add_argument("--graphs", default="both", choices=["on", "off", "both"],
                        help="track figures with whole steps as CUDA graphs, stage by stage, or both (default)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="write torch.profiler summaries of 3 registers and 20 graph-path track requests here (text)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    try:
        _session_models(args.session_models)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    from engines.files import engine_files  # an application: it wires the engines package in
    from foundationpose.compile_cache import load_compile_cache, save_compile_cache
    from foundationpose.estimator import EstimatorConfig, PoseEstimator, resolve_device
    from foundationpose.networks import NetworkConfig
    from foundationpose.sampling.depth_filters import impl_from_env
    from foundationpose.service import PoseService, ServiceConfig

    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    if args.switch_interval_ms is not None:
        if args.switch_interval_ms <= 0:
            parser.error(f"--switch-interval-ms must be > 0, got {args.switch_interval_ms}")
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    if args.cudnn_benchmark:  # before any network runs: the first call of each shape times the candidates
        torch.backends.cudnn.benchmark = True
    w, h = (int(v) for v in args.image.lower().split("x"))
    sessions = [int(s) for s in args.sessions.split(",") if s]
    track_max = max(1, min(args.track_max_batch, max(sessions)))
    fast = args.fast and cuda and args.backend == "torch"
    net_cfg = NetworkConfig(weights=args.weights, backend=args.backend, precision=args.precision,
                            fold_batchnorm=args.fold_bn, pad_input_channels=args.pad_input,
                            compile_mode=args.compile_mode)
    if fast:
        net_cfg = net_cfg.fast_path(track_max, compile=not args.no_compile, compile_track=args.compile_track,
                                    fold_batchnorm=args.fold_bn, pad_input_channels=args.pad_input)
    config = EstimatorConfig(
        num_hypotheses=args.hypotheses,
        register_iterations=args.register_iterations,
        track_iterations=args.track_iterations,
        depth_filter_impl=args.depth_filter_impl or impl_from_env(os.environ),
        network_input_impl=args.network_input_impl,
        track_graphs=False,  # the register figures and the graphs_off track figures
        compile_track_step=args.compile_track_step,
        register_graphs={"auto": None, "on": True, "off": False}[args.register_graphs],
    )
    t0 = time.perf_counter()
    cache = load_compile_cache(args.compile_cache) if args.compile_cache is not None else None
    est = PoseEstimator.create(device=device, config=config, network_config=net_cfg, renderer=args.renderer,
                               engine_files=engine_files)
    n_hyp = len(est.rotation_grid())  # create() already compiled / captured on CUDA
    startup_s = time.perf_counter() - t0
    K = DEMO_K.copy()
    K[0] *= w / 640.0  # the demo intrinsics, scaled to the requested image size
    K[1] *= h / 480.0
    obj, rgb, depth, mask = _scene(est, (h, w), K)

    def sync_register():
        return est.register(obj, rgb, depth, mask, K)

    for _ in range(args.warmup):
        reg = sync_register()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    register_sync = _latency(sync_register, args.runs)
    peak_register_gib = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    reg = sync_register()
    sync_breakdown = {k: round(v, 3) for k, v in reg.timings_ms.items()}
    register_step = _register_step_times(est, obj, rgb, depth, mask, K)
    if args.profile is not None:
        args.profile.write_text("", encoding="utf-8")
        _profile(sync_register, args.profile, device, "registers (reference path)", requests=3)

    service_config = ServiceConfig(frames_in_flight=args.frames_in_flight, track_max_batch=track_max,
                                   track_batches_in_flight=args.track_batches_in_flight, max_image_hw=(h, w),
                                   track_stage_in_caller=args.stage_in_caller, track_inline=not args.no_track_inline,
                                   track_driver_launch=not args.no_driver_launch,
                                   track_step_in_batcher=args.step_in_batcher)
    reference_pose = est.track(obj, rgb, depth, K, reg.cam_from_mesh).cam_from_mesh
    track_modes = {}
    for graphs in {"off": [False], "on": [True], "both": [False, True]}[args.graphs]:
        variant = est if not graphs else PoseEstimator(
            est.networks, est.renderer, device=device, config=dataclasses.replace(config, track_graphs=True)
        )
        track_modes["graphs_on" if graphs else "graphs_off"] = _track_figures(
            variant, service_config, obj, rgb, depth, K, reg, sessions, args, reference_pose
        )
    first = next(iter(track_modes.values()))
    # The graphed track variants (their captured steps and graph pools, up to 64 sessions) are not the register's:
    # free them before the register memory is measured.
    del variant
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()

    service = PoseService(est, service_config)
    try:
        for _ in range(args.warmup):
            pipelined_reg = service.register(obj, rgb, depth, mask, K)
        pipelined_trk = service.track(obj, rgb, depth, K, reg.cam_from_centred, prev_frame="centred")
        sync_trk = est.track(obj, rgb, depth, K, reg.cam_from_centred, prev_frame="centred")
        agreement = {
            "register_pose_max_abs_diff": float(np.abs(pipelined_reg.cam_from_mesh - reg.cam_from_mesh).max()),
            "register_score_abs_diff": abs(pipelined_reg.score - reg.score),
            "track_pose_max_abs_diff": float(np.abs(pipelined_trk.cam_from_mesh - sync_trk.cam_from_mesh).max()),
        }
        register_pipe_single = _latency(lambda: service.register(obj, rgb, depth, mask, K), args.runs)
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        resident_gib = torch.cuda.memory_allocated(device) / 2**30 if cuda else None  # weights, pools, track lane
        t0 = time.perf_counter()
        futures = [service.submit_register(obj, rgb, depth, mask, K) for _ in range(args.register_frames)]
        concurrent = [f.result().cam_from_mesh for f in futures]
        pipe_elapsed = time.perf_counter() - t0
        # registers of one frame agree bit for bit however many run at once (a race of the lanes would not)
        agreement["register_concurrent_differing"] = sum(
            not np.array_equal(p, pipelined_reg.cam_from_mesh) for p in concurrent)
        agreement["register_concurrent_non_finite"] = sum(not np.isfinite(p).all() for p in concurrent)
        if agreement["register_concurrent_differing"]:
            log.warning("%d of %d concurrent registers differ from the lone one (%d non-finite): a race in the "
                        "register lane", agreement["register_concurrent_differing"], len(concurrent),
                        agreement["register_concurrent_non_finite"])
        peak_pipelined_gib = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
        register_pipe_fps = args.register_frames / pipe_elapsed
        sync_fps = 1e3 / register_sync["p50_ms"]

        register_stages = {s.name: round(s.wall_p50_ms, 3) for s in service.stats().register.stages}
        register_gpu = {s.name: s.gpu_p50_ms for s in service.stats().register.stages}
    finally:
        service.close()

    report = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "settings": {
            "backend": args.backend,
            "precision": est.networks.precision,
            "fast_path": fast,
            "compile": net_cfg.compile,
            "fold_batchnorm": net_cfg.fold_batchnorm,
            "compile_track": net_cfg.compile_track,
            "compile_mode": net_cfg.compile_mode,
            "pad_input_channels": net_cfg.pad_input_channels,
            "hypotheses": n_hyp,
            "register_iterations": args.register_iterations,
            "track_iterations": args.track_iterations,
            "image": f"{w}x{h}",
            "renderer": est.renderer.name,
            "network_input_impl": args.network_input_impl,
            "graphs": args.graphs,
            # the register figures' path: captured ("graph"), the graph runner eagerly ("eager runner"), or "stages"
            "register_path": _register_path(est),
            "random_weights": est.networks.random_weights,
            "frames_in_flight": args.frames_in_flight,
            "track_max_batch": track_max,
            "track_batches_in_flight": args.track_batches_in_flight,
            "track_stage_in_caller": args.stage_in_caller,
            "track_driver_launch": not args.no_driver_launch,
            "track_step_in_batcher": args.step_in_batcher,
            "session_models": args.session_models,
            "page_locked_frames": args.page_locked_frames,
            "track_inline": not args.no_track_inline,
            "cudnn_benchmark": args.cudnn_benchmark,
            "switch_interval_ms": round(sys.getswitchinterval() * 1e3, 3),
            "compile_track_step": args.compile_track_step,
        },
        "startup_s": round(startup_s, 2),
        "register_sync": register_sync,
        "register_sync_breakdown_ms": sync_breakdown,
        # the captured register's refine + score alone: GPU ms of one replay vs the host's launch ms (None: stages)
        "register_step": register_step,
        "pipelined_vs_sync": agreement,
        "register_pipelined_single": register_pipe_single,
        "register_throughput_fps": {
            "sync": round(sync_fps, 2),
            "pipelined": round(register_pipe_fps, 2),
            "speedup": round(register_pipe_fps / sync_fps, 3),
        },
        "track_sync": first["track_sync"],
        "track_sync_breakdown_ms": first["track_sync_breakdown_ms"],
        "track_pipelined_single": first["track_pipelined_single"],
        "track_sessions": first["track_sessions"],
        "track_modes": track_modes,
        "peak_gpu_mem_gib": {
            "register_sync": round(peak_register_gib, 3) if cuda else None,
            "register_pipelined": round(peak_pipelined_gib, 3) if cuda else None,
            # of which resident before the burst: the weights, both lanes' pools, the service's track lane
            "register_pipelined_resident": round(resident_gib, 3) if cuda else None,
        },
        "pipelined_stage_p50_ms": {"register": register_stages, "track": first["pipelined_track_stage_ms"]},
        "pipelined_register_gpu_p50_ms": register_gpu,
    }
    if cache is not None:  # saved at the end: by now everything this run compiles has compiled
        saved = 0 if cache.loaded else save_compile_cache(args.compile_cache)
        report["compile_cache"] = {"path": cache.path, "loaded": cache.loaded, "artifacts": cache.artifacts,
                                   "reason": cache.reason, "saved_bytes": saved}
    emit_json_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
