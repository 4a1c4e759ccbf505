"""``WS /track/stream``: one WebSocket connection = one tracking session, newest frame wins.

Protocol (every client message is one **binary** message in the container of
:mod:`server.frames_raw`: ``uint32 LE header length | JSON header | parts``; every server message is
one JSON **text** message):

1. Connect with ``Authorization: Bearer <key>`` when the server has a key (refused with 401 before the
   upgrade otherwise, like HTTP).
2. Register: header ``{"type": "register", "object_id": "mustard", "K": [[fx,0,cx],[0,fy,cy],[0,0,1]]}``
   with parts ``rgb``, ``depth``, ``mask`` (raw: ``shape``/``dtype`` declared; or PNG/JPEG bytes).
   Answer: ``{"type": "registered", "session_id", "object_id", "pose", "score", "timings_ms"}``.
   **Or** start from a known pose, without a register (the streaming twin of a stateless ``POST /track``):
   header ``{"type": "start", "object_id": "mustard", "K": [[...]], "pose": [[...4x4 cam_from_mesh, m]]}``
   with no parts. K and pose are checked as a stateless track's are (422 naming ``K`` / ``pose``; K's
   fit to the image with each frame, and a frame of another size than the session's first must send
   its K). Answer: ``{"type": "started", "session_id", "object_id", "pose", "score": null, "timings_ms"}``
   at once (no pipeline work, no register admission). One register or start per connection.
3. Frames: header ``{"type": "frame", "frame": 17}`` (``frame``: the client's number, optional; ``K``
   optional, for this frame only) with parts ``rgb`` and ``depth``. Answer, in order:
   ``{"type": "pose", "frame": 17, "frames": <steps so far>, "pose", "skipped": [15, 16], "timings_ms"}``.
4. When frames arrive faster than they are answered, a newer frame replaces the one still waiting
   (one frame runs, at most one waits): the replaced frames are listed in the ``skipped`` of the answer
   to the frame that replaced them. Latency stays bounded by about two frame times instead of growing.
5. A bad message is answered ``{"type": "error", "frame": 17, "error": {"type", "field", "message"},
   "skipped": [...]}`` (the same error types and fields as HTTP, plus ``retry_after_ms`` when the lane is
   full) and the session goes on. The connection closes after ``stream_idle_s`` without a message
   (code 1001), when the session is deleted or expires (1000), when the server shuts down or the
   pipeline breaks (1011 / 1012), or on an unexpected error (1011). Closing the connection ends the session.

The session is a normal server session (``GET /sessions/{id}`` shows it; it counts against
``max_sessions``); frames pass the same track admission as HTTP (one admitted at a time per stream).

The server never negotiates ``permessage-deflate`` (:data:`UVICORN_WS_OPTIONS`; clients should not offer
it either, see :data:`server.client.STREAM_CONNECT_OPTIONS`): zlib on a 640x480 frame's raw pixels
(1.5 MB) costs the client tens of ms per frame and the server's event loop the inflate, outside every
phase in ``timings_ms``, to save bandwidth that loopback and LAN links do not need.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
from fastapi import APIRouter, WebSocket
from starlette.websockets import WebSocketDisconnect

from deploy_core.errors import BrokenPipelineError, ClosedError
from foundationpose.errors import InputError, UnknownSessionError
from server import frames_raw, jsonio, pose_flow
from server.errors import NotReadyError, OverloadedError, PayloadTooLargeError, classify
from server.phases import Phases
from server.pose_flow import (
    admit,
    admit_register,
    frame_of_parts,
    header_object_id,
    json_text_of,
    pose_json,
    register_submit,
    start_request,
    track_submit,
)

if TYPE_CHECKING:  # the ingest workers subclass Stream: this module stays torch-free at import
    from server.sessions import Session
    from server.state import ServerState

__all__ = ["ENDPOINT", "NO_SESSION_YET", "STREAM_LABELS", "UVICORN_WS_OPTIONS", "Stream", "StreamItem", "router",
           "run_stream"]

log = logging.getLogger(__name__)
router = APIRouter(tags=["pose"])

ENDPOINT = "/track/stream"
REGISTER_LABEL = "/track/stream:register"  # the stream's register in the phase / stage histograms
START_LABEL = "/track/stream:start"  # its start message in the phase histogram
STREAM_LABELS = {"frame": ENDPOINT, "register": REGISTER_LABEL, "start": START_LABEL}
_OPENING = ("register", "start")  # the messages that open the connection's session
CLOSE_NORMAL, CLOSE_GOING_AWAY, CLOSE_INTERNAL, CLOSE_RESTART = 1000, 1001, 1011, 1012
# uvicorn settings of every server of this app (``python -m server``, the tests' live servers): no per-message
# compression of the pixel messages (see the module docstring).
UVICORN_WS_OPTIONS: dict[str, Any] = {"ws_per_message_deflate": False}


@dataclass(slots=True)
class StreamItem:
    """One received message, waiting for the worker."""

    kind: str  # register | start | frame | bad
    received_ns: int
    frame: int | None = None
    message: frames_raw.Message | None = None
    error: Exception | None = None
    skipped: list[int] = field(default_factory=list)  # older frames this one replaced (newest wins)


@dataclass(slots=True)
class Stream:
    """One connection. ``state``: the host (``config``, ``metrics``, ``streams``): the server's
    :class:`ServerState` here; the Ray Serve ingress subclasses this with its own register / track."""

    state: Any
    ws: WebSocket
    stream_id: str
    session: Session | None = None
    waiting: deque[StreamItem] = field(default_factory=deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    closing: tuple[int, str] | None = None  # (code, reason) once the receiver or worker decided to end
    client_gone: bool = False
    busy: bool = False  # the worker is answering a message
    received_frames: int = 0
    submit_in_loop: bool = False  # frames arrive decoded and page-locked (an ingest worker's): pose_flow.run_submit

    # -- receiving: newest frame wins ------------------------------------------------------------
    def take(self, data: bytes) -> None:
        now = time.perf_counter_ns()
        if len(data) > self.state.config.max_upload_bytes:
            limit = self.state.config.max_upload_bytes
            self._enqueue(StreamItem("bad", now, error=PayloadTooLargeError(
                f"message: expected at most {limit} bytes; got {len(data)}")))
            return
        try:
            message = frames_raw.unpack_message(data)
        except InputError as exc:
            self._enqueue(StreamItem("bad", now, error=exc))
            return
        kind = message.header.get("type")
        if kind == "frame":
            self.received_frames += 1
            number = _frame_number(message.header.get("frame"))
            self._enqueue(StreamItem("frame", now, self.received_frames if number is None else number, message))
        elif kind in _OPENING and not any(item.kind in _OPENING for item in self.waiting):
            self.waiting.append(StreamItem(kind, now, None, message))  # never replaced by a frame
            self.wake.set()
        elif kind in _OPENING:  # at most one waits: what is held per connection stays bounded
            self._enqueue(StreamItem("bad", now, error=InputError("type", "one register or start at a time",
                                                             f"a second {kind}")))
        else:
            self._enqueue(StreamItem("bad", now, _frame_number(message.header.get("frame")),
                                error=InputError("type", "'register', 'start' or 'frame'", repr(kind)[:40])))

    def _enqueue(self, item: StreamItem) -> None:
        """Append a frame (or a bad message), dropping the frames still waiting: they are skipped."""
        kept: deque[StreamItem] = deque()
        dropped = 0
        for old in self.waiting:
            if old.kind == "register":
                kept.append(old)
            else:
                dropped += 1
                item.skipped += old.skipped
                if old.frame is not None:
                    item.skipped.append(old.frame)
        kept.append(item)
        self.waiting = kept
        self.wake.set()
        self.state.streams.change(received=int(item.kind == "frame"), skipped=dropped)

    async def receive_loop(self) -> None:
        idle = self.state.config.stream_idle_s
        while self.closing is None:
            try:
                message = await asyncio.wait_for(self.ws.receive(), idle)
            except asyncio.TimeoutError:
                if self.busy or self.waiting:  # idle means nothing to do on either side (a CPU register is long)
                    continue
                self.closing = (CLOSE_GOING_AWAY, f"idle for {idle:g} s")
                break
            if message["type"] == "websocket.disconnect":
                self.client_gone = True
                self.closing = (CLOSE_NORMAL, "client closed")
                break
            data = message.get("bytes")
            if data is None:
                self._enqueue(StreamItem("bad", time.perf_counter_ns(), error=InputError(
                    "message", "a binary message (uint32 header length, JSON header, parts)", "a text message")))
            else:
                self.take(data)
        self.wake.set()

    # -- working: one message at a time, answers in order ----------------------------------------
    async def work_loop(self) -> None:
        """Answer waiting messages in order until the client leaves, a fatal error, or idle with nothing left."""
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
        except (WebSocketDisconnect, RuntimeError):  # Starlette: RuntimeError when sending after a close
            self.client_gone = True
            self.closing = self.closing or (CLOSE_NORMAL, "client gone")
            return False
        return True

    async def handle(self, item: StreamItem) -> bool:
        """Answer one message; True when the stream must end (see :meth:`judge`)."""
        state = self.state
        phases = Phases(start_ns=item.received_ns, request_id=f"{self.stream_id}:{item.frame}")
        state.metrics.request_started()
        status, fatal = 200, False
        try:
            if item.error is not None:
                raise item.error
            if item.kind == "register":
                body, timings = await self.register(item, phases)
            elif item.kind == "start":
                body, timings = await self.start(item, phases)
            else:
                body, timings = await self.track(item, phases)
        except Exception as exc:  # noqa: BLE001 - every failure is answered, then judged
            status, fatal = self.judge(exc, item)
            body = self.error_body(exc, item)
            timings = None
        body["skipped"] = item.skipped
        if timings is not None:
            body["timings_ms"] = {**timings, **{k: round(v, 4) for k, v in phases.ms.items()}}
        sent = await self.send(body)
        if timings is not None:
            phases.lap("encode")
            label = STREAM_LABELS[item.kind]
            state.metrics.observe_stages(label, pose_flow.split_timings(timings))
            state.metrics.observe_phases(label, phases.ms)
            phases.log(label)
        seconds = (time.perf_counter_ns() - item.received_ns) / 1e9
        state.metrics.request_finished(ENDPOINT, "WS", status if sent else 499, seconds)
        return fatal or not sent

    def error_body(self, exc: Exception, item: StreamItem) -> dict:
        info = classify(exc)
        error: dict[str, Any] = {"type": info.type, "message": "internal server error (see the server log)"
                                 if info.internal else info.message}
        if info.field is not None:
            error["field"] = info.field
        if isinstance(exc, OverloadedError):
            error["retry_after_ms"] = round(exc.retry_after_ms, 1)
        return {"type": "error", "frame": item.frame, "error": error}

    def judge(self, exc: Exception, item: StreamItem) -> tuple[int, bool]:
        """(status, fatal): bad input, a full lane or a timeout spare the session; the rest end the stream."""
        info = classify(exc)
        if info.internal:
            log.error("stream %s frame %s failed with an unexpected %s", self.stream_id, item.frame,
                      type(exc).__name__, exc_info=exc)
            self.closing = (CLOSE_INTERNAL, "internal error")
        elif isinstance(exc, UnknownSessionError) and self.session is not None:
            self.closing = (CLOSE_NORMAL, "the session was deleted or expired")
        elif isinstance(exc, (ClosedError, NotReadyError)):
            self.closing = (CLOSE_RESTART, "the server is not serving (starting or shutting down)")
        elif isinstance(exc, BrokenPipelineError):
            self.closing = (CLOSE_INTERNAL, "the pose pipeline failed")
        else:
            return info.status, False
        return info.status, True

    async def register(self, item: StreamItem, phases: Phases) -> tuple[dict, dict[str, float]]:
        state = self.state
        state.require_ready()
        self.check_no_session("register")
        header, parts = item.message.header, item.message.parts
        object_id = header_object_id(header)
        entry = state.objects.get(object_id)
        with admit_register(state, ENDPOINT):  # before the decode: a refused register costs no decode
            frame = frame_of_parts(parts, with_mask=True)
            phases.lap("parse")
            outcome, request = await state.in_thread(register_submit, state, phases, entry.model, frame,
                                                     json_text_of(header.get("K")))
            result = await pose_flow.pipeline_result(state, outcome, phases, "register")
        pose_flow.check_finite_pose(result.cam_from_mesh, "register")
        self.session = state.sessions.create(object_id=object_id, obj=entry.model, K=request.K, image_hw=request.hw,
                                             cam_from_centred=result.cam_from_centred, pose=result.cam_from_mesh,
                                             score=result.score)
        body = {"type": "registered", "session_id": self.session.session_id, "object_id": object_id,
                "pose": result.cam_from_mesh.tolist(), "score": float(result.score) if np.isfinite(result.score) else None}
        return body, result.timings_ms

    async def track(self, item: StreamItem, phases: Phases) -> tuple[dict, dict[str, float]]:
        state = self.state
        session = self.session
        if session is None:
            raise InputError("type", NO_SESSION_YET, "a frame")
        if not state.sessions.is_live(session):
            state.sessions.get(session.session_id)  # UnknownSessionError: deleted or expired
        header = item.message.header
        frame = frame_of_parts(item.message.parts, with_mask=False)
        K_value = header.get("K")
        with admit(state, ENDPOINT, session.session_id):
            async with session.lock:  # an HTTP /track of the same session may hold it
                phases.lap("queue")
                outcome, request = await pose_flow.run_submit(state, partial(
                    track_submit, state, phases, session.obj, frame, None if K_value is None else json_text_of(K_value),
                    session.cam_from_centred.astype(np.float64), key=session.session_id, prev_frame="centred",
                    session_K=session.K, session_hw=session.image_hw), in_loop=self.submit_in_loop)
                result = await pose_flow.pipeline_result(state, outcome, phases, "track")
                pose_flow.check_finite_pose(result.cam_from_mesh, "track")
                state.sessions.advance(session, cam_from_centred=result.cam_from_centred, pose=result.cam_from_mesh,
                                       image_hw=request.hw)
        body = {"type": "pose", "frame": item.frame, "frames": session.frames, "pose": result.cam_from_mesh.tolist()}
        return body, result.timings_ms

    async def start(self, item: StreamItem, phases: Phases) -> tuple[dict, dict[str, float]]:
        self.state.require_ready()
        return self.start_session(item, phases, self.state.service.limits.max_translation_m)

    def start_session(self, item: StreamItem, phases: Phases, max_translation_m: float | None) -> tuple[dict, dict[str, float]]:
        """The session of a start message: the given pose and K, checked as a stateless track's (no frame,
        so no pipeline work). ``state`` needs ``objects`` and ``sessions`` (the Ray Serve stream shares this)."""
        self.check_no_session("start")
        header, parts = item.message.header, item.message.parts
        if parts:
            raise InputError("parts", "no parts in a start message (frames follow as frame messages)",
                             f"parts {sorted(parts)}")
        object_id = header_object_id(header)
        entry = self.state.objects.get(object_id)
        K, cam_from_mesh = start_request(header.get("K"), header.get("pose"), max_translation_m=max_translation_m)
        phases.lap("validate")
        from foundationpose.coordinate_frames import to_centred_frame  # torch: the GPU process's side only

        model = entry.model
        self.session = self.state.sessions.create(
            object_id=object_id, obj=model, K=K, image_hw=None, pose=cam_from_mesh, score=float("nan"),
            cam_from_centred=to_centred_frame(cam_from_mesh, model.mesh_from_centred))  # as a stateless track starts
        body = {"type": "started", "session_id": self.session.session_id, "object_id": object_id,
                "pose": pose_json(cam_from_mesh), "score": None}
        return body, {}

    def check_no_session(self, kind: str) -> None:
        if self.session is not None:
            raise InputError("type", "one register or start per connection (open a new one for another session)",
                             f"a {kind} after the session began")

    def end_session(self) -> None:
        if self.session is not None and self.state.sessions.is_live(self.session):
            self.state.sessions.delete(self.session.session_id)


NO_SESSION_YET = "a register or start message before the first frame"


def _frame_number(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@router.websocket(ENDPOINT)
async def track_stream(websocket: WebSocket) -> None:
    state: ServerState = websocket.app.state.fp
    await websocket.accept()
    await run_stream(Stream(state, websocket, secrets.token_hex(4)))


async def run_stream(stream: Stream) -> None:
    """Serve one accepted connection until it ends (the session ends with it)."""
    state, websocket = stream.state, stream.ws
    state.streams.change(opened=1)
    receiver = asyncio.create_task(stream.receive_loop(), name=f"fp-stream-{stream.stream_id}-recv")
    try:
        await stream.work_loop()
    finally:
        # Book-keeping first, before any await: a cancelled task (server shutdown) is cancelled again at
        # every await of this block, and the session must not outlive its connection.
        stream.closing = stream.closing or (CLOSE_NORMAL, "done")
        receiver.cancel()
        stream.end_session()
        state.streams.change(opened=-1)
        code, reason = stream.closing
        log.debug("stream %s ended: %d %s", stream.stream_id, code, reason)
        try:
            await asyncio.gather(receiver, return_exceptions=True)
            if not stream.client_gone:
                await websocket.close(code=code, reason=reason)
        except (RuntimeError, WebSocketDisconnect):
            pass
