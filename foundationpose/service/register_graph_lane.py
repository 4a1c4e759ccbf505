"""The register lane with a captured refine + score: one package = one frame, ``frames_in_flight`` at once::

    upload -> hypotheses -> refine_score -> select

``upload`` and ``hypotheses`` are the eager stages of :mod:`foundationpose.service.register_lane` (a few dozen
launches); ``refine_score`` enqueues every refine iteration and the scorer as one replay of the estimator's
:class:`foundationpose.register_graph.RegisterGraphRunner` without waiting for the GPU; ``select`` waits for the
replay's one event. The runner's replays run one after another on its stream (the GPU is the register's
bottleneck), while the threads upload, filter and sample the next frame. The runner is the estimator's, so the
lane and the reference path share one set of graphs and graph memory. Used when the estimator captures registers
(``EstimatorConfig.register_graphs``); eager on the same buffers elsewhere (CPU tests).
"""

from __future__ import annotations

from deploy_core.mempool import MemBufferPool
from deploy_core.pipeline import BaseAsyncPipeline, Package, PipelineConfig, Stage
from foundationpose import validate
from foundationpose.register_graph import RegisterGraphRunner
from foundationpose.service.lane import Lane, LaneContext
from foundationpose.service.register_lane import (
    RegisterJob,
    hypotheses_stage,
    pool_specs,
    register_result,
    upload_stage,
)

__all__ = ["build_register_graph_lane"]


def build_register_graph_lane(ctx: LaneContext, runner: RegisterGraphRunner) -> Lane:
    est = ctx.estimator
    pool = MemBufferPool(
        pool_specs(ctx, 1, with_mask=True, network_inputs=False), slots=ctx.config.frames_in_flight, device=ctx.device
    )
    streams = ctx.stream_factory()

    def refine_score(pkg: Package) -> None:
        job: RegisterJob = pkg.data
        iterations = job.iterations or est.config.register_iterations
        job.ticket = runner.submit(job.obj, job.frame, job.poses, iterations)

    def select(pkg: Package) -> None:
        job: RegisterJob = pkg.data
        if pkg.ready_event is not None:
            pkg.ready_event.synchronize()  # the eager stages' work (the masked-depth count)
        validate.require_masked_depth_count(int(job.valid_count))
        cam_from_centred, score, _ = runner.collect(job.ticket)  # the replay's one event
        pkg.data = register_result(pkg, cam_from_centred, score)

    stages = [
        Stage("upload", upload_stage(ctx), stream_factory=streams),
        Stage("hypotheses", hypotheses_stage(ctx), stream_factory=streams),
        Stage("refine_score", refine_score, stream_factory=streams),
        Stage("select", select),
    ]
    pipeline = BaseAsyncPipeline(stages, PipelineConfig(queue_capacity=ctx.config.queue_capacity), pool=pool,
                                 name="register")
    return Lane(pipeline, pool)
