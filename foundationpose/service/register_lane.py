"""The register lane: one package = one frame, ``frames_in_flight`` at once::

    upload -> hypotheses -> refine_score -> select

``upload`` copies the frame and mask into page-locked memory and from there to the device, then filters the depth
and back-projects it; ``hypotheses`` places the rotation grid at the translation guessed from the mask and counts
the valid masked depth pixels (no host synchronisation); ``refine_score`` enqueues every refine iteration and the
scorer as one step of the estimator's :class:`~foundationpose.register_graph.RegisterGraphRunner` (one replay where
captured) without waiting for the GPU; ``select`` waits for the step's one event. The runner's steps run one after
another on its stream (the GPU is the register's bottleneck) while the threads upload, filter and sample the next
frame. The runner is the estimator's, so the lane and :meth:`PoseEstimator.register` share one set of steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from deploy_core.memory import MemBufferPool, PinnedCopies
from deploy_core.pipeline import BaseAsyncPipeline, Package, PipelineConfig, Stage
from foundationpose import validate
from foundationpose.coordinate_frames import to_mesh_frame
from foundationpose.estimator import RegisterResult
from foundationpose.mesh import ObjectModel
from foundationpose.observation import PreparedFrame, filter_and_backproject
from foundationpose.service.lane import Lane, LaneContext

__all__ = ["RegisterJob", "build_register_lane"]


@dataclass(slots=True)
class RegisterJob:
    obj: ObjectModel
    rgb: np.ndarray
    depth: np.ndarray
    mask: np.ndarray
    K: np.ndarray
    symmetry_tfs: np.ndarray | None
    iterations: int | None = None  # refine iterations of this frame (None = the estimator's)
    host: tuple[Tensor, ...] = ()  # the page-locked copies the upload reads, kept until the package completes
    frame: PreparedFrame | None = None
    mask_t: Tensor | None = None
    valid_count: Tensor | None = None
    poses: Tensor | None = None
    ticket: Any = None  # the submitted step (foundationpose.register_graph.RegisterTicket)


def build_register_lane(ctx: LaneContext) -> Lane:
    est = ctx.estimator
    runner = est.register_runner
    cuda = ctx.device.type == "cuda"
    copies = PinnedCopies(pinned=cuda)
    # slots without buffers: they bound the frames in flight (the runner's static buffers hold the step's data)
    pool = MemBufferPool([], slots=ctx.config.frames_in_flight, device=ctx.device)
    streams = ctx.stream_factory()

    def upload(pkg: Package) -> None:
        """The frame and mask to the device, depth filters and float64 back-projection."""
        job: RegisterJob = pkg.data
        job.host = copies.of(job.rgb, job.depth, np.ascontiguousarray(job.mask, dtype=bool))
        rgb_h, depth_h, mask_h = job.host
        rgb, depth = rgb_h.to(ctx.device, non_blocking=cuda), depth_h.to(ctx.device, non_blocking=cuda)
        job.mask_t = mask_h.to(ctx.device, non_blocking=cuda)
        job.frame = filter_and_backproject(rgb, depth, job.K, xyz_float64=True, constants=est.constants)

    def hypotheses(pkg: Package) -> None:
        """The hypotheses of the frame (grid rotations, guessed translation) and its masked-depth count, no sync."""
        job: RegisterJob = pkg.data
        job.poses = est.hypotheses(job.frame, job.mask_t, job.symmetry_tfs)
        # validity (spec §1.2 step 3) is read on the host only in `select`: no sync here
        job.valid_count = validate.masked_depth_count(job.frame.depth, job.mask_t)

    def refine_score(pkg: Package) -> None:
        job: RegisterJob = pkg.data
        iterations = job.iterations or est.config.register_iterations
        job.ticket = runner.submit(job.obj, job.frame, job.poses, iterations)

    def select(pkg: Package) -> None:
        job: RegisterJob = pkg.data
        if pkg.ready_event is not None:
            pkg.ready_event.synchronize()  # the eager stages' work (the masked-depth count)
        validate.require_masked_depth_count(int(job.valid_count))
        cam_from_centred, score, _ = runner.collect(job.ticket)  # the step's one event
        validity = est.validity_models.judge_pose(job.obj, job.frame.depth, job.K, torch.from_numpy(cam_from_centred))
        timings = {r.stage: r.wall_ms for r in pkg.timings}
        timings["total"] = sum(timings.values())
        pkg.data = RegisterResult(cam_from_mesh=to_mesh_frame(cam_from_centred, job.obj.centred_from_mesh),
                                  score=score, timings_ms=timings, cam_from_centred=cam_from_centred,
                                  validity=validity)

    stages = [
        Stage("upload", upload, stream_factory=streams),
        Stage("hypotheses", hypotheses, stream_factory=streams),
        Stage("refine_score", refine_score, stream_factory=streams),
        Stage("select", select),
    ]
    pipeline = BaseAsyncPipeline(stages, PipelineConfig(queue_capacity=ctx.config.queue_capacity), pool=pool,
                                 name="register")
    return Lane(pipeline, pool)
