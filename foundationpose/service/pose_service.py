"""The pipelined path: register and track lanes on ``BaseAsyncPipeline``, the same steps as the estimator.

Register lane (one package = one frame, ``frames_in_flight`` at once)::

    upload -> hypotheses -> refine_score -> select

Track lane (one package = a batch of requests of different sessions, collected by a
:class:`~deploy_core.batching.MicroBatcher` for at most ``track_max_wait_ms`` while another batch is in flight)::

    step -> finish

Both run the estimator's step definitions (:mod:`foundationpose.register_graph`, :mod:`foundationpose.track_graph`):
one replay per register and per track group where the steps are captured (CUDA), the same functions eagerly
elsewhere, so the service returns exactly the poses of :meth:`PoseEstimator.register` / :meth:`PoseEstimator.track`
(tested bit for bit on the CPU). Every GPU stage runs on its own CUDA stream; hand-offs are CUDA events recorded by
the pipeline (``pkg.ready_event``), so the host synchronises once per package, where it reads the answer. Track has
its own lane, so it never queues behind a register; a track into an idle lane runs in its caller's thread.

Memory: the steps' inputs live in the runners' static buffers (one set per captured key); frames are copied into
reusable page-locked blocks (:class:`deploy_core.memory.PinnedCopies`); each lane's slots (a buffer-less
:class:`~deploy_core.memory.MemBufferPool`) bound its packages in flight, and the next lessee of a slot waits on the
GPU for the previous one (the lease's free event seeds the package's ready event). A package that fails or is
dropped before its final sync keeps its data until its GPU work completed (``BaseAsyncPipeline``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, overload

import numpy as np

from deploy_core.batching import MicroBatcher
from deploy_core.errors import DeadlineError
from deploy_core.memory import PageLockedFrames, SharedFrames
from foundationpose import validate
from foundationpose.errors import InputError
from foundationpose.estimator import (
    PoseEstimator,
    RegisterResult,
    TrackResult,
    start_cam_from_centred,
)
from foundationpose.mesh import ObjectModel
from foundationpose.service.config import ServiceConfig, ServiceStats
from foundationpose.service.lane import LaneContext
from foundationpose.service.register_lane import RegisterJob, build_register_lane
from foundationpose.service.track_lane import TrackJob, build_track_lane

__all__ = ["PoseService", "ServiceConfig", "ServiceStats"]

log = logging.getLogger(__name__)

GROUP_HOLD_S = 0.05  # how long a group of tracks holds its batch open at most (a lapse costs the shared batch only)


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

    def __init__(self, estimator: PoseEstimator, config: ServiceConfig | None = None) -> None:
        config = config or ServiceConfig()
        self.estimator = estimator
        self.config = config
        self.device = estimator.device
        self._lanes = LaneContext(estimator, config)
        # renderers and runners are created here, not on a first request
        self._register = build_register_lane(self._lanes)
        self._track, self._track_runner = build_track_lane(self._lanes)
        self._batcher = MicroBatcher(
            self._track.pipeline,
            max_batch=config.track_max_batch,
            max_wait_s=config.track_max_wait_ms / 1e3,
            idle_dispatch=True,  # a request into an idle lane does not wait for company
            capacity=config.pending_requests,
            name="track-batcher",
        )
        self._stage_copies = self.device.type == "cuda"  # staging copies the images (CPU: zero-copy views)
        self._shared_frames = SharedFrames(lock=self._stage_copies)
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
        timeout: float | None = None,
        deadline: float | None = None,
    ) -> Future[RegisterResult]:
        """Queue a register (arguments as :meth:`PoseEstimator.register`; validated here, once)."""
        request = validate.register_request(
            rgb, depth, mask, K, iterations=iterations, limits=self.limits
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
        On CUDA both images are copied (staged) before this returns, unless they lie in page-locked memory
        (:meth:`page_locked_frames`); elsewhere the depth is (validation's copy) but the lane may read ``rgb`` itself
        until the future completes: keep it unchanged until then.
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
            returned is already done. For callers that wait for the answer anyway;
            a thread that submits a burst before waiting should leave it False, so that the burst is batched.
        """
        if not isinstance(request, (validate.RegisterRequest, validate.TrackRequest)):
            raise TypeError(f"request must be a RegisterRequest or TrackRequest, got {type(request).__name__}")
        self._check_fits(request)
        if isinstance(request, validate.RegisterRequest):
            self._check_iterations(request.iterations, self.estimator.config.register_iterations, "register")
            job = RegisterJob(obj, request.rgb, request.depth, request.mask, request.K, obj.symmetry_tfs,
                              iterations=request.iterations)
            return self._register.pipeline.submit(job, timeout=timeout, deadline=deadline)
        self._check_iterations(request.iterations, self.estimator.config.track_iterations, "track")
        rgb, depth = request.rgb, request.depth
        assert self._track.host_images is not None
        rgb, depth = self._track.host_images(rgb, depth)
        job = TrackJob(obj, rgb, depth, request.K, start_cam_from_centred(request, obj), iterations=request.iterations)
        if inline_if_idle and self._track_idle():
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
    ) -> RegisterResult:
        """:meth:`submit_register` and wait (the same arguments and result as :meth:`PoseEstimator.register`)."""
        return self.submit_register(obj, rgb, depth, mask, K, iterations=iterations).result()

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
        lane it runs in this thread."""
        return self.submit_track(obj, rgb, depth, K, prev_pose, iterations=iterations, prev_frame=prev_frame,
                                 inline_if_idle=True).result()

    def share_frame(self, rgb: np.ndarray, depth: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The images of a frame several tracks read (the objects in it), validated once (InputError as
        :meth:`submit_track` raises for them) and, on CUDA, copied once into page-locked memory. Pass the returned
        arrays to every :meth:`submit_track` of that frame: none then takes a staging copy, and a batch holding
        several of them copies the frame to the GPU once. Keep them unchanged until those tracks are answered."""
        rgb, depth = validate.frame_images(rgb, depth, limits=self.limits, depth_borrowed=True)
        return self._shared_frames.share(rgb, depth)

    def hold_tracks(self, max_s: float | None = None) -> Callable[[], None]:
        """Hold the track batch open while the caller submits several tracks one after another (the objects of one
        frame), so they share a batch even in an idle lane; returns the release (call it once they are submitted;
        the hold lapses by itself after ``max_s``, default :data:`GROUP_HOLD_S`). Submit them with
        ``inline_if_idle=False``."""
        return self._batcher.hold(GROUP_HOLD_S if max_s is None else max_s)

    def page_locked_frames(self, count: int, hw: tuple[int, int] | None = None) -> PageLockedFrames:
        """``count`` frame slots (rgb uint8 + depth float32 metres, (H, W) = ``hw``, default ``max_image_hw``) in
        page-locked memory on CUDA: a track whose images are a slot's arrays is copied to the GPU from there, with no
        staging copy (:mod:`deploy_core.memory.frames`). Write each frame into a free slot (e.g. a camera's
        ``read(image=rgb)``, ``np.multiply(raw_depth, scale, out=depth)``), submit it, and keep the slot unchanged
        until that request's answer. Close it (``with``) when done. On the CPU the slots are ordinary memory."""
        return PageLockedFrames(count, hw or self.config.max_image_hw, lock=self.device.type == "cuda")

    def stats(self) -> ServiceStats:
        register, track = self.estimator.register_runner, self._track_runner
        return ServiceStats(
            register=self._register.pipeline.stats(),
            track=self._track.pipeline.stats(),
            register_pool=self._register.pool.stats(),
            track_pool=self._track.pool.stats(),
            track_batcher=self._batcher.stats(),
            track_inline=self._inline_count,
            track_captures=track.captures,
            track_capture_failures=track.capture_failures,
            register_captures=register.captures,
            register_capture_failures=register.capture_failures,
            track_graphs=len(track.keys()),
            track_driver_launches=track.driver_launches,
            track_rows_requested=track.rows_requested,
            track_rows_padding=track.rows_padding,
        )

    def time_track_steps(self, obj: ObjectModel | Sequence[ObjectModel], hw: tuple[int, int],
                         iterations: int | None = None, *, repeats: int = 10) -> dict[int, dict]:
        """The track lane's own steps of ``obj`` (or the group of several objects) timed per padded batch size
        (:meth:`TrackGraphRunner.time_steps`: GPU ms vs the host's launch ms, medians of ``repeats``), for the bench
        and the server's start-up (one replay of each size before ready). Not for serving: it synchronises."""
        return self._track_runner.time_steps(obj, hw, iterations or self.estimator.config.track_iterations,
                                             repeats=repeats)

    def prepare_track(self, obj: ObjectModel | Sequence[ObjectModel], hw: tuple[int, int],
                      iterations: int | None = None) -> int:
        """Build (on CUDA: capture) the track step of every batch size the lane runs for ``obj`` (or the group of
        several objects, whose steps serve every batch mixing them) at image size ``hw`` (H, W) now, instead of on
        the first batch of each size. Returns how many steps were new. iterations: None = the estimator's
        ``track_iterations``."""
        return self._track_runner.prepare(obj, hw, iterations or self.estimator.config.track_iterations)

    def forget_object(self, obj: ObjectModel) -> int:
        """Drop every captured track and register step of ``obj`` (its graphs and static buffers), e.g. once it is
        deleted: the steps hold the object, so without this its GPU memory stays until they are the least recently
        used. A later track or register of ``obj`` captures again. Returns how many steps were dropped (the
        estimator's own included)."""
        return self._track_runner.forget(obj) + self.estimator.forget_object(obj)

    def timing_summary(self) -> str:
        """Both lanes' per-stage timing tables (ms), each under a title naming its lane."""
        return "\n\n".join(
            f"{name} lane: pipeline stages\n" + lane.pipeline.recorder.format_table()
            for name, lane in (("Register", self._register), ("Track", self._track))
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
        self._shared_frames.close()
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
            assert self._track.inline is not None
            outcome = self._track.inline(job)
            self._inline_count += 1
        finally:
            self._inline_lock.release()
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
        return future

    def _check_fits(self, request: validate.RegisterRequest | validate.TrackRequest) -> None:
        """A frame larger than ``max_image_hw`` is refused (the service's accepted image size)."""
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
