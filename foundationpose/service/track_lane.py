"""The track lane: one package = a batch of frames of different sessions (collected by a
:class:`~deploy_core.batching.MicroBatcher`), built per (object, image size) group::

    upload -> (render_i -> refine_i) x iterations -> finish

One bad item never fails the batch: a group whose render raises keeps its error (its
network-input rows are zeroed, refiner rows are independent) and skips the later stages; a
pose that comes out non-finite fails only its own request. The other requests get their poses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from deploy_core.mempool import BufferSpec, MemBufferPool
from deploy_core.pipeline import BaseAsyncPipeline, Package, PipelineConfig, Stage
from foundationpose.estimator import TrackResult
from foundationpose.mesh import ObjectModel
from foundationpose.observation import PreparedFrame, filter_and_backproject_stacked
from foundationpose.pose_update import apply_refiner_output
from foundationpose.refine import PairInputs, build_refiner_inputs_per_frame, run_refiner
from foundationpose.render import Renderer
from foundationpose.service.lane import Lane, LaneContext, fill, retire, track_result

__all__ = ["TrackGroup", "TrackJob", "build_track_lane", "track_groups"]


@dataclass(slots=True, eq=False)
class TrackGroup:
    """The jobs of one track batch with the same object and image size: rendered and warped in one call each.

    rows: their rows in the batch's network inputs (contiguous).  rgb, xyz_cam: (m, H, W, 3) float32 stacked frames
    (views of the batch's filtered block).  Ks: (m, 3, 3) float64.  poses: (m, 4, 4) float32 cam_from_centred.
    """

    obj: ObjectModel
    rows: slice
    iterations: int | None  # refine iterations of these jobs (None = all the lane's)
    rgb: Tensor
    xyz_cam: Tensor
    Ks: np.ndarray
    poses: Tensor
    retired: list = field(default_factory=list)  # see _retire
    error: BaseException | None = None  # set when a stage failed for this group only; it skips the rest


@dataclass(slots=True)
class TrackJob:
    obj: ObjectModel
    rgb: np.ndarray
    depth: np.ndarray
    K: np.ndarray
    start: np.ndarray  # (4, 4) float32 cam_from_centred
    iterations: int | None = None  # refine iterations of this frame (None = all the lane's)
    frame: PreparedFrame | None = None
    group: TrackGroup | None = None
    index: int = 0  # row within its group


def build_track_lane(ctx: LaneContext) -> Lane:
    est = ctx.estimator
    n_max = ctx.config.track_max_batch
    crop = est.config.crop_size
    h, w = ctx.config.max_image_hw
    specs = [
        BufferSpec("render_input", (n_max, crop, crop, 6), torch.float32),
        BufferSpec("transf_input", (n_max, crop, crop, 6), torch.float32),
        BufferSpec("rgb_host", (n_max, h, w, 3), torch.uint8, host=True),
        BufferSpec("depth_host", (n_max, h, w), torch.float32, host=True),
        BufferSpec("rgb", (n_max, h, w, 3), torch.uint8),
        BufferSpec("depth", (n_max, h, w), torch.float32),
    ]
    pool = MemBufferPool(specs, slots=ctx.config.track_batches_in_flight, device=ctx.device)
    streams = ctx.stream_factory()
    non_blocking = ctx.device.type == "cuda"

    def upload(pkg: Package) -> None:
        """Stage, upload and filter the frames: one batched filter call per image size. Jobs are laid out
        grouped by (image size, object, iterations), so each group's frames and network-input rows are contiguous."""
        lease, jobs = pkg.lease, [item.data for item in pkg.data]
        lease.wait_host()  # the previous lessee's copies from the pinned buffers may still be pending
        by_hw: dict[tuple[int, int], dict[tuple[int, int | None], list[TrackJob]]] = {}
        for job in jobs:
            by_hw.setdefault(job.depth.shape, {}).setdefault((id(job.obj), job.iterations), []).append(job)
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
                fill(views["rgb_host"][i], job.rgb)
                fill(views["depth_host"][i, ..., 0], job.depth)
            views["rgb"].copy_(views["rgb_host"], non_blocking=non_blocking)
            views["depth"].copy_(views["depth_host"], non_blocking=non_blocking)
            frames = filter_and_backproject_stacked(
                views["rgb"], views["depth"][..., 0], [j.K for j in block], impl=est.config.depth_filter_impl,
                constants=est.constants,
            )
            first = 0
            for group_jobs in by_obj.values():
                k = len(group_jobs)
                sl = slice(first, first + k)
                starts = np.stack([job.start for job in group_jobs])
                group = TrackGroup(
                    obj=group_jobs[0].obj,
                    rows=slice(row, row + k),
                    iterations=group_jobs[0].iterations,
                    rgb=frames.rgb[sl],
                    xyz_cam=frames.xyz_cam[sl],
                    Ks=frames.Ks[sl],
                    poses=torch.as_tensor(starts, device=ctx.device),
                )
                for i, job in enumerate(group_jobs):
                    job.frame, job.group, job.index = frames.frames[first + i], group, i
                first += k
                row += k

    def runs(group: TrackGroup, i: int) -> bool:
        """Whether refine iteration ``i`` applies to this group (a request may ask for fewer than the lane has)."""
        return group.iterations is None or i < group.iterations

    def render_stage(i: int, renderer: Renderer) -> Callable[[Package], None]:
        name = f"render_{i}"

        def render(pkg: Package) -> None:
            n = len(pkg.data)
            render_all = pkg.lease.view("render_input", (n, crop, crop, 6))
            transf_all = pkg.lease.view("transf_input", (n, crop, crop, 6))
            for group in track_groups(pkg):  # usually one: all sessions of one object and image size
                if not runs(group, i):
                    continue  # its rows keep stale inputs; refine ignores their outputs
                if group.error is None:
                    try:
                        build_refiner_inputs_per_frame(
                            group.poses, group.rgb, group.xyz_cam, group.Ks, group.obj, renderer, crop_size=crop,
                            constants=est.constants, out_render=render_all[group.rows],
                            out_transf=transf_all[group.rows], impl=est.config.network_input_impl,
                        )
                        continue
                    except Exception as exc:  # this group only: the others of the batch go on
                        exc.add_note(f"pipeline=track stage={name} package_id={pkg.package_id} "
                                     f"rows={group.rows.start}:{group.rows.stop}")
                        group.error = exc
                render_all[group.rows].zero_()  # defined inputs for the rows of a failed group
                transf_all[group.rows].zero_()

        return render

    def refine_stage(i: int) -> Callable[[Package], None]:
        return lambda pkg: refine(pkg, i)

    def refine(pkg: Package, i: int) -> None:
        groups = [group for group in track_groups(pkg) if runs(group, i) and group.error is None]
        if not groups:
            return
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
        for group in groups:
            retire(group.retired, group.poses)
            group.poses = apply_refiner_output(
                group.poses, trans[group.rows], rot[group.rows], group.obj.diameter
            )

    def finish(pkg: Package) -> None:
        if pkg.ready_event is not None:
            pkg.ready_event.synchronize()
        timings = {r.stage: r.wall_ms for r in pkg.timings}
        timings["total"] = sum(timings.values())
        timings["stage_queues"] = sum(r.queue_wait_ms for r in pkg.timings)  # waits between the stages
        host_poses = {id(group): group.poses.cpu().numpy() for group in track_groups(pkg) if group.error is None}
        results: list[TrackResult | BaseException] = []
        for item in pkg.data:
            job: TrackJob = item.data
            if job.group.error is not None:
                results.append(job.group.error)
                continue
            cam_from_centred = host_poses[id(job.group)][job.index].astype(np.float32)
            results.append(track_result(item, pkg, cam_from_centred, timings))
        pkg.data = results

    stages = [Stage("upload", upload, stream_factory=streams)]
    for i in range(est.config.track_iterations):
        stages.append(Stage(f"render_{i}", render_stage(i, ctx.new_renderer()), stream_factory=streams))
        stages.append(Stage(f"refine_{i}", refine_stage(i), stream_factory=streams))
    stages.append(Stage("finish", finish))
    pipeline = BaseAsyncPipeline(stages, PipelineConfig(queue_capacity=ctx.config.queue_capacity), pool=pool,
                                 name="track")
    return Lane(pipeline, pool)


def track_groups(pkg: Package) -> list[TrackGroup]:
    """The distinct groups of a track package's jobs, in row order."""
    return list({id(item.data.group): item.data.group for item in pkg.data}.values())
