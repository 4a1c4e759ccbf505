"""The track lane: one package = a batch of track requests of different sessions, one step per group::

    step -> finish

A :class:`~deploy_core.batching.MicroBatcher` collects the batch. ``step`` runs in the batcher's thread: it groups
the batch's jobs by image size and iteration count (the jobs of different objects share a group: one step over
their object group, :mod:`foundationpose.object_group`, so the objects of one frame run one render and one refiner
forward per iteration) and enqueues, per group, copy-in, one track step
(:func:`foundationpose.track_graph.track_step` through a :class:`~foundationpose.track_graph.TrackGraphRunner`:
captured on CUDA, eager on the CPU) and copy-out, without waiting for the GPU; ``finish`` waits for each group's one
event and builds the results, while the batcher gathers and launches the next batch. A request that finds the lane
idle may skip both: :attr:`Lane.inline` runs the same submit + collect in the caller's thread
(``PoseService.submit(..., inline_if_idle=True)``). Each request stages its images in its own thread
(:meth:`TrackGraphRunner.host_images`), so the lane only enqueues one copy per frame.

One group's failure (an exception from its step) fails that group's requests only (a step over several objects
that raises is submitted again per object, so one bad object fails alone); a pose that comes out
non-finite fails only its own request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from deploy_core.memory import MemBufferPool
from deploy_core.pipeline import BaseAsyncPipeline, Package, PipelineConfig, Stage
from deploy_core.timing import timed
from foundationpose.estimator import TrackResult
from foundationpose.mesh import ObjectModel
from foundationpose.service.lane import Lane, LaneContext, job_track_result, track_result
from foundationpose.track_graph import (
    TrackFrame,
    TrackGraphConfig,
    TrackGraphRunner,
    TrackTicket,
    graph_batch_sizes,
)

__all__ = ["GraphGroup", "TrackJob", "build_track_lane"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TrackJob:
    """One track request: images (staged by the request's thread), K, the start pose (4, 4) float32
    cam_from_centred, and its iterations (None = the estimator's)."""

    obj: ObjectModel
    rgb: object
    depth: object
    K: np.ndarray
    start: np.ndarray
    iterations: int | None = None
    group: GraphGroup | None = None
    index: int = 0  # row within its group


@dataclass(slots=True, eq=False)
class GraphGroup:
    """Jobs of one batch sharing image size and iterations (of any objects): one submitted step (``ticket``), or the
    error that failed this group only (the other groups of the batch go on)."""

    ticket: TrackTicket | None
    error: BaseException | None = None
    poses: np.ndarray | None = None  # (n, 4, 4) float32 once collected
    judged: np.ndarray | None = None  # (n, JUDGED_COLUMNS) float32 once collected


def build_track_lane(ctx: LaneContext) -> tuple[Lane, TrackGraphRunner]:
    """The lane and its runner (the service reports the runner's counts and prepares its steps)."""
    est = ctx.estimator
    n_max = ctx.config.track_max_batch
    renderer = ctx.new_renderer()  # a renderer of its own on CUDA: backends keep per-call workspaces
    runner = TrackGraphRunner(
        est.networks.track_refiner, renderer, ctx.device, crop_size=est.config.crop_size,
        config=TrackGraphConfig(batch_sizes=graph_batch_sizes(n_max), max_graphs=ctx.config.track_max_graphs,
                                capture=est.capture),
        constants=est.constants,
    )
    # slots without buffers: they bound the batches in flight (the runner's static buffers hold the data)
    pool = MemBufferPool([], slots=ctx.config.track_batches_in_flight, device=ctx.device)

    def step(pkg: Package) -> None:
        """Group the jobs and submit one step per group (no host wait)."""
        groups: dict[tuple, list[TrackJob]] = {}
        for item in pkg.data:
            job = item.data
            iterations = job.iterations or est.config.track_iterations
            groups.setdefault((job.depth.shape, iterations), []).append(job)
        for (_, iterations), jobs in groups.items():
            try:  # one step for every object of the group (one object per frame)
                submit_group(jobs, iterations, pkg.package_id)
            except Exception as exc:  # a step over several objects failed: each object's jobs alone
                log.warning("track step over %d objects failed (%s: %s); each object's requests run alone",
                            len({id(j.obj) for j in jobs}), type(exc).__name__, exc)
                by_object: dict[int, list[TrackJob]] = {}
                for job in jobs:
                    by_object.setdefault(id(job.obj), []).append(job)
                for own in by_object.values():
                    try:
                        submit_group(own, iterations, pkg.package_id)
                    except Exception as alone:  # this object's requests only
                        alone.add_note(f"pipeline=track stage=step package_id={pkg.package_id} requests={len(own)}")
                        failed = GraphGroup(None, error=alone)
                        for i, job in enumerate(own):
                            job.group, job.index = failed, i

    def submit_group(jobs: list[TrackJob], iterations: int, package_id: object) -> None:
        """Submit one step for ``jobs``; raises what the submit raised when they hold several objects (the caller
        then isolates them), else records the error as this group's."""
        frames = [TrackFrame(rgb=j.rgb, depth=j.depth, K=j.K, start=j.start) for j in jobs]
        try:
            group = GraphGroup(runner.submit([j.obj for j in jobs], frames, iterations))
        except Exception as exc:
            if len({id(j.obj) for j in jobs}) > 1:
                raise
            exc.add_note(f"pipeline=track stage=step package_id={package_id} requests={len(jobs)}")
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
                group.poses, group.judged = runner.collect(group.ticket)  # the group's one event
            results.append(track_result(item, pkg, group.poses[job.index], group.judged[job.index], timings))
        pkg.data = results

    # the step in the batcher's thread: safe, as the runner serialises submits itself
    stages = [Stage("step", step, in_submitter=True), Stage("finish", finish)]
    pipeline = BaseAsyncPipeline(stages, PipelineConfig(queue_capacity=ctx.config.queue_capacity), pool=pool,
                                 name="track")

    def inline(job: TrackJob) -> TrackResult | BaseException:
        """One job in the caller's thread: the same submit + collect as ``step`` + ``finish``, without their hand-offs.
        Safe beside the lane's own batches: the runner enqueues under its lock, everything on its one stream, each
        submit with its own staging and output, so concurrent submits run one after the other on the GPU."""
        iterations = job.iterations or est.config.track_iterations
        with timed("step", package_id="inline", stream=runner.stream, sink=pipeline.recorder, inline=1) as t:
            try:
                poses, judged = runner.run(job.obj, [TrackFrame(rgb=job.rgb, depth=job.depth, K=job.K,
                                                                start=job.start)], iterations)
            except Exception as exc:  # this request only, as a failed group of a batch
                exc.add_note("pipeline=track inline (the caller's thread, the lane was idle)")
                return exc
        ms = t.record.wall_ms
        return job_track_result(job.obj, poses[0], judged[0],
                                {"step": ms, "total": ms, "batch": 1.0, "batcher_wait": 0.0})

    return Lane(pipeline, pool, inline=inline, host_images=runner.host_images), runner
