"""The pipelined fast path: register and track lanes on ``BaseAsyncPipeline``.

Register lane (one package = one frame, ``frames_in_flight`` at once, bounded by the pool)::

    upload -> hypotheses -> (render_i -> refine_i) x iterations -> score_render -> score_net -> select

Track lane (one package = a batch of frames of different sessions, collected by a
:class:`~deploy_core.batching.MicroBatcher` for at most ``track_max_wait_ms``)::

    upload -> (render_i -> refine_i) x iterations -> finish

or, when the estimator's track steps are captured as CUDA graphs (``EstimatorConfig.track_graphs``),
``step -> finish`` with one replay per batch (:mod:`foundationpose.service.track_graph_lane`).

Every GPU stage runs on its own CUDA stream; hand-offs are CUDA events recorded by the
pipeline (``pkg.ready_event``), so the host synchronises once per package, in the last
stage, where it reads the answer. Track has its own lane, so it never queues behind a
register. The stages call the same functions as the synchronous reference path
(:mod:`foundationpose.estimator`), so both return the same poses.

Memory: each in-flight package leases a slot of a :class:`MemBufferPool` holding, at their
maximum shapes, the pinned host staging images, the device images (and mask) and both network
inputs, which the render stages write in place. Poses, network outputs and the intermediate
tensors of the filters, renderer and warps come from PyTorch's caching allocator: the first
frames fill it (the server runs a warm-up frame at start), later frames reuse its blocks.
Replaced tensors that another stage's stream read are kept until their package completes
(:func:`foundationpose.service.lane.retire`); a package that fails or is dropped before its final
sync keeps its data until its GPU work completed (``BaseAsyncPipeline``), and the next lessee of its
slot waits for it on the GPU (the lease's free event seeds the package's ready event).

The lanes themselves are built in :mod:`foundationpose.service.register_lane` and
:mod:`foundationpose.service.track_lane`.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from deploy_core.batching import BatcherStats, MicroBatcher
from deploy_core.errors import DeadlineError
from deploy_core.locked_frames import PageLockedFrames
from deploy_core.mempool import PoolStats
from deploy_core.pipeline import PipelineStats
from foundationpose import validate
from foundationpose.errors import InputError
from foundationpose.estimator import (
    PoseEstimator,
    RegisterResult,
    TrackResult,
    start_cam_from_centred,
)
from foundationpose.mesh import ObjectModel
from foundationpose.service.lane import LaneContext
from foundationpose.service.register_graph_lane import build_register_graph_lane
from foundationpose.service.register_lane import RegisterJob, build_register_lane
from foundationpose.service.track_graph_lane import BATCH_LADDERS, build_track_graph_lane, graph_batch_sizes
from foundationpose.service.track_lane import TrackJob, build_track_lane

__all__ = ["PoseService", "ServiceConfig", "ServiceStats"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceConfig:
    """Sizing of the two lanes.

    frames_in_flight: register frames in the pipeline at once (= register pool slots).
    track_batches_in_flight: track batches in the pipeline at once (= track pool slots).
    track_max_batch: most track requests (sessions) merged into one refiner call.
    track_max_wait_ms: how long the first track request of a batch waits for company (only while a track
        batch is in flight, with ``track_idle_dispatch``: a lone request never waits).
    track_inline: with ``track_idle_dispatch``, a track submitted with ``inline_if_idle`` (:meth:`PoseService.track`,
        the server's worker threads) that finds the lane idle runs in the caller's thread, one at a time: the
        lane's own submit + collect without the batcher and stage hand-offs, so a lone request costs what the
        reference path costs. Lanes with captured track steps only (``EstimatorConfig.track_graphs``).
    track_stage_in_caller: each track request copies its images into pinned host memory in the submitting thread
        (:func:`foundationpose.track_graph.stage_images`), so that the lane thread only enqueues one copy per frame
        (by driver calls, ``track_driver_launch``) instead of copying a whole batch's images itself. Graphed lanes
        only; the same bytes either way. On by default: H200, 64 sessions in-process, 1,349-1,387 vs 1,161-1,272
        frames/s and a lone track 1.76-1.81 vs 1.99-2.17 ms (same-call A/Bs, issue 10).
    track_driver_launch: a graphed lane submits batches whose images are staged (``track_stage_in_caller``, or a
        page-locked ingest ring) with CUDA driver calls that keep the GIL (:mod:`foundationpose.track_launch`):
        the same copies and replay without a GIL release and retake around each. Elsewhere PyTorch launches.
    track_step_in_batcher: a graphed lane's ``step`` (grouping and submitting the batch's replays, ~0.5 ms with
        driver launches) runs in the batcher's thread (``Stage(in_submitter=True)``) instead of a thread of its own:
        one hand-off fewer per batch, and requests gather while the batcher launches. On by default: H200, 64
        sessions in-process, same calls: threads 1,531 vs 1,383 frames/s (p99 71 vs 114 ms), coroutines 1,643 vs
        1,537; with page-locked frames and a 0.5 ms switch interval 2,742 vs 2,694 (p99 26.8 vs 28.7 ms); 64 binary
        HTTP clients through 8 ingest workers 832 vs 804 tracks/s; a lone track unchanged.
    track_max_graphs: captured track steps the graphed lane keeps, one per (object, image size, padded batch size,
        iterations); the least recently used is dropped beyond it (and captured again when needed). Each prepared
        (object, image size) takes one per batch size (10 at ``track_max_batch`` 16 on the fine ladder, 5 on
        pow2), so the default holds ~12 (objects, image sizes).
    track_batch_ladder: the padded batch sizes of a graphed lane (:func:`graph_batch_sizes`): ``fine`` (1, 2, 3,
        4, 6, 8, 10, ..., 16: at most one padded row up to 16) or ``pow2`` (1, 2, 4, 8, 16: a batch of 9 computes
        16 rows).
    max_image_hw: largest (H, W) accepted; the pool's image buffers have this size.
    queue_capacity: packages waiting in front of each stage.
    pending_requests: track requests that may wait for a batch before submit blocks.
    """

    frames_in_flight: int = 2
    track_batches_in_flight: int = 3
    track_max_batch: int = 16
    track_max_wait_ms: float = 1.0
    track_idle_dispatch: bool = True  # a track request into an idle lane does not wait for company
    track_inline: bool = True  # an inline_if_idle track into an idle (graphed) lane runs in the caller's thread
    track_stage_in_caller: bool = True  # each track request stages its images itself (graphed lanes)
    track_driver_launch: bool = True  # staged batches of a graphed lane go to the GPU by driver calls
    track_step_in_batcher: bool = True  # a graphed lane's step runs in the batcher's thread
    track_max_graphs: int = 128
    track_batch_ladder: str = "fine"
    max_image_hw: tuple[int, int] = (1080, 1920)
    queue_capacity: int = 2
    pending_requests: int = 256

    def __post_init__(self) -> None:
        for name in ("frames_in_flight", "track_batches_in_flight", "track_max_batch", "queue_capacity",
                     "track_max_graphs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.track_batch_ladder not in BATCH_LADDERS:
            raise ValueError(f"track_batch_ladder must be one of {BATCH_LADDERS}, got {self.track_batch_ladder!r}")
        sizes = graph_batch_sizes(self.track_max_batch, self.track_batch_ladder)
        if self.track_max_graphs < len(sizes):
            raise ValueError(f"track_max_graphs must hold the {len(sizes)} batch sizes {sizes} of one (object, image "
                             f"size) at track_max_batch={self.track_max_batch}; got {self.track_max_graphs}")
        if self.track_max_wait_ms < 0:
            raise ValueError(f"track_max_wait_ms must be >= 0, got {self.track_max_wait_ms}")


@dataclass(frozen=True, slots=True)
class ServiceStats:
    """A snapshot of both lanes: each pipeline's stage stats, each pool's occupancy, the track batcher."""

    register: PipelineStats
    track: PipelineStats
    register_pool: PoolStats
    track_pool: PoolStats
    track_batcher: BatcherStats
    track_inline: int = 0  # track requests run in their caller's thread (``ServiceConfig.track_inline``)
    track_captures: int = 0  # track steps captured as CUDA graphs so far (graphed lanes)
    track_graphs: int = 0  # track steps (captured or eager entries) the graphed lane holds now
    register_captures: int = 0  # register steps captured as CUDA graphs so far (the estimator's register runner)
    register_capture_failures: int = 0  # captures that failed (those registers run eagerly; the log has why)
    track_driver_launches: int = 0  # track batches submitted by driver calls (``ServiceConfig.track_driver_launch``)
    track_rows_requested: int = 0  # frames the graphed lane's steps took
    track_rows_padding: int = 0  # rows those steps computed beyond them (padded batch sizes)


class PoseService:
    """Pipelined register/track over a :class:`PoseEstimator`'s networks and settings.

    ``submit_register`` / ``submit_track`` return ``concurrent.futures.Future`` objects
    (bridge to asyncio with ``asyncio.wrap_future``). With ``timeout`` they raise
    :class:`~deploy_core.errors.BusyError` instead of blocking when the lane is full; after
    :meth:`close` they raise :class:`~deploy_core.errors.ClosedError`. With ``deadline``
    (``time.monotonic()`` seconds) a request still unfinished at its deadline is dropped at the
    next stage boundary and fails with :class:`~deploy_core.errors.DeadlineError` (a
    ``TimeoutError``); a future the caller cancels is dropped the same way (a track request once
    every request of its batch is cancelled). Either way its pool slot is returned.
    """

    def __init__(self, estimator: PoseEstimator, config: ServiceConfig = ServiceConfig()) -> None:
        self.estimator = estimator
        self.config = config
        self.device = estimator.device
        self._lanes = LaneContext(estimator, config)
        # A register as one captured replay when the estimator's are (EstimatorConfig.register_graphs), else stage
        # by stage; renderers are created here, not on a first request.
        runner = estimator.register_runner
        self._register = (build_register_graph_lane(self._lanes, runner) if runner is not None
                          else build_register_lane(self._lanes))
        # Whole captured track steps when the estimator's are (EstimatorConfig.track_graphs), else stage by stage.
        graphed = estimator.track_runner is not None
        self._track = build_track_graph_lane(self._lanes) if graphed else build_track_lane(self._lanes)
        self._batcher = MicroBatcher(
            self._track.pipeline,
            max_batch=config.track_max_batch,
            max_wait_s=config.track_max_wait_ms / 1e3,
            idle_dispatch=config.track_idle_dispatch,
            capacity=config.pending_requests,
            name="track-batcher",
        )
        use_inline = config.track_inline and config.track_idle_dispatch
        self._track_inline = self._track.inline if use_inline else None
        self._track_stage = self._track.stage if config.track_stage_in_caller else None
        self._stage_copies = self._track_stage is not None and self.device.type == "cuda"  # pinned copies (CPU: views)
        self._inline_lock = threading.Lock()  # one inline track at a time; close() takes it to wait for one
        self._inline_count = 0
        self._closing = False

    # -- public API -------------------------------------------------------------------------

    @property
    def limits(self) -> validate.InputLimits:
        """What requests are validated against here: the pool's image size, the estimator's working range."""
        return validate.InputLimits(
            max_image_hw=self.config.max_image_hw, max_translation_m=self.estimator.config.max_translation_m
        )

    def submit_register(
        self,
        obj: ObjectModel,
        rgb: np.ndarray,
        depth: np.ndarray,
        mask: np.ndarray,
        K: np.ndarray,
        *,
        iterations: int | None = None,
        symmetry_tfs: np.ndarray | None = None,
        timeout: float | None = None,
        deadline: float | None = None,
    ) -> Future[RegisterResult]:
        """Queue a register (arguments as :meth:`PoseEstimator.register`; validated here, once)."""
        request = validate.register_request(
            rgb, depth, mask, K, iterations=iterations, symmetry_tfs=symmetry_tfs, limits=self.limits
        )
        return self.submit(obj, request, timeout=timeout, deadline=deadline)

    def submit_track(
        self,
        obj: ObjectModel,
        rgb: np.ndarray,
        depth: np.ndarray,
        K: np.ndarray,
        prev_pose: np.ndarray,
        *,
        iterations: int | None = None,
        prev_frame: str = "mesh",
        key: Any = None,
        timeout: float | None = None,
        deadline: float | None = None,
        inline_if_idle: bool = False,
    ) -> Future[TrackResult]:
        """Queue a track step (arguments as :meth:`PoseEstimator.track`); batched with other sessions.

        key: requests with the same key complete in submission order (e.g. a session id).
        inline_if_idle: see :meth:`submit`.
        On CUDA with ``track_stage_in_caller`` (the default) both images are copied before this returns; elsewhere
        the depth is (validation's copy) but the lane may read ``rgb`` itself until the future completes: keep it
        unchanged until then.
        """
        request = validate.track_request(
            rgb, depth, K, prev_pose, prev_frame=prev_frame, iterations=iterations, limits=self.limits,
            depth_borrowed=self._stage_copies,  # staged (copied) in submit, right below: no validation copy first
        )
        return self.submit(obj, request, key=key, timeout=timeout, deadline=deadline, inline_if_idle=inline_if_idle)

    @overload
    def submit(self, obj: ObjectModel, request: validate.RegisterRequest, *, key: Any = None,
               timeout: float | None = None, deadline: float | None = None,
               inline_if_idle: bool = False) -> Future[RegisterResult]: ...

    @overload
    def submit(self, obj: ObjectModel, request: validate.TrackRequest, *, key: Any = None,
               timeout: float | None = None, deadline: float | None = None,
               inline_if_idle: bool = False) -> Future[TrackResult]: ...

    def submit(self, obj, request, *, key=None, timeout=None, deadline=None, inline_if_idle=False):
        """Queue an already validated request (:func:`validate.register_request` / :func:`validate.track_request`).

        Only what this service adds is checked here: the image fits the pool, the iterations the lane.
        key: ordering key of track requests (ignored for registers, which complete in any order).
        deadline: ``time.monotonic()`` seconds (see the class docstring).
        inline_if_idle: a track that finds the track lane idle runs here, in the caller's thread, and the future
            returned is already done (``ServiceConfig.track_inline``). For callers that wait for the answer anyway;
            a thread that submits a burst before waiting should leave it False, so that the burst is batched.
        """
        if not isinstance(request, (validate.RegisterRequest, validate.TrackRequest)):
            raise TypeError(f"request must be a RegisterRequest or TrackRequest, got {type(request).__name__}")
        self._check_fits(request)
        if isinstance(request, validate.RegisterRequest):
            self._check_iterations(request.iterations, self.estimator.config.register_iterations, "register")
            job = RegisterJob(obj, request.rgb, request.depth, request.mask, request.K, request.symmetry_tfs,
                              iterations=request.iterations)
            return self._register.pipeline.submit(job, timeout=timeout, deadline=deadline)
        self._check_iterations(request.iterations, self.estimator.config.track_iterations, "track")
        rgb, depth = request.rgb, request.depth
        if self._track_stage is not None:
            rgb, depth = self._track_stage(rgb, depth)
        job = TrackJob(obj, rgb, depth, request.K, start_cam_from_centred(request, obj), iterations=request.iterations)
        if inline_if_idle and self._track_inline is not None and self._track_idle():
            done = self._run_inline(job, deadline)
            if done is not None:
                return done
        return self._batcher.submit(job, key=key, timeout=timeout, deadline=deadline)

    def register(
        self,
        obj: ObjectModel,
        rgb: np.ndarray,
        depth: np.ndarray,
        mask: np.ndarray,
        K: np.ndarray,
        *,
        iterations: int | None = None,
        symmetry_tfs: np.ndarray | None = None,
    ) -> RegisterResult:
        """:meth:`submit_register` and wait (the same arguments and result as :meth:`PoseEstimator.register`)."""
        return self.submit_register(obj, rgb, depth, mask, K, iterations=iterations, symmetry_tfs=symmetry_tfs).result()

    def track(
        self,
        obj: ObjectModel,
        rgb: np.ndarray,
        depth: np.ndarray,
        K: np.ndarray,
        prev_pose: np.ndarray,
        *,
        iterations: int | None = None,
        prev_frame: str = "mesh",
    ) -> TrackResult:
        """:meth:`submit_track` and wait (the same arguments and result as :meth:`PoseEstimator.track`); into an idle
        lane it runs in this thread (``ServiceConfig.track_inline``)."""
        return self.submit_track(obj, rgb, depth, K, prev_pose, iterations=iterations, prev_frame=prev_frame,
                                 inline_if_idle=True).result()

    def page_locked_frames(self, count: int, hw: tuple[int, int] | None = None) -> PageLockedFrames:
        """``count`` frame slots (rgb uint8 + depth float32 metres, (H, W) = ``hw``, default ``max_image_hw``) in
        page-locked memory on CUDA: a track whose images are a slot's arrays is copied to the GPU from there, with no
        staging copy (:mod:`deploy_core.locked_frames`). Write each frame into a free slot (e.g. a camera's
        ``read(image=rgb)``, ``np.multiply(raw_depth, scale, out=depth)``), submit it, and keep the slot unchanged
        until that request's answer. Close it (``with``) when done. On the CPU the slots are ordinary memory."""
        return PageLockedFrames(count, hw or self.config.max_image_hw, lock=self.device.type == "cuda")

    def stats(self) -> ServiceStats:
        runner = self.estimator.register_runner
        graphs = self._track.graphs
        return ServiceStats(
            register=self._register.pipeline.stats(),
            track=self._track.pipeline.stats(),
            register_pool=self._register.pool.stats(),
            track_pool=self._track.pool.stats(),
            track_batcher=self._batcher.stats(),
            track_inline=self._inline_count,
            track_captures=graphs.captures if graphs is not None else 0,
            register_captures=runner.captures if runner is not None else 0,
            register_capture_failures=runner.capture_failures if runner is not None else 0,
            track_graphs=len(graphs.keys()) if graphs is not None else 0,
            track_driver_launches=graphs.driver_launches if graphs is not None else 0,
            track_rows_requested=graphs.rows_requested if graphs is not None else 0,
            track_rows_padding=graphs.rows_padding if graphs is not None else 0,
        )

    def time_track_steps(self, obj: ObjectModel, hw: tuple[int, int],
                         iterations: int | None = None) -> dict[int, dict] | None:
        """The track lane's own steps timed per padded batch size (:meth:`TrackGraphRunner.time_steps`: GPU ms vs
        the host's launch ms), for the bench; None on an eager lane. Not for serving: it synchronises."""
        if self._track.graphs is None:
            return None
        return self._track.graphs.time_steps(obj, hw, iterations or self.estimator.config.track_iterations)

    def prepare_track(self, obj: ObjectModel, hw: tuple[int, int], iterations: int | None = None) -> int:
        """Capture the track step of every batch size the lane runs for ``obj`` at image size ``hw`` (H, W) now,
        instead of on the first batch of each size (graphed lanes; elsewhere nothing to do). Returns how many
        steps were new. iterations: None = the estimator's ``track_iterations``."""
        if self._track.graphs is None:
            return 0
        return self._track.graphs.prepare(obj, hw, iterations or self.estimator.config.track_iterations)

    def forget_object(self, obj: ObjectModel) -> int:
        """Drop every captured track and register step of ``obj`` (its graphs and static buffers), e.g. once it is
        deleted: the steps hold the object, so without this its GPU memory stays until they are the least recently
        used. A later track or register of ``obj`` captures again. Returns how many steps were dropped (the
        estimator's own included)."""
        runners = (self._track.graphs, self.estimator.track_runner, self.estimator.register_runner)
        return sum(r.forget(obj) for r in runners if r is not None)

    def timing_summary(self) -> str:
        return "\n".join(
            lane.pipeline.recorder.format_table() for lane in (self._register, self._track)
        )

    def close(self, abort: bool = False, timeout: float | None = None) -> None:
        """Close the batcher and both lanes (``abort``: fail queued work with ClosedError).

        timeout: seconds for the whole close (None: each pipeline's ``join_timeout_s``); past it
        TimeoutError names the threads still inside a stage call (daemons: they end with the process).
        """
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.01, deadline - time.monotonic())

        stuck: list[str] = []
        self._batcher.close(abort=abort, timeout=left())
        # an inline track still running finishes first (within the timeout); none starts after this
        waited = self._inline_lock.acquire(timeout=-1 if deadline is None else left())
        self._closing = True
        if waited:
            self._inline_lock.release()
        else:
            stuck.append("an inline track step is still running in its caller's thread")
        for lane in (self._track, self._register):
            try:
                lane.pipeline.close(abort=abort, timeout=left())
            except TimeoutError as exc:
                stuck.append(str(exc))
        self._track.pool.close()
        self._register.pool.close()
        if stuck:
            raise TimeoutError("; ".join(stuck))

    def __enter__(self) -> PoseService:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close(abort=exc_info[0] is not None)

    # -- shared helpers ---------------------------------------------------------------------

    def _track_idle(self) -> bool:
        """Nothing waits in the batcher and no track batch is in the pipeline (a racing batch is harmless: see
        :attr:`Lane.inline`; this only keeps inline runs from taking requests that could join a batch)."""
        return self._batcher.waiting == 0 and self._track.pipeline.in_flight == 0

    def _run_inline(self, job: TrackJob, deadline: float | None) -> Future[TrackResult] | None:
        """Run ``job`` here if no other inline track runs (else None: the caller queues it). Returns a done future."""
        if not self._inline_lock.acquire(blocking=False):
            return None
        try:
            if self._closing or not self._track_idle():
                return None
            future: Future[TrackResult] = Future()
            future.set_running_or_notify_cancel()
            if deadline is not None and time.monotonic() >= deadline:
                late_ms = (time.monotonic() - deadline) * 1e3
                future.set_exception(DeadlineError(f"track: the request passed its deadline {late_ms:.1f} ms before it ran"))
                return future
            assert self._track_inline is not None
            outcome = self._track_inline(job)
            self._inline_count += 1
        finally:
            self._inline_lock.release()
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
        return future

    def _check_fits(self, request: validate.RegisterRequest | validate.TrackRequest) -> None:
        """The pool's image buffers have ``max_image_hw``: a larger frame cannot be staged."""
        h, w = request.hw
        max_h, max_w = self.config.max_image_hw
        if h > max_h or w > max_w:
            raise InputError("rgb", f"an image of at most {max_h}x{max_w} pixels (HxW)", f"{h}x{w}")

    @staticmethod
    def _check_iterations(iterations: int | None, lane_length: int, lane: str) -> None:
        """A lane has one render/refine stage pair per configured iteration: a call may use fewer, not more."""
        if iterations is not None and iterations > lane_length:
            raise InputError(
                "iterations",
                f"at most {lane_length} (the service's {lane} lane runs {lane_length} refine iterations)",
                str(iterations),
                "Build the service from an EstimatorConfig with more iterations",
            )
