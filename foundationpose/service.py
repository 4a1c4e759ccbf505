"""The pipelined fast path: register and track lanes on ``BaseAsyncPipeline``.

Register lane (one package = one frame, ``frames_in_flight`` at once, bounded by the pool)::

    upload -> hypotheses -> (render_i -> refine_i) x iterations -> score_render -> score_net -> select

Track lane (one package = a batch of frames of different sessions, collected by a
:class:`~deploy_core.batching.MicroBatcher` for at most ``track_max_wait_ms``)::

    upload -> (render_i -> refine_i) x iterations -> finish

Every GPU stage runs on its own CUDA stream; hand-offs are CUDA events recorded by the
pipeline (``pkg.ready_event``), so the host synchronises once per package, in the last
stage, where it reads the answer. Track has its own lane, so it never queues behind a
register. The stages call the same functions as the synchronous reference path
(:mod:`foundationpose.estimator`), so both return the same poses.

Memory: each in-flight package leases a slot of a :class:`MemBufferPool` holding, at their
maximum shapes, the pinned host staging images, the device images, the hypothesis poses,
both network inputs and the network outputs. Intermediate tensors of the filters, renderer
and warps come from PyTorch's caching allocator, which a warm-up frame at start-up fills,
so steady-state frames do not call ``cudaMalloc``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from deploy_core.batching import MicroBatcher
from deploy_core.cuda import new_stream
from deploy_core.mempool import BufferSpec, MemBufferPool
from deploy_core.pipeline import BaseAsyncPipeline, Package, PipelineConfig, Stage
from foundationpose import validate
from foundationpose.errors import InputError
from foundationpose.estimator import (
    PoseEstimator,
    RegisterResult,
    TrackResult,
    to_centred_frame,
    to_mesh_frame,
)
from foundationpose.frame import PreparedFrame, filter_and_backproject, filter_and_backproject_stacked
from foundationpose.mesh import ObjectModel
from foundationpose.pose_update import apply_refiner_output
from foundationpose.refine import (
    PairInputs,
    build_refiner_inputs,
    build_refiner_inputs_per_frame,
    run_refiner,
)
from foundationpose.render import Renderer, make_renderer
from foundationpose.score import build_scorer_inputs, run_scorer

__all__ = ["PoseService", "ServiceConfig"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceConfig:
    """Sizing of the two lanes.

    frames_in_flight: register frames in the pipeline at once (= register pool slots).
    track_batches_in_flight: track batches in the pipeline at once (= track pool slots).
    track_max_batch: most track requests (sessions) merged into one refiner call.
    track_max_wait_ms: how long the first track request of a batch waits for company.
    max_image_hw: largest (H, W) accepted; the pool's image buffers have this size.
    queue_capacity: packages waiting in front of each stage.
    pending_requests: track requests that may wait for a batch before submit blocks.
    """

    frames_in_flight: int = 2
    track_batches_in_flight: int = 3
    track_max_batch: int = 16
    track_max_wait_ms: float = 1.0
    max_image_hw: tuple[int, int] = (1080, 1920)
    queue_capacity: int = 2
    pending_requests: int = 256

    def __post_init__(self) -> None:
        for name in ("frames_in_flight", "track_batches_in_flight", "track_max_batch", "queue_capacity"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.track_max_wait_ms < 0:
            raise ValueError(f"track_max_wait_ms must be >= 0, got {self.track_max_wait_ms}")


@dataclass(slots=True)
class _RegisterJob:
    obj: ObjectModel
    rgb: np.ndarray
    depth: np.ndarray
    mask: np.ndarray
    K: np.ndarray
    symmetry_tfs: np.ndarray | None
    frame: PreparedFrame | None = None
    mask_t: Tensor | None = None
    valid_count: Tensor | None = None
    poses: Tensor | None = None
    inputs: PairInputs | None = None
    scores: Tensor | None = None
    best: Tensor | None = None
    retired: list = field(default_factory=list)  # see _retire


@dataclass(slots=True, eq=False)
class _TrackGroup:
    """The jobs of one track batch with the same object and image size: rendered and warped in one call each.

    rows: their rows in the batch's network inputs (contiguous).  rgb, xyz: (m, H, W, 3) float32 stacked frames
    (views of the batch's filtered block).  Ks: (m, 3, 3) float64.  poses: (m, 4, 4) float32 cam_from_centred.
    """

    obj: ObjectModel
    rows: slice
    rgb: Tensor
    xyz: Tensor
    Ks: np.ndarray
    poses: Tensor
    retired: list = field(default_factory=list)  # see _retire


@dataclass(slots=True)
class _TrackJob:
    obj: ObjectModel
    rgb: np.ndarray
    depth: np.ndarray
    K: np.ndarray
    start: np.ndarray  # (4, 4) float32 cam_from_centred
    frame: PreparedFrame | None = None
    group: _TrackGroup | None = None
    index: int = 0  # row within its group


@dataclass(slots=True)
class _Lane:
    pipeline: BaseAsyncPipeline
    pool: MemBufferPool
    renderers: dict[str, Renderer] = field(default_factory=dict)


class PoseService:
    """Pipelined register/track over a :class:`PoseEstimator`'s networks and settings.

    ``submit_register`` / ``submit_track`` return ``concurrent.futures.Future`` objects
    (bridge to asyncio with ``asyncio.wrap_future``). With ``timeout`` they raise
    :class:`~deploy_core.errors.BusyError` instead of blocking when the lane is full; after
    :meth:`close` they raise :class:`~deploy_core.errors.ClosedError`.
    """

    def __init__(self, estimator: PoseEstimator, config: ServiceConfig = ServiceConfig()) -> None:
        self.estimator = estimator
        self.config = config
        self.device = estimator.device
        self._register = self._build_register_lane()
        self._track = self._build_track_lane()
        # Create every render stage's renderer now (an nvdiffrast context each), not on a first request.
        for lane in (self._register, self._track):
            for stage in lane.pipeline.stages:
                if stage.name.startswith(("render_", "score_render")):
                    self._renderer_for(lane, stage.name)
        self._batcher = MicroBatcher(
            self._track.pipeline,
            max_batch=config.track_max_batch,
            max_wait_s=config.track_max_wait_ms / 1e3,
            capacity=config.pending_requests,
            name="track-batcher",
        )

    # -- public API -------------------------------------------------------------------------

    def submit_register(
        self,
        obj: ObjectModel,
        rgb: np.ndarray,
        depth: np.ndarray,
        mask: np.ndarray,
        K: np.ndarray,
        *,
        symmetry_tfs: np.ndarray | None = None,
        timeout: float | None = None,
    ) -> Future[RegisterResult]:
        """Queue a register (see :meth:`PoseEstimator.register`; inputs are validated here)."""
        rgb, depth, K = self._validated(rgb, depth, K)
        mask = validate.validate_mask(mask, depth.shape)
        job = _RegisterJob(obj, rgb, depth, mask, K, symmetry_tfs)
        return self._register.pipeline.submit(job, timeout=timeout)

    def submit_track(
        self,
        obj: ObjectModel,
        rgb: np.ndarray,
        depth: np.ndarray,
        K: np.ndarray,
        prev_pose: np.ndarray,
        *,
        key: Any = None,
        prev_frame: str = "mesh",
        timeout: float | None = None,
    ) -> Future[TrackResult]:
        """Queue a track step (see :meth:`PoseEstimator.track`); batched with other sessions."""
        rgb, depth, K = self._validated(rgb, depth, K)
        prev = validate.validate_pose(prev_pose)
        if prev_frame not in ("mesh", "centred"):
            raise ValueError(f"prev_frame must be 'mesh' or 'centred'; got {prev_frame!r}")
        start = prev.astype(np.float32) if prev_frame == "centred" else to_centred_frame(prev, obj)
        return self._batcher.submit(_TrackJob(obj, rgb, depth, K, start), key=key, timeout=timeout)

    def register(self, *args, **kwargs) -> RegisterResult:
        return self.submit_register(*args, **kwargs).result()

    def track(self, *args, **kwargs) -> TrackResult:
        return self.submit_track(*args, **kwargs).result()

    def stats(self) -> dict[str, Any]:
        return {
            "register": self._register.pipeline.stats(),
            "track": self._track.pipeline.stats(),
            "register_pool_leased": self._register.pool.leased,
            "track_pool_leased": self._track.pool.leased,
            "track_waiting": self._batcher.waiting,
            "track_batches": self._batcher.batches,
            "track_items": self._batcher.items,
        }

    def timing_summary(self) -> str:
        return "\n".join(
            lane.pipeline.recorder.format_table() for lane in (self._register, self._track)
        )

    def close(self, abort: bool = False) -> None:
        self._batcher.close(abort=abort)
        self._track.pipeline.close(abort=abort)
        self._register.pipeline.close(abort=abort)
        self._track.pool.close()
        self._register.pool.close()

    def __enter__(self) -> PoseService:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close(abort=exc_info[0] is not None)

    # -- shared helpers ---------------------------------------------------------------------

    def _validated(self, rgb, depth, K):
        rgb, depth, K = validate.validate_frame(rgb, depth, K)
        h, w = depth.shape
        max_h, max_w = self.config.max_image_hw
        if h > max_h or w > max_w:
            raise InputError("rgb", f"an image of at most {max_h}x{max_w} pixels", f"{h}x{w}")
        return rgb, depth, K

    def _stream_factory(self) -> Callable[[], Any] | None:
        if self.device.type != "cuda":
            return None
        return lambda: new_stream(self.device)

    def _renderer_for(self, lane: _Lane, stage: str) -> Renderer:
        """One renderer per render stage: backends keep per-call workspaces (not shareable)."""
        renderer = lane.renderers.get(stage)
        if renderer is None:
            base = self.estimator.renderer
            renderer = make_renderer(base.name, self.device, base.config) if self.device.type == "cuda" else base
            lane.renderers[stage] = renderer
        return renderer

    def _pool_specs(self, n: int, *, with_mask: bool) -> list[BufferSpec]:
        h, w = self.config.max_image_hw
        s = self.estimator.config.crop_size
        specs = [
            BufferSpec("rgb_host", (h, w, 3), torch.uint8, host=True),
            BufferSpec("depth_host", (h, w), torch.float32, host=True),
            BufferSpec("rgb", (h, w, 3), torch.uint8),
            BufferSpec("depth", (h, w), torch.float32),
            BufferSpec("render_input", (n, s, s, 6), torch.float32),
            BufferSpec("transf_input", (n, s, s, 6), torch.float32),
        ]
        if with_mask:
            specs += [BufferSpec("mask_host", (h, w), torch.bool, host=True), BufferSpec("mask", (h, w), torch.bool)]
        return specs

    def _upload(self, pkg: Package, rgb: np.ndarray, depth: np.ndarray, suffix: str = "") -> tuple[Tensor, Tensor]:
        """Copy one frame into the lease's pinned staging buffers, then to the device (async on CUDA)."""
        lease = pkg.lease
        h, w = depth.shape
        rgb_host = lease.view("rgb_host", (h, w, 3))
        depth_host = lease.view("depth_host", (h, w))
        _fill(rgb_host, rgb)
        _fill(depth_host, depth)
        rgb_dev = lease.view("rgb", (h, w, 3))
        depth_dev = lease.view("depth", (h, w))
        non_blocking = self.device.type == "cuda"
        rgb_dev.copy_(rgb_host, non_blocking=non_blocking)
        depth_dev.copy_(depth_host, non_blocking=non_blocking)
        return rgb_dev, depth_dev

    # -- register lane ----------------------------------------------------------------------

    def _build_register_lane(self) -> _Lane:
        est = self.estimator
        n_max = len(est.rotation_grid())
        pool = MemBufferPool(
            self._pool_specs(max(n_max, 1), with_mask=True), slots=self.config.frames_in_flight, device=self.device
        )
        crop = est.config.crop_size
        streams = self._stream_factory()
        lane = _Lane(pipeline=None, pool=pool)  # type: ignore[arg-type]

        def upload(pkg: Package) -> None:
            job: _RegisterJob = pkg.data
            rgb_dev, depth_dev = self._upload(pkg, job.rgb, job.depth)
            h, w = job.depth.shape
            mask_host = pkg.lease.view("mask_host", (h, w))
            _fill(mask_host, job.mask)
            job.mask_t = pkg.lease.view("mask", (h, w))
            job.mask_t.copy_(mask_host, non_blocking=self.device.type == "cuda")
            job.frame = filter_and_backproject(rgb_dev, depth_dev, job.K, xyz_float64=True)

        def hypotheses(pkg: Package) -> None:
            job: _RegisterJob = pkg.data
            job.poses = est.hypotheses(job.frame, job.mask_t, job.symmetry_tfs)
            # validity (spec §1.2 step 3) is read on the host only in `select`: no sync here
            job.valid_count = ((job.frame.depth >= 0.001) & job.mask_t).sum()

        def render_stage(name: str) -> Callable[[Package], None]:
            def render(pkg: Package) -> None:
                job: _RegisterJob = pkg.data
                n = len(job.poses)
                _retire(job.retired, job.inputs)
                job.inputs = build_refiner_inputs(
                    job.poses,
                    job.frame,
                    job.obj,
                    self._renderer_for(lane, name),
                    crop_size=crop,
                    out_render=pkg.lease.view("render_input", (n, crop, crop, 6)),
                    out_transf=pkg.lease.view("transf_input", (n, crop, crop, 6)),
                )

            return render

        def refine(pkg: Package) -> None:
            job: _RegisterJob = pkg.data
            trans, rot = run_refiner(est.networks.refiner, job.inputs)
            _retire(job.retired, job.poses)
            job.poses = apply_refiner_output(job.poses, trans, rot, job.obj.diameter)

        def score_render(pkg: Package) -> None:
            job: _RegisterJob = pkg.data
            n = len(job.poses)
            _retire(job.retired, job.inputs)
            job.inputs = build_scorer_inputs(
                job.poses,
                job.frame,
                job.obj,
                self._renderer_for(lane, "score_render"),
                crop_size=crop,
                out_render=pkg.lease.view("render_input", (n, crop, crop, 6)),
                out_transf=pkg.lease.view("transf_input", (n, crop, crop, 6)),
            )

        def score_net(pkg: Package) -> None:
            job: _RegisterJob = pkg.data
            job.scores = run_scorer(est.networks.scorer, job.inputs)
            job.best = torch.argmax(job.scores)  # first maximum: ties go to the lowest index (spec §5)

        def select(pkg: Package) -> None:
            job: _RegisterJob = pkg.data
            if pkg.ready_event is not None:
                pkg.ready_event.synchronize()  # the one host sync of the frame
            validate.require_masked_depth_count(int(job.valid_count))
            best = int(job.best)
            cam_from_centred = job.poses[best].cpu().numpy().astype(np.float32)
            timings = {r.stage: r.wall_ms for r in pkg.timings}
            timings["total"] = sum(timings.values())
            pkg.data = RegisterResult(
                pose=to_mesh_frame(cam_from_centred, job.obj),
                score=float(job.scores[best]),
                timings_ms=timings,
                cam_from_centred=cam_from_centred,
            )

        stages = [Stage("upload", upload, stream_factory=streams), Stage("hypotheses", hypotheses, stream_factory=streams)]
        for i in range(est.config.register_iterations):
            stages.append(Stage(f"render_{i}", render_stage(f"render_{i}"), stream_factory=streams))
            stages.append(Stage(f"refine_{i}", refine, stream_factory=streams))
        stages += [
            Stage("score_render", score_render, stream_factory=streams),
            Stage("score_net", score_net, stream_factory=streams),
            Stage("select", select),
        ]
        lane.pipeline = BaseAsyncPipeline(
            stages, PipelineConfig(queue_capacity=self.config.queue_capacity), pool=pool, name="register"
        )
        return lane

    # -- track lane -------------------------------------------------------------------------

    def _build_track_lane(self) -> _Lane:
        est = self.estimator
        n_max = self.config.track_max_batch
        crop = est.config.crop_size
        h, w = self.config.max_image_hw
        specs = [
            BufferSpec("render_input", (n_max, crop, crop, 6), torch.float32),
            BufferSpec("transf_input", (n_max, crop, crop, 6), torch.float32),
            BufferSpec("rgb_host", (n_max, h, w, 3), torch.uint8, host=True),
            BufferSpec("depth_host", (n_max, h, w), torch.float32, host=True),
            BufferSpec("rgb", (n_max, h, w, 3), torch.uint8),
            BufferSpec("depth", (n_max, h, w), torch.float32),
        ]
        pool = MemBufferPool(specs, slots=self.config.track_batches_in_flight, device=self.device)
        streams = self._stream_factory()
        lane = _Lane(pipeline=None, pool=pool)  # type: ignore[arg-type]
        non_blocking = self.device.type == "cuda"

        def upload(pkg: Package) -> None:
            """Stage, upload and filter the frames: one batched filter call per image size. Jobs are laid out
            grouped by (image size, object), so each group's frames and network-input rows are contiguous."""
            lease, jobs = pkg.lease, [item.data for item in pkg.data]
            by_hw: dict[tuple[int, int], dict[int, list[_TrackJob]]] = {}
            for job in jobs:
                by_hw.setdefault(job.depth.shape, {}).setdefault(id(job.obj), []).append(job)
            pixels, row = 0, 0  # offset into the flattened image buffers, next network-input row
            for (hh, ww), by_obj in by_hw.items():
                block = [job for group_jobs in by_obj.values() for job in group_jobs]
                m = len(block)
                views = {
                    name: lease.buffers[name].view(-1)[pixels * c : (pixels + m * hh * ww) * c].view(m, hh, ww, c)
                    for name, c in (("rgb_host", 3), ("depth_host", 1), ("rgb", 3), ("depth", 1))
                }
                pixels += m * hh * ww
                for i, job in enumerate(block):
                    _fill(views["rgb_host"][i], job.rgb)
                    _fill(views["depth_host"][i, ..., 0], job.depth)
                views["rgb"].copy_(views["rgb_host"], non_blocking=non_blocking)
                views["depth"].copy_(views["depth_host"], non_blocking=non_blocking)
                frames = filter_and_backproject_stacked(views["rgb"], views["depth"][..., 0], [j.K for j in block])
                first = 0
                for group_jobs in by_obj.values():
                    k = len(group_jobs)
                    sl = slice(first, first + k)
                    starts = np.stack([job.start for job in group_jobs])
                    group = _TrackGroup(
                        obj=group_jobs[0].obj,
                        rows=slice(row, row + k),
                        rgb=frames.rgb[sl],
                        xyz=frames.xyz[sl],
                        Ks=frames.Ks[sl],
                        poses=torch.as_tensor(starts, device=self.device),
                    )
                    for i, job in enumerate(group_jobs):
                        job.frame, job.group, job.index = frames.frames[first + i], group, i
                    first += k
                    row += k

        def render_stage(name: str) -> Callable[[Package], None]:
            def render(pkg: Package) -> None:
                n = len(pkg.data)
                render_all = pkg.lease.view("render_input", (n, crop, crop, 6))
                transf_all = pkg.lease.view("transf_input", (n, crop, crop, 6))
                renderer = self._renderer_for(lane, name)
                for group in _track_groups(pkg):  # usually one: all sessions of one object and image size
                    build_refiner_inputs_per_frame(
                        group.poses, group.rgb, group.xyz, group.Ks, group.obj, renderer, crop_size=crop,
                        out_render=render_all[group.rows], out_transf=transf_all[group.rows],
                    )

            return render

        def refine(pkg: Package) -> None:
            n = len(pkg.data)
            graph_sizes = sorted(getattr(est.networks.track_refiner, "graph_batches", ()) or ())
            # Pad to the next batch size with a captured CUDA graph: rows are independent in the
            # refiner, so the padding rows (zeros) change nothing but the launch cost.
            padded = next((b for b in graph_sizes if n <= b <= n_max), n)  # never above the pool capacity
            render_in = pkg.lease.view("render_input", (padded, crop, crop, 6))
            transf_in = pkg.lease.view("transf_input", (padded, crop, crop, 6))
            if padded > n:
                render_in[n:].zero_()
                transf_in[n:].zero_()
            inputs = PairInputs(render_input=render_in, transf_input=transf_in, crop_from_img=None)  # type: ignore[arg-type]
            trans, rot = run_refiner(est.networks.track_refiner, inputs)
            for group in _track_groups(pkg):
                _retire(group.retired, group.poses)
                group.poses = apply_refiner_output(
                    group.poses, trans[group.rows], rot[group.rows], group.obj.diameter
                )

        def finish(pkg: Package) -> None:
            if pkg.ready_event is not None:
                pkg.ready_event.synchronize()
            timings = {r.stage: r.wall_ms for r in pkg.timings}
            timings["total"] = sum(timings.values())
            host_poses = {id(group): group.poses.cpu().numpy() for group in _track_groups(pkg)}
            results = []
            for item in pkg.data:
                job: _TrackJob = item.data
                cam_from_centred = host_poses[id(job.group)][job.index].astype(np.float32)
                results.append(
                    TrackResult(
                        pose=to_mesh_frame(cam_from_centred, job.obj),
                        timings_ms=dict(timings, batch=float(len(pkg.data))),
                        cam_from_centred=cam_from_centred,
                    )
                )
            pkg.data = results

        stages = [Stage("upload", upload, stream_factory=streams)]
        for i in range(est.config.track_iterations):
            stages.append(Stage(f"render_{i}", render_stage(f"render_{i}"), stream_factory=streams))
            stages.append(Stage(f"refine_{i}", refine, stream_factory=streams))
        stages.append(Stage("finish", finish))
        lane.pipeline = BaseAsyncPipeline(
            stages, PipelineConfig(queue_capacity=self.config.queue_capacity), pool=pool, name="track"
        )
        return lane


def _track_groups(pkg: Package) -> list[_TrackGroup]:
    """The distinct groups of a track package's jobs, in row order."""
    return list({id(item.data.group): item.data.group for item in pkg.data}.values())


def _retire(retired: list, value: object) -> None:
    """Keep a replaced GPU tensor alive until its package completes (after the final host sync).

    A stage that replaces a tensor another stage's stream read (poses, inputs) must not free it at
    once: PyTorch's caching allocator would hand the block to the next allocation on the stream that
    made it, which is not ordered after the reader's stream, and the pending reads would see new data.
    """
    if value is not None:
        retired.append(value)


def _fill(host: Tensor, array: np.ndarray) -> None:
    """Copy a NumPy array into a (pinned) host tensor view, read-only arrays included."""
    host.numpy()[...] = array
