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
fields (:mod:`server.frames_raw`). Answers carry the host phases in ``timings_ms`` and ``Server-Timing``
(:mod:`server.phases`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Annotated

import numpy as np
from fastapi import APIRouter, Depends, File, Form, Path, UploadFile
from starlette.requests import Request
from starlette.responses import Response

from foundationpose.errors import InputError, UnknownObjectError
from server import codecs, pose_flow
from server.errors import PoseDivergedError, request_id_of
from server.fields import ID_PATTERN
from server.phases import Phases, server_timing
from server.pose_flow import admit, register_submit, track_submit
from server.schemas import ERROR_RESPONSES, DeletedSession, RegisterResponse, SessionInfo, TrackResponse
from server.sessions import Session
from server.state import ServerState, get_state

__all__ = ["router"]

log = logging.getLogger(__name__)
router = APIRouter(tags=["pose"])


StateDep = Annotated[ServerState, Depends(get_state)]

_RGB_DOC = "Colour image, PNG or JPEG, 8 bits per channel; treated as RGB order."
_DEPTH_DOC = ("Depth, same size as rgb: a 16-bit single-channel PNG in **millimetres** (0 = no reading), or a "
              "`.npy` float32 array in **metres** (0 or NaN = no reading). Detected by content.")
_MASK_DOC = "Object mask, single-channel PNG the size of rgb; pixels > 0 are the object."
_K_DOC = ("Camera intrinsics of this image, JSON 3x3 in pixels: `[[fx, 0, cx], [0, fy, cy], [0, 0, 1]]`; "
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


def _pose_json(pose: np.ndarray) -> list[list[float]]:
    return np.asarray(pose, dtype=np.float64).tolist()


def _check_finite(pose: np.ndarray, what: str) -> None:
    if not np.isfinite(pose).all():
        raise PoseDivergedError(f"{what} produced a pose with NaN or inf entries; nothing was stored")


def _answer(state: ServerState, endpoint: str, body: dict, result_timings: dict[str, float],
            phases: Phases) -> Response:
    """The JSON answer: timings_ms = the pipeline's stages + the host phases so far; ``encode`` is timed
    here and reported in ``Server-Timing`` and /metrics (it cannot be inside the body it times)."""
    body["timings_ms"] = {**result_timings, **{k: round(v, 4) for k, v in phases.ms.items()}}
    content = json.dumps(body, separators=(",", ":"), allow_nan=False).encode("utf-8")
    phases.lap("encode")
    state.metrics.observe_stages(endpoint, pose_flow.split_timings(result_timings))
    state.metrics.observe_phases(endpoint, phases.ms)
    phases.log(endpoint)
    return Response(content, media_type="application/json", headers={"Server-Timing": server_timing(phases.ms)})


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


_RGB_SHAPE_DOC = "Raw rgb: `H,W,3` of uint8 RGB pixels, row-major (the rgb part is then the bare pixel bytes)."
_DEPTH_SHAPE_DOC = "Raw depth: `H,W` (the depth part is then the bare values; needs depth_dtype)."
_DEPTH_DTYPE_DOC = "Raw depth: `uint16` (millimetres, 0 = no reading) or `float32` (metres), little-endian."
_MASK_SHAPE_DOC = "Raw mask: `H,W` of uint8, > 0 = object (the mask part is then the bare bytes)."


@router.post("/register", response_model=RegisterResponse, responses=ERROR_RESPONSES,
             summary="Register an object in a first frame", description=_REGISTER_DESCRIPTION)
async def register(
    request: Request,
    state: StateDep,
    object_id: Annotated[str, Form(description="Id of a loaded object (GET /objects).", examples=["mustard"],
                                   pattern=ID_PATTERN)],
    K: Annotated[str, Form(description=_K_DOC, examples=["[[607.06,0,324.5],[0,606.75,237.92],[0,0,1]]"])],
    rgb: Annotated[UploadFile, File(description=_RGB_DOC)],
    depth: Annotated[UploadFile, File(description=_DEPTH_DOC)],
    mask: Annotated[UploadFile, File(description=_MASK_DOC)],
    rgb_shape: Annotated[str | None, Form(description=_RGB_SHAPE_DOC, examples=["480,640,3"])] = None,
    depth_shape: Annotated[str | None, Form(description=_DEPTH_SHAPE_DOC, examples=["480,640"])] = None,
    depth_dtype: Annotated[str | None, Form(description=_DEPTH_DTYPE_DOC, examples=["uint16"])] = None,
    mask_shape: Annotated[str | None, Form(description=_MASK_SHAPE_DOC, examples=["480,640"])] = None,
) -> Response:
    phases = _phases(request)
    state.require_ready()
    entry = state.objects.get(object_id)
    rgb_b, depth_b, mask_b = await _read(rgb), await _read(depth), await _read(mask)
    frame = _frame(rgb_b, depth_b, RawFields(rgb_shape, depth_shape, depth_dtype, mask_shape), mask_b)
    phases.lap("parse")
    outcome, request = await state.in_thread(register_submit, state, phases, entry.model, frame, K)
    result = await pose_flow.pipeline_result(state, outcome, phases, "register")
    _check_finite(result.cam_from_mesh, "register")
    if not state.objects.is_current(entry):
        raise UnknownObjectError(f"object_id: {object_id!r} was deleted while the request ran")
    session = state.sessions.create(object_id=object_id, obj=entry.model, K=request.K, image_hw=request.hw,
                                    cam_from_centred=result.cam_from_centred, pose=result.cam_from_mesh, score=result.score)
    body = {"session_id": session.session_id, "object_id": object_id, "pose": _pose_json(result.cam_from_mesh),
            "score": float(result.score) if np.isfinite(result.score) else None}
    return _answer(state, "/register", body, result.timings_ms, phases)


@router.post("/track", response_model=TrackResponse, responses=ERROR_RESPONSES,
             summary="Track an object into the next frame", description=_TRACK_DESCRIPTION)
async def track(
    request: Request,
    state: StateDep,
    rgb: Annotated[UploadFile, File(description=_RGB_DOC)],
    depth: Annotated[UploadFile, File(description=_DEPTH_DOC)],
    session_id: Annotated[str | None, Form(description="Session from POST /register. Excludes `pose` and "
                                                       "`object_id`.", pattern=ID_PATTERN)] = None,
    K: Annotated[str | None, Form(description=_K_DOC + " Optional with a session_id (required when the frame "
                                                       "size differs from the session's); required without.")] = None,
    pose: Annotated[str | None, Form(description="Stateless (without session_id): previous pose, JSON 4x4 "
                                                 "cam_from_mesh, metres.")] = None,
    object_id: Annotated[str | None, Form(description="Stateless (without session_id): the object's id.",
                                          pattern=ID_PATTERN)] = None,
    rgb_shape: Annotated[str | None, Form(description=_RGB_SHAPE_DOC, examples=["480,640,3"])] = None,
    depth_shape: Annotated[str | None, Form(description=_DEPTH_SHAPE_DOC, examples=["480,640"])] = None,
    depth_dtype: Annotated[str | None, Form(description=_DEPTH_DTYPE_DOC, examples=["uint16"])] = None,
) -> Response:
    phases = _phases(request)
    state.require_ready()
    rgb_b, depth_b = await _read(rgb), await _read(depth)
    frame = _frame(rgb_b, depth_b, RawFields(rgb_shape, depth_shape, depth_dtype))
    phases.lap("parse")
    if session_id is not None:
        if pose is not None or object_id is not None:
            raise InputError("session_id", "either session_id, or pose and object_id (stateless), not both",
                             "session_id with " + " and ".join(n for n, v in (("pose", pose), ("object_id", object_id)) if v))
        return await _track_session(state, phases, state.sessions.get(session_id), frame, K)
    if pose is None or object_id is None:
        raise InputError("session_id", "a session_id, or pose and object_id for stateless tracking",
                         "neither" if pose is None and object_id is None else "only one of pose and object_id")
    return await _track_stateless(state, phases, object_id, pose, frame, K)


async def _track_session(state: ServerState, phases: Phases, session: Session, frame: pose_flow.FrameBytes,
                         K_text: str | None) -> Response:
    with admit(state, "/track", session.session_id):
        async with session.lock:  # FIFO: frames of one session apply in arrival order
            phases.lap("queue")
            if not state.sessions.is_live(session):
                state.sessions.get(session.session_id)  # raises UnknownSessionError (deleted while we waited)
            outcome = await state.in_thread(track_submit, state, phases, session.obj, frame, K_text, session,
                                            session.cam_from_centred.astype(np.float64), session.session_id, "centred")
            result = await pose_flow.pipeline_result(state, outcome, phases, "track")
            _check_finite(result.cam_from_mesh, "track")
            if not state.sessions.advance(session, cam_from_centred=result.cam_from_centred, pose=result.cam_from_mesh):
                log.info("session %s ended while its track request ran; the result is returned, not stored",
                         session.session_id)
            frame_no = session.frames
    body = {"session_id": session.session_id, "object_id": session.object_id, "pose": _pose_json(result.cam_from_mesh),
            "frame": frame_no}
    return _answer(state, "/track", body, result.timings_ms, phases)


async def _track_stateless(state: ServerState, phases: Phases, object_id: str, pose_text: str,
                           frame: pose_flow.FrameBytes, K_text: str | None) -> Response:
    entry = state.objects.get(object_id)
    prev = codecs.parse_pose(pose_text, "pose")
    with admit(state, "/track", None):
        phases.lap("queue")
        outcome = await state.in_thread(track_submit, state, phases, entry.model, frame, K_text, None, prev,
                                        None, "mesh")
        result = await pose_flow.pipeline_result(state, outcome, phases, "track")
        _check_finite(result.cam_from_mesh, "track")
    body = {"session_id": None, "object_id": object_id, "pose": _pose_json(result.cam_from_mesh), "frame": None}
    return _answer(state, "/track", body, result.timings_ms, phases)


SessionIdPath = Annotated[str, Path(description="Session from POST /register.", pattern=ID_PATTERN)]


@router.get("/sessions/{session_id}", response_model=SessionInfo, responses=ERROR_RESPONSES,
            summary="Read a tracking session (also refreshes its idle timer)")
async def get_session(state: StateDep, session_id: SessionIdPath) -> SessionInfo:
    state.require_ready()
    stored = state.sessions.peek(session_id)
    idle = state.sessions.clock() - stored.last_used_s if stored is not None else 0.0
    session = state.sessions.get(session_id)  # expires it now if it is past its ttl
    return SessionInfo(session_id=session.session_id, object_id=session.object_id, pose=_pose_json(session.pose),
                       K=session.K.tolist(), score=session.score, frames=session.frames, idle_s=max(0.0, idle),
                       ttl_s=state.sessions.ttl_s)


@router.delete("/sessions/{session_id}", response_model=DeletedSession, responses=ERROR_RESPONSES,
               summary="End a tracking session")
async def delete_session(state: StateDep, session_id: SessionIdPath) -> DeletedSession:
    state.require_ready()
    state.sessions.delete(session_id)
    return DeletedSession(session_id=session_id)
