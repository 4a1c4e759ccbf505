"""``WS /track/stream``'s state machine: one connection = one tracking session, newest frame wins.

Protocol (every client message is one **binary** message in the container of :mod:`server.flow.message`:
``uint32 LE header length | JSON header | parts``; every server message is one JSON **text** message):

1. Connect with ``Authorization: Bearer <key>`` when the server has a key (refused with 401 before the upgrade
   otherwise, like HTTP).
2. Register: header ``{"type": "register", "object_id": "mustard", "K": [[fx,0,cx],[0,fy,cy],[0,0,1]]}`` with
   parts ``rgb``, ``depth``, ``mask`` (raw: ``shape``/``dtype`` declared; or PNG/JPEG bytes). Answer:
   ``{"type": "registered", "session_id", "object_id", "pose", "score", "timings_ms"}``. **Or** start from a
   known pose, without a register (the streaming twin of a stateless ``POST /track``): header ``{"type": "start",
   "object_id": "mustard", "K": [[...]], "pose": [[...4x4 cam_from_mesh, m]]}`` with no parts; answer
   ``{"type": "started", "session_id", "object_id", "pose", "score": null, "timings_ms"}`` at once. One register
   or start per connection.
3. Frames: header ``{"type": "frame", "frame": 17}`` (``frame``: the client's number, a signed 64-bit integer,
   optional; ``K`` optional, for this frame only) with parts ``rgb`` and ``depth``. Answer, in order:
   ``{"type": "pose", "frame": 17, "frames": <steps so far>, "pose", "skipped": [15, 16], "timings_ms"}``.
4. When frames arrive faster than they are answered, a newer frame replaces the frame still waiting (one runs, at
   most one waits): the replaced frames are listed in the ``skipped`` of the answer to the frame that replaced
   them. Nothing else is ever replaced: a waiting register or start, and the error answer of a bad message, are
   answered in arrival order (at most :data:`MAX_WAITING_ERRORS` error answers wait; a client that sends more
   bad messages than that while one message runs is disconnected, code 1008).
5. A bad message is answered ``{"type": "error", "frame": 17, "error": {"type", "field", "message"}, "skipped":
   [...]}`` (the same error types and fields as HTTP, plus ``retry_after_ms`` when the lane is full) and the
   session goes on. The connection closes after ``stream_idle_s`` without a message (code 1001), when the session
   is deleted or expires (1000), when the server shuts down or the pipeline breaks (1011 / 1012), or on an
   unexpected error (1011). Closing the connection ends the session.

What a message does is its :class:`StreamHandler`'s: :class:`SessionStream` runs it here with the request flow's
steps (the main port, the Ray Serve ingress, and the ingest hub for its workers' streams); an ingest worker's
handler relays it to the GPU process (:mod:`server.ingest.relay`). The messages are parsed here, before either.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from foundationpose.errors import InputError
from server import jsonio
from server.errors import ErrorInfo, PayloadTooLargeError, classify, error_object
from server.flow import inputs, steps
from server.flow.message import unpack_message
from server.phases import Phases

__all__ = ["CLOSE_GOING_AWAY", "CLOSE_INTERNAL", "CLOSE_NORMAL", "CLOSE_POLICY", "CLOSE_RESTART", "ENDPOINT",
           "MAX_WAITING_ERRORS", "NO_SESSION_YET", "STREAM_LABELS", "SessionStream", "Stream", "StreamHandler",
           "StreamItem", "judge", "observe_answer", "run_stream"]

log = logging.getLogger(__name__)

ENDPOINT = "/track/stream"
STREAM_LABELS = {"frame": ENDPOINT, "register": ENDPOINT + ":register", "start": ENDPOINT + ":start"}
NO_SESSION_YET = "a register or start message before the first frame"
CLOSE_NORMAL, CLOSE_GOING_AWAY, CLOSE_POLICY, CLOSE_INTERNAL, CLOSE_RESTART = 1000, 1001, 1008, 1011, 1012
MAX_WAITING_ERRORS = 16  # error answers waiting behind a running message; more closes the connection
_OPENING = ("register", "start")
_PARSERS = {"register": inputs.register_of_message, "start": inputs.start_of_message,
            "frame": inputs.stream_frame_of_message}


@dataclass(slots=True)
class StreamItem:
    """One received message, waiting for its answer. kind: register | start | frame | error; request: its parsed
    :mod:`~server.flow.inputs` value; error: why it is refused (kind ``error``)."""

    kind: str
    received_ns: int
    frame: int | None = None
    request: Any = None
    error: Exception | None = None
    skipped: list[int] = field(default_factory=list)  # older frames this one replaced (newest wins)


class StreamHandler(Protocol):
    """What answers a stream's messages. Each step returns (answer body, the pipeline's timings_ms)."""

    async def register(self, item: StreamItem, phases: Phases) -> tuple[dict, dict[str, float]]: ...

    async def start(self, item: StreamItem, phases: Phases) -> tuple[dict, dict[str, float]]: ...

    async def frame(self, item: StreamItem, phases: Phases) -> tuple[dict, dict[str, float]]: ...

    def end(self) -> None:
        """The connection ended: end its session."""

    def judge(self, exc: Exception) -> tuple[int, tuple[int, str] | None]:
        """(status, (close code, reason) when the stream must end) of a failed message."""

    def error(self, exc: Exception) -> dict[str, Any]:
        """The ``error`` object of its answer."""


def _info(exc: Exception) -> ErrorInfo:
    return classify(exc)


def judge(exc: Exception, has_session: bool, where: str) -> tuple[int, tuple[int, str] | None]:
    """(status, closing) of a failed message: bad input, a full lane or a timeout spare the session; an unexpected
    error (logged here, once, with its traceback), a session gone, a server not serving or a broken pipeline end
    the stream. ``where``: the stream and frame, for the log."""
    info = _info(exc)
    if info.internal:
        log.error("stream %s failed with an unexpected %s", where, type(exc).__name__, exc_info=exc)
        return info.status, (CLOSE_INTERNAL, "internal error")
    if info.type == "UnknownSessionError" and has_session:
        return info.status, (CLOSE_NORMAL, "the session was deleted or expired")
    if info.type in ("ClosedError", "NotReadyError"):
        return info.status, (CLOSE_RESTART, "the server is not serving (starting or shutting down)")
    if info.type == "BrokenPipelineError":
        return info.status, (CLOSE_INTERNAL, "the pose pipeline failed")
    return info.status, None


class SessionStream:
    """A :class:`StreamHandler` that runs the messages with the request flow's steps on ``host``.

    in_loop: the frames lie decoded in page-locked memory (an ingest worker's ring): they are submitted on the
    event loop (:class:`~server.flow.backend.LocalBackend`)."""

    def __init__(self, host: steps.Host, stream_id: str, *, in_loop: bool = False) -> None:
        self.host = host
        self.stream_id = stream_id
        self.in_loop = in_loop
        self.session: Any = None

    async def register(self, item: StreamItem, phases: Phases) -> tuple[dict, dict[str, float]]:
        """The first register opens the session; a later one re-registers it on the client's mask."""
        request: inputs.RegisterInput = item.request

        async def frame() -> Any:
            return request.frame

        session_id = None if self.session is None else self.session.session_id
        self.session, result = await steps.register(self.host, ENDPOINT, request.object_id, request.K, phases, frame,
                                                    session_id=session_id, box=request.box)
        body = {"type": "registered", "session_id": self.session.session_id, "object_id": request.object_id,
                **steps.pose_fields(result), "score": result.score}
        if result.replica:
            body["replica"] = result.replica
        return body, result.timings_ms

    async def start(self, item: StreamItem, phases: Phases) -> tuple[dict, dict[str, float]]:
        self._no_session_yet("start")
        self.session = session = steps.start(self.host, item.request, phases)
        return {"type": "started", "session_id": session.session_id, "object_id": session.object_id,
                "pose": steps.pose_json(session.pose), "state": session.trust.state.state.value, "score": None}, {}

    async def frame(self, item: StreamItem, phases: Phases) -> tuple[dict, dict[str, float]]:
        session, sessions = self.session, self.host.sessions
        if session is None:
            raise InputError("type", NO_SESSION_YET, "a frame")
        if not sessions.is_live(session):
            sessions.get(session.session_id)  # UnknownSessionError: deleted or expired
        request: inputs.StreamFrame = item.request
        result, frames = await steps.track_session(self.host, ENDPOINT, session, request.frame, request.K, phases,
                                                   in_loop=self.in_loop)
        body = {"type": "pose", "frame": item.frame, "frames": frames, **steps.pose_fields(result)}
        if result.replica:
            body["replica"] = result.replica
        return body, result.timings_ms

    def end(self) -> None:
        if self.session is not None and self.host.sessions.is_live(self.session):
            self.host.sessions.delete(self.session.session_id)

    def judge(self, exc: Exception) -> tuple[int, tuple[int, str] | None]:
        return judge(exc, self.session is not None, self.stream_id)

    def error(self, exc: Exception) -> dict[str, Any]:
        return error_object(exc)

    def _no_session_yet(self, kind: str) -> None:
        if self.session is not None:
            raise InputError("type", "one register or start per connection (open a new one for another session)",
                             f"a {kind} after the session began")


class Stream:
    """One connection: receives and parses messages, keeps the waiting ones (newest frame wins), answers them in
    order with ``handler``. ws: the accepted WebSocket (``receive``, ``send_text``, ``close``); metrics / counters:
    the host's :class:`~server.metrics.Metrics` and :class:`~server.metrics.StreamCounters`."""

    def __init__(self, ws: Any, handler: StreamHandler, stream_id: str, *, max_message_bytes: int, idle_s: float,
                 metrics: Any, counters: Any) -> None:
        self.ws, self.handler, self.stream_id = ws, handler, stream_id
        self.max_message_bytes, self.idle_s = max_message_bytes, idle_s
        self.metrics, self.counters = metrics, counters
        self.waiting: deque[StreamItem] = deque()
        self.wake = asyncio.Event()
        self.closing: tuple[int, str] | None = None  # (code, reason) once the receiver or worker decided to end
        self.client_gone = False
        self.busy = False  # the worker is answering a message
        self.received_frames = 0

    # -- receiving: parse, then newest frame wins ---------------------------------------------------------------------
    def take(self, data: bytes) -> None:
        """Parse one binary message and queue it (or its error answer)."""
        now = time.perf_counter_ns()
        kind, number = "error", None
        try:
            if len(data) > self.max_message_bytes:
                raise PayloadTooLargeError(f"message: expected at most {self.max_message_bytes} bytes; "
                                           f"got {len(data)}")
            message = unpack_message(data)
            kind = message.header.get("type")
            if kind == "frame":
                self.received_frames += 1
                number = inputs.frame_number(message.header.get("frame"))
                number = self.received_frames if number is None else number
            parse = _PARSERS.get(kind) if isinstance(kind, str) else None
            if parse is None:
                number = inputs.frame_number(message.header.get("frame"))
                raise InputError("type", "'register', 'start' or 'frame'", ascii(kind)[:40])
            request = parse(message)
        except Exception as exc:  # noqa: BLE001 - a message that cannot be read is answered, never fatal here
            self._queue_error(StreamItem("error", now, number, error=exc))
            return
        if kind == "frame":
            self._queue_frame(StreamItem(kind, now, number, request))
        elif any(item.kind in _OPENING for item in self.waiting):  # at most one waits: bounded per connection
            self._queue_error(StreamItem("error", now, error=InputError("type", "one register or start at a time",
                                                                         f"a second {kind}")))
        else:
            self.waiting.append(StreamItem(kind, now, request=request))
            self.wake.set()

    def _queue_frame(self, item: StreamItem) -> None:
        """Append a frame, dropping the frame still waiting (it is skipped); openings and errors stay."""
        kept: deque[StreamItem] = deque()
        dropped = 0
        for old in self.waiting:
            if old.kind == "frame":
                dropped += 1
                item.skipped += old.skipped
                item.skipped.append(old.frame)
            else:
                kept.append(old)
        kept.append(item)
        self.waiting = kept
        self.wake.set()
        self.counters.change(received=1, skipped=dropped)

    def _queue_error(self, item: StreamItem) -> None:
        if sum(old.kind == "error" for old in self.waiting) >= MAX_WAITING_ERRORS:
            self.closing = (CLOSE_POLICY, f"more than {MAX_WAITING_ERRORS} bad messages waiting for their answers")
        else:
            self.waiting.append(item)
        self.wake.set()

    async def receive_loop(self) -> None:
        while self.closing is None:
            try:
                message = await asyncio.wait_for(self.ws.receive(), self.idle_s)
            except asyncio.TimeoutError:
                if self.busy or self.waiting:  # idle means nothing to do on either side (a CPU register is long)
                    continue
                self.closing = (CLOSE_GOING_AWAY, f"idle for {self.idle_s:g} s")
                break
            if message["type"] == "websocket.disconnect":
                self.client_gone = True
                self.closing = (CLOSE_NORMAL, "client closed")
                break
            data = message.get("bytes")
            if data is None:
                self._queue_error(StreamItem("error", time.perf_counter_ns(), error=InputError(
                    "message", "a binary message (uint32 header length, JSON header, parts)", "a text message")))
            else:
                self.take(data)
        self.wake.set()

    # -- working: one message at a time, answers in order ------------------------------------------------------------
    async def work_loop(self) -> None:
        """Answer waiting messages in order until the client leaves, a fatal error, or closing with nothing left."""
        while not self.client_gone:
            if not self.waiting:
                if self.closing is not None:
                    return
                self.wake.clear()
                await self.wake.wait()
                continue
            item = self.waiting.popleft()
            self.busy = True
            try:
                fatal = await self.handle(item)
            finally:
                self.busy = False
            if fatal:
                return

    async def send(self, body: dict) -> bool:
        """Send one JSON answer; False (and the stream ends) when the client is gone."""
        try:
            await self.ws.send_text(jsonio.dumps(body).decode())  # text frames: JSON as the HTTP answers
        except Exception:  # noqa: BLE001 - Starlette: WebSocketDisconnect, or RuntimeError after a close
            self.client_gone = True
            self.closing = self.closing or (CLOSE_NORMAL, "client gone")
            return False
        return True

    async def handle(self, item: StreamItem) -> bool:
        """Answer one message; True when the stream must end."""
        phases = Phases(start_ns=item.received_ns, request_id=f"{self.stream_id}:{item.frame}")
        self.metrics.request_started()
        status, closing, timings = 200, None, None
        try:
            if item.error is not None:
                raise item.error
            step = {"register": self.handler.register, "start": self.handler.start, "frame": self.handler.frame}
            body, timings = await step[item.kind](item, phases)
        except Exception as exc:  # noqa: BLE001 - every failure is answered, then judged
            status, closing = self.handler.judge(exc)
            body = {"type": "error", "frame": item.frame, "error": self.handler.error(exc)}
            if closing is not None:
                self.closing = closing
        body["skipped"] = item.skipped
        if timings is not None:
            body["timings_ms"] = {**timings, **{k: round(v, 4) for k, v in phases.ms.items()}}
        sent = await self.send(body)
        if timings is not None:
            phases.lap("encode")
            observe_answer(self.metrics, item.kind, timings, phases)
            phases.log(STREAM_LABELS[item.kind])
        seconds = (time.perf_counter_ns() - item.received_ns) / 1e9
        status = status if sent else 499
        self.metrics.request_finished(ENDPOINT, "WS", status, seconds)
        _log_message(self.stream_id, item, status, body, seconds)
        return closing is not None or not sent


def observe_answer(metrics: Any, kind: str, timings: dict[str, float], phases: Phases) -> None:
    """An answered register, start or frame message: its pipeline stages and host phases in ``metrics`` (a
    :class:`~server.metrics.Metrics`) under the kind's label (:data:`STREAM_LABELS`), wherever the stream runs."""
    label = STREAM_LABELS[kind]
    metrics.observe_stages(label, steps.split_timings(timings))
    metrics.observe_phases(label, phases.ms)


def _log_message(stream_id: str, item: StreamItem, status: int, body: dict, seconds: float) -> None:
    """One line per answered message: DEBUG when answered, INFO when refused (with the error's type and field)."""
    if status < 400:
        log.debug("stream=%s kind=%s frame=%s status=%d ms=%.1f", stream_id, item.kind, item.frame, status,
                  seconds * 1e3)
        return
    error = body.get("error") or {}
    log.info("stream=%s kind=%s frame=%s status=%d error=%s field=%s ms=%.1f", stream_id, item.kind, item.frame,
             status, error.get("type"), error.get("field"), seconds * 1e3)


async def run_stream(stream: Stream) -> None:
    """Serve one accepted connection until it ends (the session ends with it)."""
    stream.counters.change(opened=1)
    log.info("stream=%s opened", stream.stream_id)
    receiver = asyncio.create_task(stream.receive_loop(), name=f"fp-stream-{stream.stream_id}-recv")
    try:
        await stream.work_loop()
    finally:
        # Book-keeping first, before any await: a cancelled task (server shutdown) is cancelled again at every
        # await of this block, and the session must not outlive its connection.
        stream.closing = stream.closing or (CLOSE_NORMAL, "done")
        receiver.cancel()
        stream.handler.end()
        stream.counters.change(opened=-1)
        code, reason = stream.closing
        log.info("stream=%s closed code=%d reason=%s", stream.stream_id, code, reason)
        try:
            await asyncio.gather(receiver, return_exceptions=True)
            if not stream.client_gone:
                await stream.ws.close(code=code, reason=reason)
        except Exception:  # noqa: BLE001 - the client went away meanwhile (RuntimeError, WebSocketDisconnect)
            pass
