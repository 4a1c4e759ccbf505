"""``POST /register``, ``POST /track`` and the session routes.

Each handler reads its uploads (already bounded by the body limit), then, in a worker thread, decodes
them (:mod:`server.codecs`), validates the whole request once (``validate.register_request`` /
``validate.track_request`` with the service's limits) and submits it (``submit`` waits at most
``submit_timeout_s`` for room, else BusyError -> 503), and awaits the pipeline's future without
blocking the event loop. The valid-masked-depth rule is the pipeline's (it needs the filtered depth),
so the server never refuses a frame the algorithm accepts. Track requests of one
session hold that session's ``asyncio.Lock`` from lookup to update, so they apply in arrival order;
the session changes only when a step succeeds.
"""

from __future__ import annotations

import logging
from typing import Annotated

import numpy as np
from fastapi import APIRouter, Depends, File, Form, Path, UploadFile

from foundationpose import validate
from foundationpose.errors import InputError, UnknownObjectError
from server import codecs
from server.fields import ID_PATTERN
from server.pose_io import check_finite_pose as _check_finite
from server.pose_io import decode_register_request, decode_track_request
from server.pose_io import pose_json as _pose_json
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


@router.post("/register", response_model=RegisterResponse, responses=ERROR_RESPONSES,
             summary="Register an object in a first frame", description=_REGISTER_DESCRIPTION)
async def register(
    state: StateDep,
    object_id: Annotated[str, Form(description="Id of a loaded object (GET /objects).", examples=["mustard"],
                                   pattern=ID_PATTERN)],
    K: Annotated[str, Form(description=_K_DOC, examples=["[[607.06,0,324.5],[0,606.75,237.92],[0,0,1]]"])],
    rgb: Annotated[UploadFile, File(description=_RGB_DOC)],
    depth: Annotated[UploadFile, File(description=_DEPTH_DOC)],
    mask: Annotated[UploadFile, File(description=_MASK_DOC)],
) -> RegisterResponse:
    state.require_ready()
    entry = state.objects.get(object_id)
    rgb_b, depth_b, mask_b = await _read(rgb), await _read(depth), await _read(mask)

    def decode_and_submit():
        request = decode_register_request(rgb_b, depth_b, mask_b, K, max_hw=state.config.max_image_hw,
                                          limits=state.service.limits)
        return state.service.submit(entry.model, request, timeout=state.config.submit_timeout_s), request

    future, request = await state.in_thread(decode_and_submit)
    result = await state.result_of(future)
    _check_finite(result.pose, "register")
    if not state.objects.is_current(entry):
        raise UnknownObjectError(f"object_id: {object_id!r} was deleted while the request ran")
    session = state.sessions.create(object_id=object_id, obj=entry.model, K=request.K, image_hw=request.hw,
                                    cam_from_centred=result.cam_from_centred, pose=result.pose, score=result.score)
    state.metrics.observe_stages("/register", result.timings_ms)
    return RegisterResponse(session_id=session.session_id, object_id=object_id, pose=_pose_json(result.pose),
                            score=float(result.score) if np.isfinite(result.score) else None,
                            timings_ms=result.timings_ms)


@router.post("/track", response_model=TrackResponse, responses=ERROR_RESPONSES,
             summary="Track an object into the next frame", description=_TRACK_DESCRIPTION)
async def track(
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
) -> TrackResponse:
    state.require_ready()
    rgb_b, depth_b = await _read(rgb), await _read(depth)
    if session_id is not None:
        if pose is not None or object_id is not None:
            raise InputError("session_id", "either session_id, or pose and object_id (stateless), not both",
                             "session_id with " + " and ".join(n for n, v in (("pose", pose), ("object_id", object_id)) if v))
        return await _track_session(state, state.sessions.get(session_id), rgb_b, depth_b, K)
    if pose is None or object_id is None:
        raise InputError("session_id", "a session_id, or pose and object_id for stateless tracking",
                         "neither" if pose is None and object_id is None else "only one of pose and object_id")
    return await _track_stateless(state, object_id, pose, rgb_b, depth_b, K)


def _track_request(state: ServerState, rgb_b: bytes, depth_b: bytes, K_text: str | None, prev_pose: np.ndarray,
                   prev_frame: str, session: Session | None) -> validate.TrackRequest:
    """Decode and validate one track request. Without a K the session's is used, for frames of its size only."""
    return decode_track_request(rgb_b, depth_b, K_text, prev_pose, prev_frame,
                                session_K=None if session is None else session.K,
                                session_hw=None if session is None else session.image_hw,
                                max_hw=state.config.max_image_hw, limits=state.service.limits)


async def _track_session(state: ServerState, session: Session, rgb_b: bytes, depth_b: bytes,
                         K_text: str | None) -> TrackResponse:
    async with session.lock:  # FIFO: frames of one session apply in arrival order
        if not state.sessions.is_live(session):
            state.sessions.get(session.session_id)  # raises UnknownSessionError (deleted while we waited)
        start = session.cam_from_centred

        def decode_and_submit():
            request = _track_request(state, rgb_b, depth_b, K_text, start.astype(np.float64), "centred", session)
            return state.service.submit(session.obj, request, key=session.session_id,
                                        timeout=state.config.submit_timeout_s)

        future = await state.in_thread(decode_and_submit)
        result = await state.result_of(future)
        _check_finite(result.pose, "track")
        if not state.sessions.advance(session, cam_from_centred=result.cam_from_centred, pose=result.pose):
            log.info("session %s ended while its track request ran; the result is returned, not stored",
                     session.session_id)
        frame = session.frames
    state.metrics.observe_stages("/track", result.timings_ms)
    return TrackResponse(session_id=session.session_id, object_id=session.object_id, pose=_pose_json(result.pose),
                         frame=frame, timings_ms=result.timings_ms)


async def _track_stateless(state: ServerState, object_id: str, pose_text: str, rgb_b: bytes, depth_b: bytes,
                           K_text: str | None) -> TrackResponse:
    entry = state.objects.get(object_id)
    prev = codecs.parse_pose(pose_text, "pose")

    def decode_and_submit():
        request = _track_request(state, rgb_b, depth_b, K_text, prev, "mesh", None)
        return state.service.submit(entry.model, request, timeout=state.config.submit_timeout_s)

    future = await state.in_thread(decode_and_submit)
    result = await state.result_of(future)
    _check_finite(result.pose, "track")
    state.metrics.observe_stages("/track", result.timings_ms)
    return TrackResponse(session_id=None, object_id=object_id, pose=_pose_json(result.pose), frame=None,
                         timings_ms=result.timings_ms)


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
