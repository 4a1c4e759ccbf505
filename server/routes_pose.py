"""``POST /register``, ``POST /track`` and the session routes.

Each handler reads its uploads (already bounded by the body limit), then, in a worker thread
(:mod:`server.pose_flow`), decodes them, validates the whole request once (``validate.register_request`` /
``validate.track_request`` with the service's limits) and submits it (``submit`` waits at most
``submit_timeout_s`` for room, else 503 + a measured Retry-After), and awaits the pipeline's future
without blocking the event loop. The valid-masked-depth rule is the pipeline's (it needs the filtered
depth), so the server never refuses a frame the algorithm accepts. Track requests pass admission first (:mod:`server.admission`: one running + one waiting per
session, else 429; a bounded total, else 503). Track requests of one session hold that session's
``asyncio.Lock`` from lookup to update, so they apply in arrival order; the session changes only when
a step succeeds. Images are PNG / JPEG (/.npy depth) or raw pixels with ``*_shape`` / ``depth_dtype``
fields (:mod:`server.frames_raw`); ``POST /track/binary`` takes the same request as one binary body (the
stream's message container, one parser) instead of a multipart form. Answers carry the host phases in ``timings_ms`` and ``Server-Timing``
(:mod:`server.phases`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Annotated

import numpy as np
from fastapi import APIRouter, Depends, File, Form, Path, UploadFile
from starlette.requests import Request
from starlette.responses import Response

from foundationpose.errors import InputError, UnknownObjectError
from server import codecs, pose_flow
from server.binary_bodies import (
    BINARY_CONTENT_TYPE,
    BinaryRegister,
    BinaryTrack,
    parse_binary_register,
    parse_binary_track,
    read_binary_body,
)
from server.errors import request_id_of
from server.fields import ID_PATTERN
from server.phases import Phases
from server.pose_flow import (
    admit,
    admit_register,
    check_finite_pose,
    pose_json,
    register_submit,
    track_submit,
)
from server.schemas import ERROR_RESPONSES, DeletedSession, RegisterResponse, SessionInfo, TrackResponse
from server.sessions import Session
from server.state import ServerState, get_state

__all__ = ["BINARY_CONTENT_TYPE", "REGISTER_BINARY_DESCRIPTION", "TRACK_BINARY_DESCRIPTION", "TRACK_BINARY_OPENAPI",
           "BinaryRegister", "BinaryTrack", "parse_binary_register", "parse_binary_track", "read_binary_body", "router",
           "track_frame"]

log = logging.getLogger(__name__)
router = APIRouter(tags=["pose"])


StateDep = Annotated[ServerState, Depends(get_state)]

RGB_DOC = "Colour image, PNG or JPEG, 8 bits per channel; treated as RGB order."
DEPTH_DOC = ("Depth, same size as rgb: a 16-bit single-channel PNG in **millimetres** (0 = no reading), or a "
              "`.npy` float32 array in **metres** (0 or NaN = no reading). Detected by content.")
MASK_DOC = "Object mask, single-channel PNG the size of rgb; pixels > 0 are the object."
K_DOC = ("Camera intrinsics of this image, JSON 3x3 in pixels: `[[fx, 0, cx], [0, fy, cy], [0, 0, 1]]`; "
          "fx, fy between 1/100 and 100 times the image's longer side, the principal point in or near the image.")

_REGISTER_DESCRIPTION = """
First frame of an object: about 252 rotation hypotheses are refined and scored and the best is returned
(fewer with the server's `--hypotheses`). Creates a tracking session.

```bash
curl -s -X POST http://127.0.0.1:8000/register \\
  -H "Authorization: Bearer $FP_API_KEY" \\
  -F object_id=mustard -F rgb=@rgb.png -F depth=@depth.png -F mask=@mask.png \\
  -F 'K=[[607.06,0,324.5],[0,606.75,237.92],[0,0,1]]'
```
"""

_TRACK_DESCRIPTION = """
Next frame: refine the previous pose. **Either** a `session_id` (the server keeps the pose), **or**, for
stateless clients, the previous `pose` (4x4 cam_from_mesh, JSON) with `object_id` and `K`; `session_id`
excludes `pose` and `object_id`. With a session, `K` defaults to the session's intrinsics (a `K` sent is
used for this frame only); a frame of another size than the session's register frame must send its `K`.
Concurrent requests of one session are applied one after another, in arrival order; requests of
different sessions are batched together. A failed request leaves the session unchanged.

```bash
curl -s -X POST http://127.0.0.1:8000/track \\
  -F session_id=kq3N0c2mXq5b8tY1Zr7xVw -F rgb=@rgb_001.png -F depth=@depth_001.png
```
"""


async def _read(upload: UploadFile | None) -> bytes | None:
    return None if upload is None else await upload.read()


def _phases(request: Request) -> Phases:
    return Phases.for_request(request.scope, request_id_of(request))


def _frame(rgb_b: bytes, depth_b: bytes, raw: RawFields, mask_b: bytes | None = None) -> pose_flow.FrameBytes:
    return pose_flow.FrameBytes(rgb_b, depth_b, mask_b, rgb_shape=raw.rgb_shape, depth_shape=raw.depth_shape,
                                depth_dtype=raw.depth_dtype, mask_shape=raw.mask_shape)


@dataclass(frozen=True, slots=True)
class RawFields:
    rgb_shape: str | None = None
    depth_shape: str | None = None
    depth_dtype: str | None = None
    mask_shape: str | None = None


RGB_SHAPE_DOC = "Raw rgb: `H,W,3` of uint8 RGB pixels, row-major (the rgb part is then the bare pixel bytes)."
DEPTH_SHAPE_DOC = "Raw depth: `H,W` (the depth part is then the bare values; needs depth_dtype)."
DEPTH_DTYPE_DOC = "Raw depth: `uint16` (millimetres, 0 = no reading) or `float32` (metres), little-endian."
MASK_SHAPE_DOC = "Raw mask: `H,W` of uint8, > 0 = object (the mask part is then the bare bytes)."


@router.post("/register", response_model=RegisterResponse, responses=ERROR_RESPONSES,
             summary="Register an object in a first frame", description=_REGISTER_DESCRIPTION)
async def register(
    request: Request,
    state: StateDep,
    object_id: Annotated[str, Form(description="Id of a loaded object (GET /objects).", examples=["mustard"],
                                   pattern=ID_PATTERN)],
    K: Annotated[str, Form(description=K_DOC, examples=["[[607.06,0,324.5],[0,606.75,237.92],[0,0,1]]"])],
    rgb: Annotated[UploadFile, File(description=RGB_DOC)],
    depth: Annotated[UploadFile, File(description=DEPTH_DOC)],
    mask: Annotated[UploadFile, File(description=MASK_DOC)],
    rgb_shape: Annotated[str | None, Form(description=RGB_SHAPE_DOC, examples=["480,640,3"])] = None,
    depth_shape: Annotated[str | None, Form(description=DEPTH_SHAPE_DOC, examples=["480,640"])] = None,
    depth_dtype: Annotated[str | None, Form(description=DEPTH_DTYPE_DOC, examples=["uint16"])] = None,
    mask_shape: Annotated[str | None, Form(description=MASK_SHAPE_DOC, examples=["480,640"])] = None,
) -> Response:
    phases = _phases(request)
    state.require_ready()

    async def frame() -> pose_flow.FrameBytes:
        rgb_b, depth_b, mask_b = await _read(rgb), await _read(depth), await _read(mask)
        return _frame(rgb_b, depth_b, RawFields(rgb_shape, depth_shape, depth_dtype, mask_shape), mask_b)

    return await _register(state, phases, "/register", object_id, frame, K)


async def _register(state: ServerState, phases: Phases, endpoint: str, object_id: str,
                    frame_of: Callable[[], Awaitable[pose_flow.FrameBytes]], K_text: str) -> Response:
    """A register of either form (multipart or binary body): ``frame_of`` reads its images once admitted."""
    entry = state.objects.get(object_id)
    with admit_register(state, endpoint):  # before the decode: a refused register costs no decode
        frame = await frame_of()
        phases.lap("parse")
        outcome, request = await state.in_thread(register_submit, state, phases, entry.model, frame, K_text)
        result = await pose_flow.pipeline_result(state, outcome, phases, "register")
    check_finite_pose(result.cam_from_mesh, "register")
    if not state.objects.is_current(entry):
        raise UnknownObjectError(f"object_id: {object_id!r} was deleted while the request ran")
    session = state.sessions.create(object_id=object_id, obj=entry.model, K=request.K, image_hw=request.hw,
                                    cam_from_centred=result.cam_from_centred, pose=result.cam_from_mesh, score=result.score)
    body = {"session_id": session.session_id, "object_id": object_id, "pose": pose_json(result.cam_from_mesh),
            "score": float(result.score) if np.isfinite(result.score) else None}
    return pose_flow.answer(state.metrics, endpoint, body, result.timings_ms, phases)


@router.post("/track", response_model=TrackResponse, responses=ERROR_RESPONSES,
             summary="Track an object into the next frame", description=_TRACK_DESCRIPTION)
async def track(
    request: Request,
    state: StateDep,
    rgb: Annotated[UploadFile, File(description=RGB_DOC)],
    depth: Annotated[UploadFile, File(description=DEPTH_DOC)],
    session_id: Annotated[str | None, Form(description="Session from POST /register. Excludes `pose` and "
                                                       "`object_id`.", pattern=ID_PATTERN)] = None,
    K: Annotated[str | None, Form(description=K_DOC + " Optional with a session_id (required when the frame "
                                                       "size differs from the session's); required without.")] = None,
    pose: Annotated[str | None, Form(description="Stateless (without session_id): previous pose, JSON 4x4 "
                                                 "cam_from_mesh, metres.")] = None,
    object_id: Annotated[str | None, Form(description="Stateless (without session_id): the object's id.",
                                          pattern=ID_PATTERN)] = None,
    rgb_shape: Annotated[str | None, Form(description=RGB_SHAPE_DOC, examples=["480,640,3"])] = None,
    depth_shape: Annotated[str | None, Form(description=DEPTH_SHAPE_DOC, examples=["480,640"])] = None,
    depth_dtype: Annotated[str | None, Form(description=DEPTH_DTYPE_DOC, examples=["uint16"])] = None,
) -> Response:
    phases = _phases(request)
    state.require_ready()
    rgb_b, depth_b = await _read(rgb), await _read(depth)
    frame = _frame(rgb_b, depth_b, RawFields(rgb_shape, depth_shape, depth_dtype))
    phases.lap("parse")
    return (await track_frame(state, phases, "/track", frame, session_id=session_id, K_text=K, pose_text=pose,
                              object_id=object_id)).response()


async def track_frame(state: ServerState, phases: Phases, endpoint: str, frame: pose_flow.FrameBytes, *,
                      session_id: str | None, K_text: str | None, pose_text: str | None,
                      object_id: str | None, submit_in_loop: bool = False) -> pose_flow.PoseAnswer:
    """A track request of any form (multipart, binary body, or an ingest worker's frame: :mod:`server.ingest`):
    session or stateless; the answer's bytes, or a typed error for the error handlers. submit_in_loop: see
    :func:`pose_flow.run_submit`."""
    if session_id is not None:
        if pose_text is not None or object_id is not None:
            given = " and ".join(n for n, v in (("pose", pose_text), ("object_id", object_id)) if v)
            raise InputError("session_id", "either session_id, or pose and object_id (stateless), not both",
                             "session_id with " + given)
        return await _track_session(state, phases, endpoint, state.sessions.get(session_id), frame, K_text,
                                    submit_in_loop)
    if pose_text is None or object_id is None:
        raise InputError("session_id", "a session_id, or pose and object_id for stateless tracking",
                         "neither" if pose_text is None and object_id is None else "only one of pose and object_id")
    return await _track_stateless(state, phases, endpoint, object_id, pose_text, frame, K_text, submit_in_loop)


async def _track_session(state: ServerState, phases: Phases, endpoint: str, session: Session,
                         frame: pose_flow.FrameBytes, K_text: str | None, submit_in_loop: bool) -> pose_flow.PoseAnswer:
    with admit(state, endpoint, session.session_id):
        async with session.lock:  # FIFO: frames of one session apply in arrival order
            phases.lap("queue")
            if not state.sessions.is_live(session):
                state.sessions.get(session.session_id)  # raises UnknownSessionError (deleted while we waited)
            outcome, request = await pose_flow.run_submit(state, partial(
                track_submit, state, phases, session.obj, frame, K_text, session.cam_from_centred.astype(np.float64),
                key=session.session_id, prev_frame="centred", session_K=session.K, session_hw=session.image_hw),
                in_loop=submit_in_loop)
            result = await pose_flow.pipeline_result(state, outcome, phases, "track")
            check_finite_pose(result.cam_from_mesh, "track")
            if not state.sessions.advance(session, cam_from_centred=result.cam_from_centred, pose=result.cam_from_mesh,
                                          image_hw=request.hw):
                log.info("session %s ended while its track request ran; the result is returned, not stored",
                         session.session_id)
            frame_no = session.frames
    body = {"session_id": session.session_id, "object_id": session.object_id, "pose": pose_json(result.cam_from_mesh),
            "frame": frame_no}
    return pose_flow.answer_of(state.metrics, endpoint, body, result.timings_ms, phases)


async def _track_stateless(state: ServerState, phases: Phases, endpoint: str, object_id: str, pose_text: str,
                           frame: pose_flow.FrameBytes, K_text: str | None,
                           submit_in_loop: bool) -> pose_flow.PoseAnswer:
    entry = state.objects.get(object_id)
    prev = codecs.parse_pose(pose_text, "pose")
    with admit(state, endpoint, None):
        phases.lap("queue")
        outcome, _ = await pose_flow.run_submit(state, partial(
            track_submit, state, phases, entry.model, frame, K_text, prev, key=None, prev_frame="mesh"),
            in_loop=submit_in_loop)
        result = await pose_flow.pipeline_result(state, outcome, phases, "track")
        check_finite_pose(result.cam_from_mesh, "track")
    body = {"session_id": None, "object_id": object_id, "pose": pose_json(result.cam_from_mesh), "frame": None}
    return pose_flow.answer_of(state.metrics, endpoint, body, result.timings_ms, phases)


TRACK_BINARY_DESCRIPTION = """
`POST /track` in one binary body instead of a multipart form: the container of the WebSocket stream's
messages (`uint32` little-endian header length, a UTF-8 JSON header, then the parts back to back; see
`server.frames_raw`), sent with `Content-Type: application/octet-stream`. The header holds what the
form fields hold: `session_id`, or `object_id` + `pose` (4x4, nested list or JSON text) for stateless
tracking; `K` (3x3) optional with a session; `parts` describes `rgb` and `depth` (raw pixels with
`shape` / `dtype`, or PNG / JPEG / .npy bytes without). Same rules, errors (422 naming the field), auth,
admission and per-session bounds as `POST /track`; the answer is the same JSON.

```python
from server.client import track_body
body = track_body(rgb, depth_m, session_id=sid)   # rgb (H, W, 3) uint8, depth_m (H, W) float metres
httpx.post(url + "/track/binary", content=body, headers={"Content-Type": "application/octet-stream"})
```
"""


TRACK_BINARY_OPENAPI = {"requestBody": {"required": True, "content": {BINARY_CONTENT_TYPE: {
    "schema": {"type": "string", "format": "binary"}}}}}


@router.post("/track/binary", response_model=TrackResponse, responses=ERROR_RESPONSES,
             summary="Track an object into the next frame (one binary body)", description=TRACK_BINARY_DESCRIPTION,
             openapi_extra=TRACK_BINARY_OPENAPI)
async def track_binary(request: Request, state: StateDep) -> Response:
    data = await read_binary_body(request)
    phases = _phases(request)  # after the body: receive = its first to last byte
    state.require_ready()
    track = parse_binary_track(data)
    phases.lap("parse")
    return (await track_frame(state, phases, "/track/binary", track.frame, session_id=track.session_id,
                              K_text=track.K_text, pose_text=track.pose_text, object_id=track.object_id)).response()


REGISTER_BINARY_DESCRIPTION = """
`POST /register` in one binary body instead of a multipart form: the WebSocket stream's register message
(`uint32` little-endian header length, a UTF-8 JSON header, then the parts back to back; see
`server.frames_raw`), sent with `Content-Type: application/octet-stream`. The header holds `object_id` and `K`
(3x3; `"type": "register"` may be given); `parts` describes `rgb`, `depth` and `mask` (raw pixels with `shape` /
`dtype`, or PNG / JPEG / .npy bytes without). Same rules, errors (422 naming the field), auth and admission as
`POST /register`; the answer is the same JSON (and a session).

```python
from server.client import register_message   # the stream's register message is this body
body = register_message("mustard", K, rgb, depth_m, mask)   # rgb (H, W, 3) uint8, depth_m metres, mask (H, W)
httpx.post(url + "/register/binary", content=body, headers={"Content-Type": "application/octet-stream"})
```
"""


@router.post("/register/binary", response_model=RegisterResponse, responses=ERROR_RESPONSES,
             summary="Register an object in a first frame (one binary body)", description=REGISTER_BINARY_DESCRIPTION,
             openapi_extra=TRACK_BINARY_OPENAPI)
async def register_binary(request: Request, state: StateDep) -> Response:
    data = await read_binary_body(request, "/register")
    phases = _phases(request)  # after the body: receive = its first to last byte
    state.require_ready()
    reg = parse_binary_register(data)

    async def frame() -> pose_flow.FrameBytes:
        return reg.frame

    return await _register(state, phases, "/register/binary", reg.object_id, frame, reg.K_text)


SessionIdPath = Annotated[str, Path(description="Session from POST /register.", pattern=ID_PATTERN)]


@router.get("/sessions/{session_id}", response_model=SessionInfo, responses=ERROR_RESPONSES,
            summary="Read a tracking session (also refreshes its idle timer)")
async def get_session(state: StateDep, session_id: SessionIdPath) -> SessionInfo:
    state.require_ready()
    stored = state.sessions.peek(session_id)
    idle = state.sessions.clock() - stored.last_used_s if stored is not None else 0.0
    session = state.sessions.get(session_id)  # expires it now if it is past its ttl
    return SessionInfo(session_id=session.session_id, object_id=session.object_id, pose=pose_json(session.pose),
                       K=session.K.tolist(), score=session.score, frames=session.frames, idle_s=max(0.0, idle),
                       ttl_s=state.sessions.ttl_s)


@router.delete("/sessions/{session_id}", response_model=DeletedSession, responses=ERROR_RESPONSES,
               summary="End a tracking session")
async def delete_session(state: StateDep, session_id: SessionIdPath) -> DeletedSession:
    state.require_ready()
    state.sessions.delete(session_id)
    return DeletedSession(session_id=session_id)
