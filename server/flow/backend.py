"""The backend interface of the request flow, and the local backend: a :class:`~foundationpose.service.PoseService`
in this process.

A :class:`PoseBackend` computes one register or one track step from a frame as received; everything around it
(parsing, sessions, admission, answers) is the flow's (:mod:`server.flow.steps`). Two implement it:
:class:`LocalBackend` here (decode, validate and submit in a worker thread, await the pipeline's future without
blocking the event loop), and the Ray Serve ingress' backend (:mod:`server.serve.backend`), which sends the same
call to a pose replica, where a :class:`LocalBackend` computes it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Protocol

import numpy as np

from deploy_core.errors import BusyError
from foundationpose import validate
from foundationpose.errors import InputError
from foundationpose.recovery import RecoveryPlan
from foundationpose.session_state import SessionReport
from foundationpose.session_step import RecoveryRegister, recovery_register
from foundationpose.session_trust import CLIENT_REGISTER, TRACK
from server.errors import OverloadedError, RequestTimeoutError
from server.flow.frames import FrameBytes, decode_frame, raw_frame
from server.flow.validation import register_request, track_request
from server.phases import Phases
from server.warmup import WARMING

log = logging.getLogger(__name__)

__all__ = ["LocalBackend", "PoseBackend", "PoseOutcome", "PoseResult", "SubmitGroup", "TrackStart",
           "pipeline_result", "result_of", "submit_timed"]



@dataclass(frozen=True, slots=True)
class TrackStart:
    """Where a track step starts. pose: (4, 4) float64, a session's cam_from_centred (``prev_frame="centred"``) or
    a stateless request's cam_from_mesh (``"mesh"``). session_K / session_hw: a session's K and the (H, W) it
    belongs to, used when the request sends no K (for frames of that size only). key: the batching key (the
    session id; None stateless). frame_no: the step's number in its session (None stateless). prefer_replica: the
    Serve replica that served the session's last frame (ignored by the local backend). recovery: the session is
    lost: first try a register on this plan's candidate mask in the register lane (a track step when the depth
    offers no candidate, the register lane is full or the candidate has too little depth)."""

    pose: np.ndarray
    prev_frame: str
    session_K: np.ndarray | None = None
    session_hw: tuple[int, int] | None = None
    key: str | None = None
    frame_no: int | None = None
    prefer_replica: str | None = None
    recovery: RecoveryPlan | None = None


@dataclass(frozen=True, slots=True)
class PoseResult:
    """One computed pose. cam_from_mesh: (4, 4) float64 (the answer's ``pose``); cam_from_centred: (4, 4) float32,
    the next tracking state; K: the (3, 3) intrinsics used; image_hw: (H, W) pixels; score: a register's score
    (None for a track or when not finite); timings_ms: the pipeline's stages; replica: the Serve replica that
    computed it ("" in-process); frame_no: echoed from the :class:`TrackStart`; phases_ms: the host phases of the
    process that computed it (decode .. resume); validity: the frame's
    :class:`~foundationpose.validity.Judgement` (None: not measured); source: where the pose came from
    (:mod:`foundationpose.session_trust`'s names); report: the session's verdict once the flow judged it (None
    stateless); symmetry: what the answer says of the object's symmetries, set by the flow
    (:meth:`server.objects.ObjectEntry.symmetry_answer`)."""

    cam_from_mesh: np.ndarray
    cam_from_centred: np.ndarray
    K: np.ndarray
    image_hw: tuple[int, int]
    timings_ms: dict[str, float] = field(default_factory=dict)
    score: float | None = None
    replica: str = ""
    frame_no: int | None = None
    phases_ms: dict[str, float] = field(default_factory=dict)
    validity: Any = None
    source: str = TRACK
    report: SessionReport | None = None
    symmetry: dict[str, Any] | None = None


class SubmitGroup:
    """Track steps submitted together (the sessions of one ``POST /track/sessions``): ``release`` is called once
    each of the ``members`` has been submitted or has given up (:meth:`arrived`, idempotent per member).
    concurrent: the steps may run at once (False: the flow runs them one after another)."""

    def __init__(self, members: int, release: Callable[[], None], *, concurrent: bool = True) -> None:
        self.members = members
        self.concurrent = concurrent
        self._release = release
        self._arrived: set[str] = set()

    def arrived(self, member: str) -> None:
        if member not in self._arrived:
            self._arrived.add(member)
            if len(self._arrived) >= self.members:
                self._release()


class PoseBackend(Protocol):
    """Computes poses for the request flow. ``entry``: the :class:`~server.objects.ObjectEntry` of a loaded object;
    ``frame``: the images as received; ``K``: (3, 3) float64 as sent (None: the start's session K); ``phases``: the
    request's stopwatch (the backend laps its decode, validate, submit, pipeline and resume phases). Errors are the
    flow's typed errors (InputError naming the field, OverloadedError, ...), raised as the request's answer."""

    @property
    def max_translation_m(self) -> float | None:
        """The working range of user poses (metres; None: unbounded)."""

    async def register(self, entry: Any, frame: FrameBytes, K: np.ndarray, phases: Phases, *,
                       session_id: str | None = None, box: tuple[int, int, int, int] | None = None) -> PoseResult:
        """box: the object shown by a box (x0, y0, x1, y1 pixels) instead of the frame's mask."""

    async def track(self, entry: Any, frame: FrameBytes, K: np.ndarray | None, start: TrackStart, phases: Phases, *,
                    in_loop: bool = False, group: SubmitGroup | None = None) -> PoseResult:
        """group: submitted with others (:meth:`submit_group`): the backend reports ``group.arrived(start.key)``
        once this step is submitted or refused."""

    def submit_group(self, members: int) -> SubmitGroup:
        """A group for ``members`` track steps that should share a batch."""

    async def shared_frame(self, frame: FrameBytes, phases: Phases) -> FrameBytes:
        """``frame`` as the steps of a group read it: decoded once here (laps ``decode``), or as it came where
        each step decodes it elsewhere."""


@dataclass(slots=True)
class PoseOutcome:
    """What the pipeline answered, and when its future completed (``perf_counter_ns``)."""

    future: Future[Any]
    done_ns: int = 0


def submit_timed(phases: Phases, submit: Callable[[], Future[Any]], *, lane: str,
                 retry_ms: Callable[[], float]) -> PoseOutcome:
    """Call ``submit`` (in the worker thread), lap ``submit``, note when the future completes. A future that is
    done on return ran in this thread (an inline track into an idle lane): that time is its ``pipeline``."""
    try:
        future = submit()
    except BusyError as exc:
        ms = retry_ms()
        raise OverloadedError(f"the {lane} pipeline is full; retry in about {ms:.0f} ms", retry_after_ms=ms) from exc
    phases.lap("pipeline" if future.done() else "submit")
    outcome = PoseOutcome(future)

    def mark(_: Future[Any]) -> None:
        outcome.done_ns = time.perf_counter_ns()

    future.add_done_callback(mark)
    return outcome


async def result_of(future: Future[Any], timeout_s: float) -> Any:
    """Await a pipeline future without blocking the loop; RequestTimeoutError (504) after ``timeout_s``.

    The pipeline future is shielded: a cancelled or timed-out request leaves the package to finish (its result is
    dropped); pipeline packages are never cancelled from here.
    """
    if future.done():  # an inline step finished in submit: no trip through the loop
        return future.result()
    # One loop future, settled by one call_soon_threadsafe from the completing thread, and one timer: the lean
    # equivalent of wait_for(shield(wrap_future(future))), which costs several futures, callbacks and a task switch
    # per request on the server's busiest thread.
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[Any] = loop.create_future()

    def completed(done: Future[Any]) -> None:  # in the thread that completed the pipeline future
        try:
            loop.call_soon_threadsafe(_settle, waiter, done)
        except RuntimeError:  # the loop closed meanwhile (shutdown): nobody waits any more
            pass

    future.add_done_callback(completed)
    timer = loop.call_later(timeout_s, _expire, waiter, timeout_s)
    try:
        return await waiter  # cancelling the request cancels only the waiter: the package runs to its end
    finally:
        timer.cancel()


def _settle(waiter: asyncio.Future, done: Future) -> None:
    """Copy a completed pipeline future's outcome into its request's waiter (unless it timed out or was cancelled)."""
    if waiter.done():
        return
    if done.cancelled():
        waiter.cancel()
    elif (exc := done.exception()) is not None:
        waiter.set_exception(exc)
    else:
        waiter.set_result(done.result())


def _expire(waiter: asyncio.Future, timeout_s: float) -> None:
    if not waiter.done():
        waiter.set_exception(RequestTimeoutError(f"no pose within {timeout_s:g} s"))


async def pipeline_result(state: Any, outcome: PoseOutcome, phases: Phases, lane: str) -> Any:
    """Await the outcome (at most ``request_timeout_s``); laps ``pipeline`` (submit -> done) and ``resume`` (done ->
    here); feeds ServiceTimes."""
    result = await result_of(outcome.future, request_wait_s(state.config))
    now = time.perf_counter_ns()
    phases.lap("pipeline", outcome.done_ns or now)
    pipeline_ms = phases.ms["pipeline"]  # with an inline track, most of it was booked in submit_timed
    phases.lap("resume", now)
    state.service_times.observe(lane, pipeline_ms)
    batcher_wait = result.timings_ms.get("batcher_wait")
    if batcher_wait is not None:
        phases.add("batcher_wait", batcher_wait)
    return result


class LocalBackend:
    """A :class:`PoseBackend` on this process's :class:`~server.state.ServerState` (its ``PoseService``, decode
    pool, admission and service times)."""

    def __init__(self, state: Any) -> None:
        self.state = state

    @property
    def max_translation_m(self) -> float | None:
        return self.state.service.limits.max_translation_m

    async def register(self, entry: Any, frame: FrameBytes, K: np.ndarray, phases: Phases, *,
                       session_id: str | None = None, box: tuple[int, int, int, int] | None = None) -> PoseResult:
        state = self.state
        outcome, request = await state.in_thread(self._register_submit, entry.model, frame, K, phases, box)
        result = await pipeline_result(state, outcome, phases, "register")
        score = float(result.score) if np.isfinite(result.score) else None
        return PoseResult(np.asarray(result.cam_from_mesh, dtype=np.float64), result.cam_from_centred, request.K,
                          request.hw, result.timings_ms, score, phases_ms=phases.ms, validity=result.validity,
                          source=CLIENT_REGISTER)

    def submit_group(self, members: int) -> SubmitGroup:
        return SubmitGroup(members, self.state.service.hold_tracks())

    async def shared_frame(self, frame: FrameBytes, phases: Phases) -> FrameBytes:
        state = self.state
        return await state.in_thread(self._shared_frame, frame, phases)

    async def track(self, entry: Any, frame: FrameBytes, K: np.ndarray | None, start: TrackStart, phases: Phases, *,
                    in_loop: bool = False, group: SubmitGroup | None = None) -> PoseResult:
        state = self.state
        try:
            tracked = None  # the frame as a recovery attempt validated it, when it fell back to a track
            if start.recovery is not None:
                submitted, tracked = await state.in_thread(self._recover_submit, entry.model, frame, K, start, phases)
                if submitted is not None:
                    if group is not None:
                        group.arrived(start.key)
                    recovered = await self._recovered(submitted, start, phases)
                    if recovered is not None:
                        return recovered
            submit = partial(self._track_submit, entry.model, frame, K, start, phases, request=tracked)
            # An ingest worker's page-locked raw frames need neither a decode nor a staging copy: validated and
            # submitted right here on the event loop, two thread hops fewer. An idle lane then runs the step inline
            # only for a request alone in the process (state.track_alone()): under load, a loop blocked by inline
            # steps would run them one at a time, never batched (392 tracks/s at 64 clients on the H200, against
            # 821 from threads). A step of a group never runs inline: it waits for the group's batch.
            if in_loop:
                outcome, request = submit(inline_if_idle=group is None and state.track_alone())
            else:
                outcome, request = await state.in_thread(partial(submit, inline_if_idle=group is None))
        finally:
            if group is not None:
                group.arrived(start.key)
        result = await pipeline_result(state, outcome, phases, "track")
        return PoseResult(np.asarray(result.cam_from_mesh, dtype=np.float64), result.cam_from_centred, request.K,
                          request.hw, result.timings_ms, frame_no=start.frame_no, phases_ms=phases.ms,
                          validity=result.validity)

    async def _recovered(self, submitted: tuple[PoseOutcome, validate.RegisterRequest, RecoveryRegister],
                         start: TrackStart, phases: Phases) -> PoseResult | None:
        """A lost session's frame registered on its recovery candidate; None: track it instead (too little depth
        under the candidate)."""
        outcome, request, attempt = submitted
        try:
            result = await pipeline_result(self.state, outcome, phases, "register")
        except InputError as exc:  # e.g. fewer valid depth pixels under the candidate than a register needs
            log.debug("%s refused (%s); tracking instead", attempt.source, exc)
            self.state.metrics.recovery("refused")
            return None
        self.state.metrics.recovery("registered")
        return PoseResult(np.asarray(result.cam_from_mesh, dtype=np.float64), result.cam_from_centred, request.K,
                          request.hw, result.timings_ms, frame_no=start.frame_no, phases_ms=phases.ms,
                          validity=result.validity, source=attempt.source)

    # -- in a worker thread ----------------------------------------------------------------------------------------
    def _shared_frame(self, frame: FrameBytes, phases: Phases) -> FrameBytes:
        """The frame decoded, validated and staged once (:meth:`PoseService.share_frame`), as raw pixels every
        step of the group reads in place (its depth already found in range)."""
        state = self.state
        decoded = decode_frame(frame, state.config.max_image_hw, phases, pool=state.decode_pool)
        rgb, depth = state.service.share_frame(decoded.rgb, decoded.depth)
        phases.lap("validate")
        return replace(raw_frame(replace(decoded, rgb=rgb, depth=depth)), depth_in_range=True)

    def _register_submit(self, model: Any, frame: FrameBytes, K: np.ndarray, phases: Phases,
                         box: tuple[int, int, int, int] | None) -> tuple[PoseOutcome, Any]:
        state = self.state
        cfg = state.config
        request = register_request(frame, K, max_hw=cfg.max_image_hw, limits=state.service.limits, phases=phases,
                                   pool=state.decode_pool, box=box, diameter=model.diameter)

        def retry_ms() -> float:
            in_flight = state.service.stats().register.in_flight
            return state.service_times.register_retry_ms(in_flight, cfg.register_frames)

        outcome = submit_timed(phases, lambda: state.service.submit(model, request, timeout=cfg.submit_timeout_s,
                                                                    deadline=_deadline(cfg)),
                               lane="register", retry_ms=retry_ms)
        _prepare_after(state, outcome.future, model, request.hw)
        return outcome, request

    def _recover_submit(self, model: Any, frame: FrameBytes, K: np.ndarray | None, start: TrackStart, phases: Phases
                        ) -> tuple[tuple[PoseOutcome, validate.RegisterRequest, RecoveryRegister] | None,
                                   validate.TrackRequest | None]:
        """Submit a lost session's frame as a register on its recovery candidate: (the submission, None), or (None,
        the frame's validated track request, or None when the frame was not decoded) when the frame is tracked
        instead (the register lane has no frame free, no candidate in the depth, or the lane refused it): the track
        then uses that request, so the frame is decoded once.

        The lane's free frame is taken first (:meth:`~server.admission.RegisterAdmission.try_spare`), before the
        frame is decoded and its candidates searched (tens of ms of CPU at 640x480): many lost sessions then cost
        about a track each while the lane is busy, and the clients' registers never queue behind recoveries. The
        ticket is held until the recovery register is answered."""
        state = self.state
        cfg = state.config
        plan = start.recovery
        assert plan is not None
        ticket = state.register_admission.try_spare()
        if ticket is None:
            state.metrics.recovery("deferred")
            return None, None
        future, tracked = None, None
        try:
            tracked = track_request(frame, K, start.pose, start.prev_frame, session_K=start.session_K,
                                    session_hw=start.session_hw, max_hw=cfg.max_image_hw,
                                    limits=state.service.limits, phases=phases, pool=state.decode_pool)
            attempt = recovery_register(plan, tracked.depth, tracked.K, model.diameter)
            phases.lap("recover")
            if attempt is None:
                state.metrics.recovery("no_candidate")
                return None, tracked
            request = validate.RegisterRequest(rgb=tracked.rgb, depth=tracked.depth, mask=attempt.mask, K=tracked.K)
            try:
                future = state.service.submit(model, request, timeout=0.0, deadline=_deadline(cfg))
            except BusyError:  # the register lane is full: this frame is tracked, the next one tries again
                state.metrics.recovery("deferred")
                return None, tracked
        finally:
            if future is None:  # nothing submitted (no candidate, a full lane, an error): the frame is free again
                ticket.release()
        future.add_done_callback(lambda _: ticket.release())
        phases.lap("submit")
        return (PoseOutcome(future), request, attempt), None

    def _track_submit(self, model: Any, frame: FrameBytes, K: np.ndarray | None, start: TrackStart, phases: Phases, *,
                      inline_if_idle: bool = True, request: validate.TrackRequest | None = None
                      ) -> tuple[PoseOutcome, Any]:
        """Submit the frame's track step; request: the frame already validated (by a recovery attempt)."""
        state = self.state
        cfg = state.config
        if request is None:
            request = track_request(frame, K, start.pose, start.prev_frame, session_K=start.session_K,
                                    session_hw=start.session_hw, max_hw=cfg.max_image_hw,
                                    limits=state.service.limits, phases=phases, pool=state.decode_pool)
        admission = state.admission
        outcome = submit_timed(
            phases, lambda: state.service.submit(model, request, key=start.key, timeout=cfg.submit_timeout_s,
                                                 deadline=_deadline(cfg), inline_if_idle=inline_if_idle),
            lane="track",
            retry_ms=lambda: state.service_times.ms("track") * max(1, admission.admitted) / admission.parallel)
        if start.session_hw is None or tuple(start.session_hw) != request.hw:  # stateless, a start, or a new size
            _prepare_after(state, outcome.future, model, request.hw)
        return outcome, request


# a warm-up request's wait when the warm-up has no deadline (warmup_timeout_s 0): the start-up bounds it, not this
UNBOUNDED_WARMUP_WAIT_S = 86400.0


def request_wait_s(config: Any) -> float:
    """How long a request waits for its pose: ``request_timeout_s``; the server's own warm-up requests
    (:data:`server.warmup.WARMING`) wait as long as the warm-up may take (``warmup_timeout_s``), since their first
    steps build and compile what a client's request later finds ready."""
    if WARMING.get():
        return config.warmup_timeout_s if config.warmup_timeout_s > 0 else UNBOUNDED_WARMUP_WAIT_S
    return config.request_timeout_s


def _deadline(config: Any) -> float:
    """When the server stops waiting for a pose (:func:`request_wait_s` from now, ``time.monotonic()``): passed to
    the service, which drops a request still unfinished then at its next stage boundary (its client got a 504)."""
    return time.monotonic() + request_wait_s(config)


def _prepare_after(state: Any, future: Future[Any], model: Any, hw: tuple[int, int]) -> None:
    """Once ``future`` succeeds, schedule the preparation of ``model``'s track steps at ``hw`` (H, W) (in the
    thread that completes it: a lookup, the work runs in the state's preparer thread; once per object and size)."""

    def succeeded(done: Future[Any]) -> None:
        if not done.cancelled() and done.exception() is None:
            state.prepare_track_soon(model, hw)

    future.add_done_callback(succeeded)
