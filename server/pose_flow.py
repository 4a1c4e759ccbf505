"""The work of one pose request between its bytes and its answer, shared by HTTP, the stream and the
Ray Serve pose replicas (:mod:`server.serve.replica`).

``state`` below is the :class:`~server.state.ServerState` (typed ``Any``: state imports the routes' helpers).

Decode (encoded images or raw frames), validate, submit and await, each timed as a phase
(:mod:`server.phases`). Decode, validation and submit run in a worker thread, so the event loop
only awaits (an ingest worker's page-locked raw frames are validated and submitted on the loop instead:
:func:`run_submit`); the codecs decode without the GIL (a request's depth in the state's ``decode_pool`` while
its rgb decodes) and raw frames are views of the received bytes. The
pipeline's service time of every answered request feeds :class:`~server.admission.ServiceTimes`
(the Retry-After estimates); a full pipeline becomes :class:`~server.errors.OverloadedError`.

:func:`register_request` / :func:`track_request` are the one place that turns a request's bytes
into a validated request (decode, then ``validate.register_request`` / ``validate.track_request``
once, with the service's limits); :func:`register_submit` / :func:`track_submit` add the submit.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.responses import Response

from deploy_core.errors import BusyError
from foundationpose import validate
from foundationpose.errors import InputError
from server import codecs, frames_raw, jsonio
from server.admission import Ticket
from server.errors import OverloadedError, PoseDivergedError, SessionBusyError
from server.phases import Phases, server_timing

__all__ = [
    "FrameBytes",
    "PoseAnswer",
    "PoseOutcome",
    "admit",
    "admit_register",
    "answer",
    "answer_of",
    "check_finite_pose",
    "decode_frame",
    "frame_of_parts",
    "header_object_id",
    "json_text_of",
    "pipeline_result",
    "pose_json",
    "prepare_track_after",
    "register_request",
    "register_submit",
    "request_deadline",
    "run_submit",
    "split_timings",
    "start_request",
    "submit_timed",
    "track_request",
    "track_submit",
]

# Keys of a result's timings_ms that are not pipeline stages (kept out of the stage histograms).
_NOT_STAGES = ("batch", "total", "stage_queues", "batcher_wait")


@dataclass(frozen=True, slots=True)
class FrameBytes:
    """The image parts of one request as received; ``*_shape`` set = raw pixels (see :mod:`server.frames_raw`)."""

    rgb: bytes | memoryview
    depth: bytes | memoryview
    mask: bytes | memoryview | None = None
    rgb_shape: Any = None
    depth_shape: Any = None
    depth_dtype: Any = None
    mask_shape: Any = None
    depth_in_range: bool = False  # see frames_raw.Part.in_range: validation skips the depth's value checks

    @property
    def raw(self) -> bool:
        return self.rgb_shape is not None or self.depth_shape is not None


def _encoded(data: bytes | memoryview) -> bytes:
    return data if isinstance(data, bytes) else bytes(data)


def frame_of_parts(parts: dict[str, frames_raw.Part], *, with_mask: bool) -> FrameBytes:
    """The images of a binary message (:func:`server.frames_raw.unpack_message`: the stream's messages and
    ``POST /track/binary``'s body); InputError naming a missing part."""
    names = ("rgb", "depth", "mask") if with_mask else ("rgb", "depth")
    for name in names:
        if name not in parts:
            raise InputError(name, f"a part named {name!r}", f"parts {sorted(parts)}")
    rgb, depth, mask = parts["rgb"], parts["depth"], parts.get("mask") if with_mask else None
    return FrameBytes(
        rgb.data, depth.data, None if mask is None else mask.data,
        rgb_shape=rgb.shape if rgb.raw else None,
        depth_shape=depth.shape if depth.raw else None,
        depth_dtype=(depth.dtype or "") if depth.raw else None,
        mask_shape=mask.shape if mask is not None and mask.raw else None,
        depth_in_range=depth.raw and depth.dtype == "float32" and depth.in_range)


def header_object_id(header: dict[str, Any]) -> str:
    """The ``object_id`` of a binary message's header (register, start, ``POST /register/binary``); InputError
    unless it is a string."""
    object_id = header.get("object_id")
    if not isinstance(object_id, str):
        raise InputError("object_id", "the id of a loaded object (GET /objects)", repr(object_id)[:40])
    return object_id


def json_text_of(value: Any) -> str:
    """A binary message header's K (or pose): JSON text as sent, or the JSON of a nested list."""
    return value if isinstance(value, str) else json.dumps(value)


def decode_frame(frame: FrameBytes, max_hw: tuple[int, int], phases: Phases, with_mask: bool = False,
                 pool: Executor | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(rgb (H, W, 3) uint8, depth (H, W) float metres, mask or None) as decoded; laps ``decode``.

    pool: when given and the rgb is an encoded image, the depth is decoded there while this thread decodes
    the rgb (the codecs release the GIL): the request pays the longer of the two, not their sum. The
    results, and which error is raised first (rgb's, then depth's, then mask's), are those of decoding one
    after the other. Values are checked afterwards, once, by ``validate.register_request`` /
    ``validate.track_request``.
    """
    depth_future = _submit(pool, _decode_depth, frame, max_hw) if frame.rgb_shape is None else None
    if depth_future is not None:
        try:
            rgb = codecs.decode_rgb(_encoded(frame.rgb), max_hw)
        except BaseException:
            depth_future.cancel()
            raise
        depth = depth_future.result()
    else:
        rgb = _decode_rgb(frame, max_hw)
        depth = _decode_depth(frame, max_hw)
    mask = None
    if with_mask:
        if frame.mask is None:
            raise InputError("mask", "the object mask of the first frame", "nothing")
        if frame.mask_shape is not None:
            mask = frames_raw.decode_raw_mask(frame.mask, frame.mask_shape, max_hw)
        else:
            mask = codecs.decode_mask(_encoded(frame.mask), max_hw)
    phases.lap("decode")
    return rgb, depth, mask


def _submit(pool: Executor | None, fn: Callable[..., Any], *args: Any) -> Future[Any] | None:
    """``pool.submit(fn, *args)``, or None without a pool or once it is shut down (the server is stopping:
    the request then decodes in its own thread)."""
    if pool is None:
        return None
    try:
        return pool.submit(fn, *args)
    except RuntimeError:  # "cannot schedule new futures after shutdown"
        return None


def _decode_rgb(frame: FrameBytes, max_hw: tuple[int, int]) -> np.ndarray:
    if frame.rgb_shape is not None:
        return frames_raw.decode_raw_rgb(frame.rgb, frame.rgb_shape, max_hw)
    return codecs.decode_rgb(_encoded(frame.rgb), max_hw)


def _decode_depth(frame: FrameBytes, max_hw: tuple[int, int]) -> np.ndarray:
    if frame.depth_shape is not None or frame.depth_dtype is not None:
        if frame.depth_shape is None:
            raise InputError("depth_shape", "H,W of the raw depth (stated with depth_dtype)", "nothing")
        return frames_raw.decode_raw_depth(frame.depth, frame.depth_shape, frame.depth_dtype, max_hw)
    return codecs.decode_depth(_encoded(frame.depth), max_hw)


@dataclass(slots=True)
class PoseOutcome:
    """What the pipeline answered, and when its future completed (``perf_counter_ns``)."""

    future: Future[Any]
    done_ns: int = 0


def request_deadline(config: Any) -> float:
    """When the server stops waiting for a pose (``request_timeout_s`` from now, ``time.monotonic()``): passed to
    the service, which drops a request still unfinished then at its next stage boundary (its client got a 504)."""
    return time.monotonic() + config.request_timeout_s


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


async def pipeline_result(state: Any, outcome: PoseOutcome, phases: Phases, lane: str) -> Any:
    """Await the outcome; laps ``pipeline`` (submit -> done) and ``resume`` (done -> here); feeds ServiceTimes."""
    result = await state.result_of(outcome.future)
    now = time.perf_counter_ns()
    done = outcome.done_ns or now
    phases.lap("pipeline", done)
    pipeline_ms = phases.ms["pipeline"]  # with an inline track, most of it was booked in submit_timed
    phases.lap("resume", now)
    state.service_times.observe(lane, pipeline_ms)
    batcher_wait = result.timings_ms.get("batcher_wait")
    if batcher_wait is not None:
        phases.add("batcher_wait", batcher_wait)
    return result


@dataclass(frozen=True, slots=True)
class PoseAnswer:
    """The 200 answer of a pose request as bytes: the JSON body and its ``Server-Timing`` header value. The ingest
    hub sends these to its worker as they are; the main port's routes answer :meth:`response`."""

    content: bytes
    server_timing: str

    def response(self) -> Response:
        return Response(self.content, media_type="application/json", headers={"Server-Timing": self.server_timing})


def answer_of(metrics: Any, endpoint: str, body: dict, result_timings: dict[str, float], phases: Phases) -> PoseAnswer:
    """The JSON answer of a pose request: timings_ms = the pipeline's stages + the host phases so far;
    ``encode`` is timed here and reported in ``Server-Timing`` and ``metrics`` (a :class:`~server.metrics.Metrics`;
    it cannot be inside the body it times)."""
    body["timings_ms"] = {**result_timings, **{k: round(v, 4) for k, v in phases.ms.items()}}
    content = jsonio.dumps(body)
    phases.lap("encode")
    metrics.observe_stages(endpoint, split_timings(result_timings))
    metrics.observe_phases(endpoint, phases.ms)
    phases.log(endpoint)
    return PoseAnswer(content, server_timing(phases.ms))


def answer(metrics: Any, endpoint: str, body: dict, result_timings: dict[str, float], phases: Phases) -> Response:
    """:func:`answer_of` as the HTTP response."""
    return answer_of(metrics, endpoint, body, result_timings, phases).response()


def split_timings(timings_ms: dict[str, float]) -> dict[str, float]:
    """The pipeline-stage entries of a result's timings (for the stage histograms)."""
    return {k: v for k, v in timings_ms.items() if k not in _NOT_STAGES}


def register_request(frame: FrameBytes, K_text: str | None, *, max_hw: tuple[int, int], limits: validate.InputLimits,
                     phases: Phases, pool: Executor | None = None) -> validate.RegisterRequest:
    """The validated register request of one frame (with its mask); laps ``decode`` and ``validate``.

    InputError naming the field; ImageTooLargeError (413) above ``max_hw``.
    """
    rgb, depth, mask = decode_frame(frame, max_hw, phases, with_mask=True, pool=pool)
    # the decoded depth is this request's own array (or a read-only view, which validation copies)
    request = validate.register_request(rgb, depth, mask, codecs.parse_K(K_text), limits=limits, depth_owned=True)
    phases.lap("validate")
    return request


def track_request(frame: FrameBytes, K_text: str | None, prev_pose: np.ndarray, prev_frame: str, *,
                  session_K: np.ndarray | None, session_hw: tuple[int, int] | None, max_hw: tuple[int, int],
                  limits: validate.InputLimits, phases: Phases, pool: Executor | None = None) -> validate.TrackRequest:
    """The validated track request of one frame; laps ``decode`` and ``validate``.

    Without a K the session's (``session_K``) is used, for frames of its size (``session_hw``; None: a
    session started from a given pose that has no frame yet, any size) only; a stateless request
    (``session_K`` None) must send one.
    """
    rgb, depth, _ = decode_frame(frame, max_hw, phases, pool=pool)
    if K_text is not None:
        K = codecs.parse_K(K_text)
    elif session_K is None:
        raise InputError("K", "a JSON 3x3 K (required for stateless tracking)", "nothing")
    elif session_hw is not None and tuple(rgb.shape[:2]) != tuple(session_hw):
        (h, w), (sh, sw) = rgb.shape[:2], session_hw
        raise InputError("K", f"the K of this {w}x{h} frame (the session's K is for {sw}x{sh} frames)", "no K",
                         "Send K with frames of a new size")
    else:
        K = session_K
    request = validate.track_request(rgb, depth, K, prev_pose, prev_frame=prev_frame, limits=limits,
                                     depth_owned=True,  # the decoded depth is the request's own (or read-only)
                                     depth_checked=frame.depth_in_range)
    phases.lap("validate")
    return request


def start_request(K_value: Any, pose_value: Any, *, max_translation_m: float | None) -> tuple[np.ndarray, np.ndarray]:
    """(K (3, 3) float64 pixels, cam_from_mesh (4, 4) float64 metres) of a session started from a given pose
    (the stream's ``start`` message): the values a stateless track sends, parsed and checked by the same
    rules (``codecs.parse_K`` / ``parse_pose``, then ``validate.validate_K`` / ``validate_pose`` with the
    service's working range); InputError naming ``K`` or ``pose``. K's plausibility for an image size is
    checked with each frame, as for a stateless track (there is no frame yet).

    K_value / pose_value: a header's nested lists or JSON text (:func:`json_text_of`); None = missing.
    """
    K = codecs.parse_K(None if K_value is None else json_text_of(K_value))
    pose = codecs.parse_pose(None if pose_value is None else json_text_of(pose_value), "pose")
    return validate.validate_K(K), validate.validate_pose(pose, "pose", max_translation_m)


def register_submit(state: Any, phases: Phases, obj: Any, frame: FrameBytes,
                    K_text: str | None) -> tuple[PoseOutcome, validate.RegisterRequest]:
    """Decode, validate (once) and submit one register (worker thread): (PoseOutcome, the request)."""
    cfg = state.config
    request = register_request(frame, K_text, max_hw=cfg.max_image_hw, limits=state.service.limits, phases=phases,
                               pool=state.decode_pool)

    def retry_ms() -> float:
        in_flight = state.service.stats().register.in_flight
        return state.service_times.register_retry_ms(in_flight, cfg.service.frames_in_flight)

    outcome = submit_timed(phases, lambda: state.service.submit(obj, request, timeout=cfg.submit_timeout_s,
                                                                deadline=request_deadline(cfg)),
                           lane="register", retry_ms=retry_ms)
    prepare_track_after(state, outcome.future, obj, request.hw)
    return outcome, request


def track_submit(state: Any, phases: Phases, obj: Any, frame: FrameBytes, K_text: str | None,
                 prev_pose: np.ndarray, *, key: Any, prev_frame: str, session_K: np.ndarray | None = None,
                 session_hw: tuple[int, int] | None = None,
                 inline_if_idle: bool = True) -> tuple[PoseOutcome, validate.TrackRequest]:
    """Decode, validate (once) and submit one track step (worker thread): (PoseOutcome, the request).

    key: the session's batching key (None: stateless). session_K / session_hw: see :func:`track_request`.
    inline_if_idle: an idle lane runs the step in this thread (see :func:`run_submit` for when not).
    """
    request = track_request(frame, K_text, prev_pose, prev_frame, session_K=session_K, session_hw=session_hw,
                            max_hw=state.config.max_image_hw, limits=state.service.limits, phases=phases,
                            pool=state.decode_pool)
    admission = state.admission
    outcome = submit_timed(
        phases, lambda: state.service.submit(obj, request, key=key, timeout=state.config.submit_timeout_s,
                                             deadline=request_deadline(state.config), inline_if_idle=inline_if_idle),
        lane="track", retry_ms=lambda: state.service_times.ms("track") * max(1, admission.admitted) / admission.parallel)
    if session_hw is None or tuple(session_hw) != request.hw:  # stateless, a stream start, or a new size
        prepare_track_after(state, outcome.future, obj, request.hw)
    return outcome, request


async def run_submit(state: Any, submit: Callable[..., Any], *, in_loop: bool) -> Any:
    """``submit()`` (a :func:`track_submit` partial: decode, validate, submit) in a worker thread, or right here on
    the event loop (``in_loop``) for frames that need neither a decode nor a staging copy: an ingest worker's raw
    frames in a page-locked ring (``ServerConfig.ingest_submit_in_loop``). That saves each request two thread hops.

    On the loop an idle lane runs the step inline only for a request that is alone (``state.track_alone()``: the only
    track admitted and no other ingest message waiting for the loop): nothing else waits for the loop then, and the
    step skips the batcher's and the finishing thread's hand-offs (session 10, one stream on the H200: 4.46 ms inline
    against 5.46 without). Under load it never does: a loop blocked by inline steps would take the next request only
    after each step, find the lane idle again and step it alone too, so steps ran one at a time, never batched
    (measured: 392 tracks/s at 64 clients against 821 from worker threads). Messages read while a step blocked the
    loop all wait as tasks before the first of them runs, so that first one is not alone."""
    if in_loop:
        return submit(inline_if_idle=state.track_alone())
    return await state.in_thread(submit)


def prepare_track_after(state: Any, future: Future[Any], obj: Any, hw: tuple[int, int]) -> None:
    """Once ``future`` succeeds, schedule the preparation of ``obj``'s track steps at ``hw`` (H, W) (in the
    thread that completes it: a lookup, the work runs in the state's preparer thread; once per object and size)."""

    def succeeded(done: Future[Any]) -> None:
        if not done.cancelled() and done.exception() is None:
            state.prepare_track_soon(obj, hw)

    future.add_done_callback(succeeded)


def check_finite_pose(pose: np.ndarray, what: str) -> None:
    """PoseDivergedError (500, nothing stored) when the pipeline returned NaN or inf entries."""
    if not np.isfinite(pose).all():
        raise PoseDivergedError(f"{what} produced a pose with NaN or inf entries; nothing was stored")


def pose_json(pose: np.ndarray) -> list[list[float]]:
    """A 4x4 pose as JSON rows of float64."""
    return np.asarray(pose, dtype=np.float64).tolist()


def admit_register(state: Any, endpoint: str) -> Ticket:
    """A register admission ticket (taken before the body is decoded), or the refusal (counted as shed)."""
    try:
        return state.register_admission.acquire()
    except OverloadedError:
        state.metrics.shed(endpoint, "register_full")
        raise


def admit(state: Any, endpoint: str, key: Any) -> Ticket:
    """A track admission ticket, or the refusal (counted in ``fp_requests_shed_total``)."""
    try:
        return state.admission.acquire(key)
    except OverloadedError as exc:
        state.metrics.shed(endpoint, "session_busy" if isinstance(exc, SessionBusyError) else "track_full")
        raise
