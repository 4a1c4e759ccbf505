"""``python -m foundationpose.demo``: register the first frame of a recorded sequence, track the rest.

With no arguments it runs on the bundled synthetic sequence (``foundationpose/data/demo_sequence``) on the
best device (CUDA when available) with deterministic random weights, and writes into ``./demo_out``:

* ``ob_in_cam/<id>.txt``  4x4 cam_from_mesh per frame (metres, ``%.18e``; the official output format, spec §7.2)
* ``track_vis/<id>.png``  RGB overlay: oriented box + axes; ``track_vis.mp4`` when OpenCV can encode MP4
* ``timing.jsonl``        one JSON line per stage and frame (``stage``, ``package_id``, ``wall_ms``, ...)
* ``errors.csv``          ADD / ADD-S per frame (metres) when the sequence has ground truth
* ``summary.json``        the summary that ``--json`` prints

Every frame's pose is judged (:mod:`foundationpose.validity`: the observed depth at the pose) and drives the
session state (:mod:`foundationpose.session_state`: tracking, uncertain, lost, recovering); the overlay shows the
state and the confidence, and the console prints titled tables (run, accuracy, trust, timing). ``--symmetry`` /
``--symmetry-tfs`` declare the object's symmetries: the register grid uses them, the written pose is the member
of its symmetry class nearest the previous answer (a symmetric flip never shows as a jump), and ADD is also
reported under them.

The default path runs frames through :class:`foundationpose.service.PoseService` and overlaps each
frame's compute with reading the next frame and writing the previous one; ``--sync`` runs the synchronous
reference path (:class:`foundationpose.estimator.PoseEstimator`) with no overlap. Both give the same poses.
Errors of this package (``PoseError``, ``DeployError``) are printed as ``TypeName: message``, exit status 1.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cv2
import numpy as np

from deploy_core.errors import DeployError
from deploy_core.timing import TimingRecorder, configure_timing_log, timed
from foundationpose import validate
from foundationpose.demo.dataset import BUNDLED_SEQUENCE_DIR, Frame, RecordedSequence, frame_rate_hint
from foundationpose.errors import InputError, PoseError
from foundationpose.runtime_options import add_runtime_options, runtime_from_options
from foundationpose.symmetry import add_symmetry_options, symmetries_of_options

if TYPE_CHECKING:
    from foundationpose.service import ServiceStats
    from foundationpose.symmetry import Symmetry

__all__ = ["DEFAULT_DATA_DIR", "DemoConfig", "DemoSummary", "build_parser", "main", "run_demo"]

logger = logging.getLogger(__name__)

DEFAULT_DATA_DIR = BUNDLED_SEQUENCE_DIR
POSE_DIR, VIS_DIR = "ob_in_cam", "track_vis"
TIMING_FILE, ERRORS_FILE, SUMMARY_FILE, VIDEO_FILE = "timing.jsonl", "errors.csv", "summary.json", "track_vis.mp4"
# Files run_demo replaces; main() also replaces TIMING_FILE (before it opens the timing log there).
_OWN_FILES = (f"{POSE_DIR}/*.txt", f"{VIS_DIR}/*.png", ERRORS_FILE, SUMMARY_FILE, VIDEO_FILE)
RANDOM_BANNER = (
    "\n" + "!" * 72 + "\n!!  RANDOM WEIGHTS: poses are meaningless"
    "\n!!  (no official checkpoints given: deterministic random networks; timings are real)."
    "\n!!  Pass --weights DIR (official layout: DIR/<run>/model_best.pth) for real poses.\n" + "!" * 72 + "\n"
)
RANDOM_OVERLAY_LABEL = "random weights: poses meaningless"
# The README's quick try on a CPU (16 hypotheses x 5 iterations: about a minute for 3 frames); above it, say so.
CPU_QUICK_REGISTER_WORK = 16 * 5


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoConfig:
    """What the demo reads and writes (the algorithm settings live in ``EstimatorConfig``)."""

    data_dir: Path = DEFAULT_DATA_DIR
    mesh_path: Path | None = None  # None = the sequence's mesh/ file
    out_dir: Path = Path("demo_out")
    max_frames: int | None = None  # None = every frame
    sync: bool = False  # True = the synchronous reference path, no service
    write_video: bool = True
    progress: bool = True  # tqdm progress bar on stderr
    symmetries: tuple[Symmetry, ...] = ()  # the object's declared symmetries (mesh frame)

    def __post_init__(self) -> None:
        if self.max_frames is not None and self.max_frames < 1:
            raise ValueError(f"max_frames must be >= 1 or None, got {self.max_frames}")


@dataclass(frozen=True, slots=True)
class DemoSummary:
    """What a run did; ``--json`` prints it. Times in ms, errors in metres (None without ground truth)."""

    frames: int
    mode: str
    device: str
    backend: str
    precision: str
    random_weights: bool
    wall_s: float
    fps: float
    register_ms: float
    track_ms_mean: float | None
    mean_add_m: float | None
    mean_adds_m: float | None
    metrics: dict[str, Any] | None  # foundationpose.metrics.error_report of the frames (with ground truth)
    out_dir: str
    video: str | None
    notes: list[str]
    timing: dict[str, dict[str, Any]]
    timing_table: str  # human-readable per-stage table (not part of the JSON summary)
    trust: dict[str, Any] | None = None  # session states per frame, poses reported valid, confidence

    def as_json_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("timing_table")
        return out


class _Outputs:
    """Writes everything under ``out_dir``: poses, overlays, the video and the error table."""

    def __init__(self, out_dir: Path, K: np.ndarray, bounds, fps: float, write_video: bool,
                 random_weights: bool = False) -> None:
        self.out_dir, self.K, self.bounds, self.fps = out_dir, K, bounds, fps
        self.want_video = write_video
        self.warning = RANDOM_OVERLAY_LABEL if random_weights else None
        self.count = 0
        self.video: cv2.VideoWriter | None = None
        self.video_path: Path | None = None
        self.notes: list[str] = []
        self.errors: list[tuple[str, float, float]] = []
        self.pose_errors: list = []  # PoseErrors per frame with ground truth

    def write(self, frame: Frame, cam_from_mesh: np.ndarray, points_mesh: np.ndarray | None,
              status: dict[str, Any] | None = None, symmetry_tfs_mesh: np.ndarray | None = None) -> None:
        from foundationpose.demo.metrics import pose_errors
        from foundationpose.demo.overlay import draw_pose

        np.savetxt(self.out_dir / POSE_DIR / f"{frame.id}.txt", cam_from_mesh, fmt="%.18e", delimiter=" ")
        legend = "estimate: green, grey when not valid" + ("; ground truth: magenta" if frame.gt_pose is not None else "")
        overlay = draw_pose(frame.rgb, cam_from_mesh, self.K, self.bounds, gt_cam_from_mesh=frame.gt_pose,
                            labels=[f"frame {self.count} ({frame.id})", legend], warning=self.warning, status=status)
        self.count += 1
        bgr = np.ascontiguousarray(overlay[:, :, ::-1])
        cv2.imwrite(str(self.out_dir / VIS_DIR / f"{frame.id}.png"), bgr)
        if self.want_video:
            self._video_frame(bgr)
        if frame.gt_pose is not None and points_mesh is not None:
            err = pose_errors(cam_from_mesh, frame.gt_pose, points_mesh, symmetry_tfs_mesh)
            self.errors.append((frame.id, err.add_m, err.adds_m))
            self.pose_errors.append(err)

    def _video_frame(self, bgr: np.ndarray) -> None:
        if self.video is None:
            path = self.out_dir / VIDEO_FILE
            writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), self.fps, (bgr.shape[1], bgr.shape[0]))
            if not writer.isOpened():
                self.want_video = False
                self.notes.append("MP4 video skipped: this OpenCV build cannot encode mp4v")
                return
            self.video, self.video_path = writer, path
        self.video.write(bgr)

    def close(self) -> None:
        if self.video is not None:
            self.video.release()
            self.video = None
        if self.errors:
            with open(self.out_dir / ERRORS_FILE, "w", newline="", encoding="utf-8") as f:
                writer = csv.writer(f)
                writer.writerow(["frame_id", "add_m", "adds_m"])
                writer.writerows((fid, f"{add:.6f}", f"{adds:.6f}") for fid, add, adds in self.errors)


def prepare_out_dir(out_dir: Path) -> None:
    """Create ``out_dir`` and delete the files a previous demo run wrote there (and nothing else;
    ``timing.jsonl`` is left to ``main``, which may already be writing it)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError("--out", "a folder (created when missing)", f"'{out_dir}' is a file")
    try:
        for sub in (POSE_DIR, VIS_DIR):
            (out_dir / sub).mkdir(parents=True, exist_ok=True)
        for pattern in _OWN_FILES:
            for path in out_dir.glob(pattern):
                if path.is_file():
                    path.unlink()
    except OSError as exc:
        raise InputError("--out", "a writable folder", f"'{out_dir}' ({exc.strerror or exc})") from exc


class _Prefetcher:
    """Reads frame ``i + 1`` on a worker thread while frame ``i`` is processed (only the default path)."""

    def __init__(self, seq: RecordedSequence, recorder: TimingRecorder, enabled: bool) -> None:
        self.seq, self.recorder = seq, recorder
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="fp-demo-read") if enabled else None
        self.pending = None

    def _read(self, index: int) -> Frame:
        with timed("read", package_id=self.seq.ids[index], sink=self.recorder):
            return self.seq.read(index)

    def get(self, index: int) -> Frame:
        frame = self.pending.result() if self.pending is not None else self._read(index)
        self.pending = None
        if self.pool is not None and index + 1 < len(self.seq):
            self.pending = self.pool.submit(self._read, index + 1)
        return frame

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def _request(frame: Frame, K: np.ndarray, state: np.ndarray | None, limits: validate.InputLimits):
    """The frame as one validated request: register for the first frame (state None), else track from ``state``
    (the float32 cam_from_centred of the previous result)."""
    if state is None:
        return validate.register_request(frame.rgb, frame.depth, frame.mask, K, limits=limits)
    return validate.track_request(frame.rgb, frame.depth, K, state, prev_frame="centred", limits=limits)


def run_demo(config: DemoConfig, estimator, *, service_config=None) -> DemoSummary:
    """Register frame 0 and track the rest of ``config.data_dir`` with ``estimator`` (a ``PoseEstimator``).

    Default path: a :class:`~foundationpose.service.PoseService` over ``estimator`` (sized by
    ``service_config``, default: one sequence of the sequence's image size); while a frame computes, the
    previous frame's outputs are written and the next frame is read. ``config.sync``: the estimator's
    synchronous calls, one step after the other. Writes the outputs listed in the module docstring and
    returns the summary; the caller configures the timing log (``configure_timing_log``) if it wants one.
    """
    from foundationpose.demo.metrics import error_report, model_points
    from foundationpose.demo.trust import TrustLog

    seq = RecordedSequence(config.data_dir, max_frames=config.max_frames)
    mesh_path = config.mesh_path or seq.mesh_path
    if mesh_path is None:
        raise InputError("--mesh", "a mesh file (the sequence has no mesh/ folder)", "none")
    prepare_out_dir(config.out_dir)
    obj = estimator.load_object(mesh_path, symmetries=config.symmetries)
    points = model_points(obj.mesh).points if seq.has_ground_truth else None
    symmetry = obj.symmetry
    trust = TrustLog(obj)
    recorder = TimingRecorder()
    outputs = _Outputs(config.out_dir, seq.K, obj.oriented_bounds, frame_rate_hint(seq.ids), config.write_video,
                       random_weights=bool(estimator.networks.random_weights))
    service = None
    if not config.sync:
        from foundationpose.service import PoseService, ServiceConfig

        service = PoseService(estimator, service_config or ServiceConfig(
            frames_in_flight=1, track_batches_in_flight=1, track_max_batch=1, track_max_wait_ms=0.0,
            max_image_hw=seq.image_hw))
    reader = _Prefetcher(seq, recorder, enabled=service is not None)
    step_ms: list[float] = []
    # computed, not yet written (pipelined path): the frame, whether it was the register, its result
    pending: list[tuple[Frame, bool, Any]] = []

    def write_pending() -> None:
        while pending:
            frame_done, registered, result_done = pending.pop(0)
            with timed("write", package_id=frame_done.id, sink=recorder):
                shown, status = trust.step(result_done, register=registered)
                outputs.write(frame_done, shown, points, status, None if symmetry is None else symmetry.tfs_mesh)

    bar = _progress(len(seq), config)
    start = time.perf_counter()
    service_stats: ServiceStats | None = None
    failed = True
    try:
        state = None  # float32 cam_from_centred: the exact tracking state, as the reference keeps it
        for index in range(len(seq)):
            frame = reader.get(index)
            if index == 0 and frame.mask is None:
                raise InputError(f"masks/{frame.id}.png", "the first frame's mask", "no such file")
            with timed("demo_register" if index == 0 else "demo_track", package_id=frame.id, sink=recorder) as t:
                request = _request(frame, seq.K, state, service.limits if service is not None else estimator.limits)
                if service is None:
                    result = estimator.run(obj, request)
                else:
                    future = service.submit(obj, request, key=str(config.data_dir))
                    write_pending()  # overlaps with this frame's compute
                    result = future.result()
            step_ms.append(t.record.wall_ms)
            pending.append((frame, index == 0, result))
            state = result.cam_from_centred
            if service is None:
                write_pending()
            bar.update(1)
        write_pending()
        if service is not None:
            service_stats = service.stats()
        failed = False
    finally:
        bar.close()
        reader.close()
        outputs.close()
        if service is not None:
            service.close(abort=failed)  # on an error or Ctrl-C, do not wait for frames in flight
    wall_s = time.perf_counter() - start
    timing = {**estimator.recorder.summary(), **_service_timing(service_stats), **recorder.summary()}
    tables = (["Estimator: register and track steps\n" + estimator.recorder.format_table()] if service is None
              else [service.timing_summary()])
    tables.append("Demo loop: frame reads, each frame's step end to end (demo_register, demo_track), output "
                  "writes\n" + recorder.format_table())
    errors = np.array([e[1:] for e in outputs.errors]) if outputs.errors else None
    networks = estimator.networks
    return DemoSummary(
        frames=len(seq),
        mode="sync" if config.sync else "pipelined",
        device=str(estimator.device),
        backend=getattr(networks.refiner, "backend", None) or type(networks.refiner).__name__,
        precision=networks.precision,
        random_weights=bool(networks.random_weights),
        wall_s=wall_s,
        fps=len(seq) / wall_s if wall_s > 0 else float("nan"),
        register_ms=step_ms[0],
        track_ms_mean=float(np.mean(step_ms[1:])) if len(step_ms) > 1 else None,
        mean_add_m=None if errors is None else float(errors[:, 0].mean()),
        mean_adds_m=None if errors is None else float(errors[:, 1].mean()),
        metrics=error_report(outputs.pose_errors, obj.diameter) if outputs.pose_errors else None,
        out_dir=str(config.out_dir),
        video=None if outputs.video_path is None else str(outputs.video_path),
        notes=outputs.notes,
        timing=timing,
        timing_table="\n\n".join(tables),
        trust=trust.summary(),
    )


def _service_timing(stats: ServiceStats | None) -> dict[str, dict[str, Any]]:
    """``{"<lane>/<stage>": {count, p50, p90, ...}}`` from ``PoseService.stats()`` (ms); empty without a service."""
    out: dict[str, dict[str, Any]] = {}
    lanes = () if stats is None else (("register", stats.register), ("track", stats.track))
    for lane, pipeline_stats in lanes:
        for stage in pipeline_stats.stages:
            out[f"{lane}/{stage.name}"] = {"count": stage.count, "p50": stage.wall_p50_ms, "p90": stage.wall_p90_ms,
                                           "busy_ms": stage.busy_ms_total, "gpu_p50": stage.gpu_p50_ms,
                                           "queue_wait_p50": stage.queue_wait_p50_ms}
    return out


def _progress(total: int, config: DemoConfig):
    from tqdm import tqdm

    return tqdm(total=total, file=sys.stderr, unit="frame", disable=not config.progress, mininterval=0.5,
                desc="sync" if config.sync else "pipelined",
                bar_format="{desc}: frame {n_fmt}/{total_fmt} |{bar:20}| {elapsed}<{remaining}, {rate_fmt}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m foundationpose.demo",
        description="Register the first frame of an RGB-D sequence (official layout: cam_K.txt, rgb/, depth/, "
        "masks/, mesh/) and track the rest; write poses, overlays and timings.",
    )
    p.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR, metavar="DIR",
                   help="sequence folder (default: the bundled synthetic sequence)")
    p.add_argument("--mesh", type=Path, default=None, metavar="FILE",
                   help="object mesh in metres, OBJ/PLY/GLB (default: the sequence's mesh/ file)")
    add_runtime_options(p)
    p.add_argument("--out", type=Path, default=Path("demo_out"), metavar="DIR",
                   help="output folder, created if missing; files of an earlier demo run are replaced, nothing "
                   "else is touched (default: ./demo_out)")
    p.add_argument("--max-frames", type=_positive_int, default=None, metavar="N",
                   help="process only the first N frames (default: all)")
    p.add_argument("--sync", action="store_true",
                   help="use the synchronous reference path instead of the pipelined service (default: off)")
    p.add_argument("--hypotheses", type=_positive_int, default=252, metavar="N",
                   help="rotation hypotheses at register, evenly subsampled from the 252-pose grid (default: 252)")
    p.add_argument("--register-iterations", type=_positive_int, default=5, metavar="N",
                   help="refine iterations on the first frame (default: 5)")
    p.add_argument("--track-iterations", type=_positive_int, default=2, metavar="N",
                   help="refine iterations per tracked frame (default: 2)")
    add_symmetry_options(p)
    p.add_argument("--no-video", action="store_true", help="do not write track_vis.mp4 (default: write it)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr (default: show it)")
    p.add_argument("--json", action="store_true",
                   help="print the summary as one JSON object on stdout (the table then goes to stderr)")
    return p


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def _print_summary(summary: DemoSummary, as_json: bool) -> None:
    if as_json:
        print(summary.timing_table, file=sys.stderr)
        print(json.dumps(summary.as_json_dict(), default=str))
        return
    from foundationpose.demo.summary import summary_tables

    print(summary_tables(summary))
    print()
    if summary.mean_add_m is not None:
        caveat = " -- RANDOM WEIGHTS: poses meaningless, so are these errors" if summary.random_weights else ""
        print(f"mean ADD {summary.mean_add_m * 100:.2f} cm, mean ADD-S {summary.mean_adds_m * 100:.2f} cm "
              f"(per frame: {Path(summary.out_dir) / ERRORS_FILE}){caveat}")
    for note in summary.notes:
        print(f"note: {note}")
    print(f"outputs in {summary.out_dir}/")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        runtime = runtime_from_options(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        from engines.files import engine_files  # an application: it wires the engines package in
        from foundationpose.estimator import EstimatorConfig, PoseEstimator

        symmetries = symmetries_of_options(args)
        demo = DemoConfig(data_dir=args.data, mesh_path=args.mesh, out_dir=args.out, max_frames=args.max_frames,
                          sync=args.sync, write_video=not args.no_video, progress=not args.no_progress,
                          symmetries=tuple(symmetries))
        RecordedSequence(demo.data_dir, max_frames=1)  # fail on a bad --data before building the networks
        if args.out.exists() and not args.out.is_dir():
            raise InputError("--out", "a folder (created when missing)", f"'{args.out}' is a file")
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / TIMING_FILE).unlink(missing_ok=True)
        configure_timing_log(args.out / TIMING_FILE)
        try:
            estimator = PoseEstimator.create(
                runtime=runtime, engine_files=engine_files,
                config=EstimatorConfig(register_iterations=args.register_iterations,
                                       track_iterations=args.track_iterations, num_hypotheses=args.hypotheses),
            )
            if estimator.networks.random_weights:
                print(RANDOM_BANNER, file=sys.stderr)
            if estimator.device.type == "cpu" and args.hypotheses * args.register_iterations > CPU_QUICK_REGISTER_WORK:
                print(f"note: on the CPU, register with {args.hypotheses} hypotheses x {args.register_iterations} "
                      "iterations takes minutes; the README's quick try is --max-frames 3 --hypotheses 16 "
                      "(about a minute)", file=sys.stderr)
            summary = run_demo(demo, estimator)
        finally:
            configure_timing_log(None)
        (args.out / SUMMARY_FILE).write_text(json.dumps(summary.as_json_dict(), indent=2, default=str) + "\n",
                                             encoding="utf-8")
        _print_summary(summary, args.json)
        return 0
    except (PoseError, DeployError) as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
