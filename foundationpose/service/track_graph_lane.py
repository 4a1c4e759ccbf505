"""The track lane with whole captured steps: one package = one batch, one replay per (object, size) group::

    step -> finish

``step`` stages the batch's frames in pinned memory and enqueues, per group of jobs with the same object,
image size and iteration count, copy-in, one replay of the captured track step
(:class:`foundationpose.track_graph.TrackGraphRunner`) and copy-out, without waiting for the GPU; ``finish``
waits for each group's one event and builds the results. A request that finds the lane idle may skip both threads:
:attr:`Lane.inline` runs the same submit + collect in the caller's thread (``PoseService``'s ``inline_if_idle``). The two stages are what the threads still buy once
the GPU work is a few launches: the host stages batch k+1 while the GPU runs batch k. The render/refine hand-offs
of :mod:`foundationpose.service.track_lane` are gone (they only added latency). Used when the estimator's
track steps are graphed (``EstimatorConfig.track_graphs``); eager on the same buffers elsewhere (CPU tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deploy_core.mempool import BufferSpec, MemBufferPool
from deploy_core.pipeline import BaseAsyncPipeline, Package, PipelineConfig, Stage
from deploy_core.timing import timed
from foundationpose.estimator import TrackResult
from foundationpose.service.lane import Lane, LaneContext, job_track_result, track_result
from foundationpose.service.track_lane import TrackJob
from foundationpose.track_graph import (
    TrackFrame,
    TrackGraphConfig,
    TrackGraphRunner,
    TrackTicket,
    stage_images,
)

__all__ = ["BATCH_LADDERS", "GraphGroup", "build_track_graph_lane", "graph_batch_sizes"]


@dataclass(slots=True, eq=False)
class GraphGroup:
    """Jobs of one batch sharing object, image size and iterations: one submitted replay (``ticket``), or the
    error that failed this group only (the other groups of the batch go on)."""

    ticket: TrackTicket | None
    error: BaseException | None = None
    poses: np.ndarray | None = None  # (n, 4, 4) float32 once collected


BATCH_LADDERS = ("fine", "pow2")


def graph_batch_sizes(max_batch: int, ladder: str = "fine") -> tuple[int, ...]:
    """Padded capacities for batches of up to ``max_batch`` requests (a batch of ``n`` runs at the smallest one
    ``>= n``, its extra rows computed and ignored), then ``max_batch`` itself.

    ``pow2``: 1, 2, 4, 8, 16, ... A batch of 9-15 then pays for 16 rows: under load the batches are 11-14, so a
    quarter of the track GPU work went to padding (a captured step costs ~0.2 ms of H200 GPU per row above 8).
    ``fine``: 1, 2, 3, 4, 6, 8, then steps of a quarter of the power of two below (10, 12, 14, 16, 20, 24, 28, 32,
    40, ...): at most one padded row up to 16, under a fifth of the rows above. Twice the captured steps per
    (object, image size) (10 instead of 5 at 16), each holding ``B`` frames of static inputs (~2.2 MB per row at
    640x480: ~165 MB per (object, size) at 16 instead of ~67 MB).
    """
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    if ladder == "pow2":
        sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_batch]
    elif ladder == "fine":
        sizes, b = [], 1
        while b < max_batch:
            sizes.append(b)
            b += 1 if b < 4 else max(2, (1 << (b.bit_length() - 1)) // 4)  # steps of 2 up to 16, then 4, 8, ...
    else:
        raise ValueError(f"ladder must be one of {BATCH_LADDERS}, got {ladder!r}")
    return (*sizes, max_batch)


def build_track_graph_lane(ctx: LaneContext) -> Lane:
    est = ctx.estimator
    n_max = ctx.config.track_max_batch
    renderer = ctx.new_renderer()  # a renderer of its own on CUDA: backends keep per-call workspaces
    runner = TrackGraphRunner(
        est.networks.track_refiner, renderer, ctx.device, crop_size=est.config.crop_size,
        config=TrackGraphConfig(batch_sizes=graph_batch_sizes(n_max, ctx.config.track_batch_ladder), max_graphs=ctx.config.track_max_graphs,
                                driver_launch=ctx.config.track_driver_launch),
        constants=est.constants,
        depth_filter_impl=est.config.depth_filter_impl, network_input_impl=est.config.network_input_impl,
        compile_geometry="inductor" if est.config.compile_track_step else None,
    )
    # The pool only bounds the batches in flight (its slot holds nothing the step needs).
    pool = MemBufferPool(
        [BufferSpec("slot", (1,), torch.uint8, host=True)], slots=ctx.config.track_batches_in_flight, device=ctx.device
    )

    def step(pkg: Package) -> None:
        """Group the jobs and submit one replay per group (no host wait)."""
        groups: dict[tuple, list] = {}
        for item in pkg.data:
            job = item.data
            iterations = job.iterations or est.config.track_iterations
            groups.setdefault((id(job.obj), job.depth.shape, iterations), []).append(job)
        for (_, _, iterations), jobs in groups.items():
            frames = [TrackFrame(rgb=j.rgb, depth=j.depth, K=j.K, start=j.start) for j in jobs]
            try:
                group = GraphGroup(runner.submit(jobs[0].obj, frames, iterations))
            except Exception as exc:  # this group only
                exc.add_note(f"pipeline=track stage=step package_id={pkg.package_id} requests={len(jobs)}")
                group = GraphGroup(None, error=exc)
            for i, job in enumerate(jobs):
                job.group, job.index = group, i

    def finish(pkg: Package) -> None:
        timings = {r.stage: r.wall_ms for r in pkg.timings}
        timings["total"] = sum(timings.values())
        results: list[TrackResult | BaseException] = []
        for item in pkg.data:
            job = item.data
            group: GraphGroup = job.group
            if group.error is not None:
                results.append(group.error)
                continue
            if group.poses is None:
                assert group.ticket is not None
                group.poses = runner.collect(group.ticket)  # the group's one event
            cam_from_centred = group.poses[job.index]
            results.append(track_result(item, pkg, cam_from_centred, timings))
        pkg.data = results

    # the step in the batcher's thread (track_step_in_batcher): safe, as the runner serialises submits itself
    stages = [Stage("step", step, in_submitter=ctx.config.track_step_in_batcher), Stage("finish", finish)]
    pipeline = BaseAsyncPipeline(stages, PipelineConfig(queue_capacity=ctx.config.queue_capacity), pool=pool,
                                 name="track")

    def inline(job: TrackJob) -> TrackResult | BaseException:
        """One job in the caller's thread: the same submit + collect as ``step`` + ``finish``, without their hand-offs.
        Safe beside the lane's own batches: the runner enqueues under its lock, everything on its one stream, each
        submit with its own staging and output, so concurrent submits run one after the other on the GPU."""
        iterations = job.iterations or est.config.track_iterations
        with timed("step", package_id="inline", stream=runner.stream, sink=pipeline.recorder, inline=1) as t:
            try:
                poses = runner.run(job.obj, [TrackFrame(rgb=job.rgb, depth=job.depth, K=job.K, start=job.start)],
                                   iterations)
            except Exception as exc:  # this request only, as a failed group of a batch
                exc.add_note("pipeline=track inline (the caller's thread, the lane was idle)")
                return exc
        ms = t.record.wall_ms
        return job_track_result(job.obj, poses[0], {"step": ms, "total": ms, "batch": 1.0, "batcher_wait": 0.0})

    pinned = ctx.device.type == "cuda"
    return Lane(pipeline, pool, inline=inline, stage=lambda rgb, depth: stage_images(rgb, depth, pinned),
                graphs=runner)
