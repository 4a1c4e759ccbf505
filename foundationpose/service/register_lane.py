"""The register lane: one package = one frame, ``frames_in_flight`` at once (bounded by the pool)::

    upload -> hypotheses -> (render_i -> refine_i) x iterations -> score_render -> score_net -> select

Where the estimator captures registers (:mod:`foundationpose.register_graph`) the lane is
:mod:`foundationpose.service.register_graph_lane` instead; both share this module's upload, hypotheses and result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from deploy_core.mempool import BufferSpec, MemBufferPool
from deploy_core.pipeline import BaseAsyncPipeline, Package, PipelineConfig, Stage
from foundationpose import validate
from foundationpose.coordinate_frames import to_mesh_frame
from foundationpose.estimator import RegisterResult
from foundationpose.mesh import ObjectModel
from foundationpose.observation import PreparedFrame, filter_and_backproject
from foundationpose.pose_update import apply_refiner_output
from foundationpose.refine import PairInputs, build_refiner_inputs, run_refiner
from foundationpose.render import Renderer
from foundationpose.score import build_scorer_inputs, run_scorer
from foundationpose.service.lane import Lane, LaneContext, fill, retire

__all__ = ["RegisterJob", "build_register_lane", "hypotheses_stage", "register_result", "upload_stage"]


@dataclass(slots=True)
class RegisterJob:
    obj: ObjectModel
    rgb: np.ndarray
    depth: np.ndarray
    mask: np.ndarray
    K: np.ndarray
    symmetry_tfs: np.ndarray | None
    iterations: int | None = None  # refine iterations of this frame (None = all the lane's)
    frame: PreparedFrame | None = None
    mask_t: Tensor | None = None
    valid_count: Tensor | None = None
    poses: Tensor | None = None
    inputs: PairInputs | None = None
    scores: Tensor | None = None
    best: Tensor | None = None
    ticket: Any = None  # the captured lane's submitted replay (foundationpose.register_graph.RegisterTicket)
    retired: list = field(default_factory=list)  # see _retire


def pool_specs(ctx: LaneContext, n: int, *, with_mask: bool, network_inputs: bool = True) -> list[BufferSpec]:
    """A register slot: pinned staging and device copies of one frame (and mask), and with ``network_inputs`` the
    (n, S, S, 6) refiner / scorer input buffers (a captured lane's live in its graph's pool instead)."""
    h, w = ctx.config.max_image_hw
    s = ctx.estimator.config.crop_size
    specs = [
        BufferSpec("rgb_host", (h, w, 3), torch.uint8, host=True),
        BufferSpec("depth_host", (h, w), torch.float32, host=True),
        BufferSpec("rgb", (h, w, 3), torch.uint8),
        BufferSpec("depth", (h, w), torch.float32),
    ]
    if network_inputs:
        specs += [BufferSpec("render_input", (n, s, s, 6), torch.float32),
                  BufferSpec("transf_input", (n, s, s, 6), torch.float32)]
    if with_mask:
        specs += [BufferSpec("mask_host", (h, w), torch.bool, host=True), BufferSpec("mask", (h, w), torch.bool)]
    return specs


def _upload(ctx: LaneContext, pkg: Package, rgb: np.ndarray, depth: np.ndarray, suffix: str = "") -> tuple[Tensor, Tensor]:
    """Copy one frame into the lease's pinned staging buffers, then to the device (async on CUDA)."""
    lease = pkg.lease
    lease.wait_host()  # the previous lessee's copies from these pinned buffers may still be pending
    h, w = depth.shape
    rgb_host = lease.view("rgb_host", (h, w, 3))
    depth_host = lease.view("depth_host", (h, w))
    fill(rgb_host, rgb)
    fill(depth_host, depth)
    rgb_dev = lease.view("rgb", (h, w, 3))
    depth_dev = lease.view("depth", (h, w))
    non_blocking = ctx.device.type == "cuda"
    rgb_dev.copy_(rgb_host, non_blocking=non_blocking)
    depth_dev.copy_(depth_host, non_blocking=non_blocking)
    return rgb_dev, depth_dev


def upload_stage(ctx: LaneContext) -> Callable[[Package], None]:
    """The lane's first stage: the frame and mask to the device, depth filters and float64 back-projection."""
    est = ctx.estimator

    def upload(pkg: Package) -> None:
        job: RegisterJob = pkg.data
        rgb_dev, depth_dev = _upload(ctx, pkg, job.rgb, job.depth)
        h, w = job.depth.shape
        mask_host = pkg.lease.view("mask_host", (h, w))
        fill(mask_host, job.mask)
        job.mask_t = pkg.lease.view("mask", (h, w))
        job.mask_t.copy_(mask_host, non_blocking=ctx.device.type == "cuda")
        job.frame = filter_and_backproject(rgb_dev, depth_dev, job.K, xyz_float64=True,
                                           impl=est.config.depth_filter_impl, constants=est.constants)

    return upload


def hypotheses_stage(ctx: LaneContext) -> Callable[[Package], None]:
    """The hypotheses of the frame (grid rotations, guessed translation) and its masked-depth count, no sync."""
    est = ctx.estimator

    def hypotheses(pkg: Package) -> None:
        job: RegisterJob = pkg.data
        job.poses = est.hypotheses(job.frame, job.mask_t, job.symmetry_tfs)
        # validity (spec §1.2 step 3) is read on the host only in `select`: no sync here
        job.valid_count = validate.masked_depth_count(job.frame.depth, job.mask_t)

    return hypotheses


def register_result(pkg: Package, cam_from_centred: np.ndarray, score: float) -> RegisterResult:
    """The package's RegisterResult from its pick (float32 cam_from_centred and score), with its stage timings."""
    job: RegisterJob = pkg.data
    timings = {r.stage: r.wall_ms for r in pkg.timings}
    timings["total"] = sum(timings.values())
    return RegisterResult(
        cam_from_mesh=to_mesh_frame(cam_from_centred, job.obj.centred_from_mesh),
        score=score,
        timings_ms=timings,
        cam_from_centred=cam_from_centred,
    )


def build_register_lane(ctx: LaneContext) -> Lane:
    est = ctx.estimator
    n_max = len(est.rotation_grid())
    pool = MemBufferPool(
        pool_specs(ctx, max(n_max, 1), with_mask=True), slots=ctx.config.frames_in_flight, device=ctx.device
    )
    crop = est.config.crop_size
    streams = ctx.stream_factory()

    def build_inputs(pkg: Package, build: Callable[..., PairInputs], renderer: Renderer) -> None:
        """Render + warp the frame's hypotheses straight into the lease's network-input buffers."""
        job: RegisterJob = pkg.data
        n = len(job.poses)
        retire(job.retired, job.inputs)
        job.inputs = build(
            job.poses,
            job.frame,
            job.obj,
            renderer,
            crop_size=crop,
            constants=est.constants,
            out_render=pkg.lease.view("render_input", (n, crop, crop, 6)),
            out_transf=pkg.lease.view("transf_input", (n, crop, crop, 6)),
            impl=est.config.network_input_impl,
        )

    def runs(job: RegisterJob, i: int) -> bool:
        """Whether refine iteration ``i`` applies to this frame (a request may ask for fewer than the lane has)."""
        return job.iterations is None or i < job.iterations

    def render_stage(i: int, renderer: Renderer) -> Callable[[Package], None]:
        def render(pkg: Package) -> None:
            if runs(pkg.data, i):
                build_inputs(pkg, build_refiner_inputs, renderer)

        return render

    def refine_stage(i: int) -> Callable[[Package], None]:
        def refine(pkg: Package) -> None:
            job: RegisterJob = pkg.data
            if not runs(job, i):
                return
            trans, rot = run_refiner(est.networks.refiner, job.inputs)
            retire(job.retired, job.poses)
            job.poses = apply_refiner_output(job.poses, trans, rot, job.obj.diameter)

        return refine

    score_renderer = ctx.new_renderer()

    def score_render(pkg: Package) -> None:
        build_inputs(pkg, build_scorer_inputs, score_renderer)

    def score_net(pkg: Package) -> None:
        job: RegisterJob = pkg.data
        job.scores = run_scorer(est.networks.scorer, job.inputs)
        job.best = torch.argmax(job.scores)  # first maximum: ties go to the lowest index (spec §5)

    def select(pkg: Package) -> None:
        job: RegisterJob = pkg.data
        if pkg.ready_event is not None:
            pkg.ready_event.synchronize()  # the one host sync of the frame
        validate.require_masked_depth_count(int(job.valid_count))
        best = int(job.best)
        cam_from_centred = job.poses[best].cpu().numpy().astype(np.float32)
        pkg.data = register_result(pkg, cam_from_centred, float(job.scores[best]))

    stages = [Stage("upload", upload_stage(ctx), stream_factory=streams),
              Stage("hypotheses", hypotheses_stage(ctx), stream_factory=streams)]
    for i in range(est.config.register_iterations):
        stages.append(Stage(f"render_{i}", render_stage(i, ctx.new_renderer()), stream_factory=streams))
        stages.append(Stage(f"refine_{i}", refine_stage(i), stream_factory=streams))
    stages += [
        Stage("score_render", score_render, stream_factory=streams),
        Stage("score_net", score_net, stream_factory=streams),
        Stage("select", select),
    ]
    pipeline = BaseAsyncPipeline(stages, PipelineConfig(queue_capacity=ctx.config.queue_capacity), pool=pool,
                                 name="register")
    return Lane(pipeline, pool)
