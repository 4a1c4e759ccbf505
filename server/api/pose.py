"""``POST /register``, ``POST /track`` (multipart forms and binary bodies) and the session routes.

Each handler turns its request into the flow's typed input (:mod:`server.flow.inputs`) and runs the flow's step
(:mod:`server.flow.steps`) on the app's host: the same handlers serve ``python -m server`` and the Ray Serve
ingress. Images are PNG / JPEG (/.npy depth) or raw pixels with ``*_shape`` / ``depth_dtype`` fields; the binary
bodies are the stream's message container (:mod:`server.flow.message`). Answers carry the host phases in
``timings_ms`` and ``Server-Timing`` (:mod:`server.phases`).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Form, Path, UploadFile
from starlette.requests import Request
from starlette.responses import Response

from server.api.bodies import MultipartRoute, read_binary_body
from server.api.docs import (
    BINARY_BODY_OPENAPI,
    BOX_DOC,
    DEPTH_DOC,
    DEPTH_DTYPE_DOC,
    DEPTH_SHAPE_DOC,
    K_DOC,
    MASK_DOC,
    MASK_SHAPE_DOC,
    REGISTER_BINARY_DESCRIPTION,
    REGISTER_DESCRIPTION,
    RGB_DOC,
    RGB_SHAPE_DOC,
    TRACK_BINARY_DESCRIPTION,
    TRACK_DESCRIPTION,
    TRACK_SESSIONS_DESCRIPTION,
)
from server.api.host import HostDep, phases_of
from server.fields import ID_PATTERN, MAX_SESSIONS_PER_FRAME, SESSION_IDS_PATTERN
from server.flow import inputs, steps
from server.flow.frames import FrameBytes
from server.schemas import (
    POSE_ERRORS,
    READ_ERRORS,
    DeletedSession,
    RegisterResponse,
    SessionInfo,
    SessionsTrackResponse,
    TrackResponse,
)

__all__ = ["router"]

router = APIRouter(tags=["pose"], route_class=MultipartRoute)  # a form route answers 415 to another body


# the form fields of a frame, shared by the routes that take one
RgbFile = Annotated[UploadFile, File(description=RGB_DOC)]
DepthFile = Annotated[UploadFile, File(description=DEPTH_DOC)]
RgbShape = Annotated[str | None, Form(description=RGB_SHAPE_DOC, examples=["480,640,3"])]
DepthShape = Annotated[str | None, Form(description=DEPTH_SHAPE_DOC, examples=["480,640"])]
DepthDtype = Annotated[str | None, Form(description=DEPTH_DTYPE_DOC, examples=["uint16"])]


async def _read(upload: UploadFile | None) -> bytes | None:
    return None if upload is None else await upload.read()


async def _register(host: steps.Host, request: Request, endpoint: str, register: inputs.RegisterInput,
                    read_frame) -> Response:
    phases = phases_of(request)
    session, result = await steps.register(host, endpoint, register.object_id, register.K, phases, read_frame,
                                           session_id=register.session_id, box=register.box)
    body = {"session_id": session.session_id, "object_id": register.object_id, **steps.pose_fields(result),
            "score": result.score}
    return steps.answer_of(host.metrics, endpoint, body, result, phases).response()


@router.post("/register", response_model=RegisterResponse, responses=POSE_ERRORS,
            summary="Register an object in a first frame", description=REGISTER_DESCRIPTION)
async def register(
    request: Request,
    host: HostDep,
    object_id: Annotated[str, Form(description="Id of a loaded object (GET /objects).", examples=["mustard"],
                                   pattern=ID_PATTERN)],
    K: Annotated[str, Form(description=K_DOC, examples=["[[607.06,0,324.5],[0,606.75,237.92],[0,0,1]]"],
                           min_length=1)],
    rgb: RgbFile,
    depth: DepthFile,
    mask: Annotated[UploadFile | None, File(description=MASK_DOC + " Or send a `box` instead.")] = None,
    rgb_shape: RgbShape = None,
    depth_shape: DepthShape = None,
    depth_dtype: DepthDtype = None,
    mask_shape: Annotated[str | None, Form(description=MASK_SHAPE_DOC, examples=["480,640"])] = None,
    session_id: Annotated[str | None, Form(description="Re-register this session (same id, in its order with its "
                                                       "tracks): the client's mask forces a new pose, e.g. for a lost "
                                                       "session. Omit for a new session.", pattern=ID_PATTERN)] = None,
    box: Annotated[str | None, Form(description=BOX_DOC, examples=["210,120,330,260"],
                                    pattern=r"^[0-9]{1,6}(,[0-9]{1,6}){3}$")] = None,
) -> Response:
    parsed = inputs.register_input(object_id, K, box=box, has_mask=mask is not None, session_id=session_id)

    async def frame() -> FrameBytes:  # read once admitted: a refused register reads nothing more
        return FrameBytes(await _read(rgb), await _read(depth), await _read(mask), rgb_shape=rgb_shape,
                          depth_shape=depth_shape, depth_dtype=depth_dtype, mask_shape=mask_shape)

    return await _register(host, request, "/register", parsed, frame)


@router.post("/register/binary", response_model=RegisterResponse, responses=POSE_ERRORS,
             summary="Register an object in a first frame (one binary body)", description=REGISTER_BINARY_DESCRIPTION,
             openapi_extra=BINARY_BODY_OPENAPI)
async def register_binary(request: Request, host: HostDep) -> Response:
    parsed = inputs.register_of_body(await read_binary_body(request, "/register"))

    async def frame() -> FrameBytes:
        return parsed.frame

    return await _register(host, request, "/register/binary", parsed, frame)


@router.post("/track", response_model=TrackResponse, responses=POSE_ERRORS,
            summary="Track an object into the next frame", description=TRACK_DESCRIPTION)
async def track(
    request: Request,
    host: HostDep,
    rgb: RgbFile,
    depth: DepthFile,
    session_id: Annotated[str | None, Form(description="Session from POST /register. Excludes `pose` and "
                                                       "`object_id`.", pattern=ID_PATTERN)] = None,
    K: Annotated[str | None, Form(description=K_DOC + " Optional with a session_id (required when the frame "
                                                       "size differs from the session's); required without.",
                                  min_length=1)] = None,
    pose: Annotated[str | None, Form(description="Stateless (without session_id): previous pose, JSON 4x4 "
                                                 "cam_from_mesh, metres.", min_length=1)] = None,
    object_id: Annotated[str | None, Form(description="Stateless (without session_id): the object's id.",
                                          pattern=ID_PATTERN)] = None,
    rgb_shape: RgbShape = None,
    depth_shape: DepthShape = None,
    depth_dtype: DepthDtype = None,
) -> Response:
    frame = FrameBytes(await _read(rgb), await _read(depth), rgb_shape=rgb_shape, depth_shape=depth_shape,
                       depth_dtype=depth_dtype)
    parsed = inputs.track_input(frame, session_id=session_id, object_id=object_id, K=K, pose=pose)
    return await _track(host, request, "/track", parsed)


@router.post("/track/binary", response_model=TrackResponse, responses=POSE_ERRORS,
             summary="Track an object into the next frame (one binary body)", description=TRACK_BINARY_DESCRIPTION,
             openapi_extra=BINARY_BODY_OPENAPI)
async def track_binary(request: Request, host: HostDep) -> Response:
    parsed = inputs.track_of_body(await read_binary_body(request))
    return await _track(host, request, "/track/binary", parsed)


async def _track(host: steps.Host, request: Request, endpoint: str, parsed: inputs.TrackInput) -> Response:
    phases = phases_of(request)  # after the body: receive = its first to last byte
    phases.lap("parse")
    body, result = await steps.track(host, endpoint, parsed, phases)
    return steps.answer_of(host.metrics, endpoint, body, result, phases).response()


@router.post("/track/sessions", response_model=SessionsTrackResponse, responses=POSE_ERRORS,
             summary="Track several sessions (objects) into one frame", description=TRACK_SESSIONS_DESCRIPTION)
async def track_sessions(
    request: Request,
    host: HostDep,
    rgb: RgbFile,
    depth: DepthFile,
    session_ids: Annotated[str, Form(description="The sessions to track into this frame: 1 to "
                                                 f"{MAX_SESSIONS_PER_FRAME} distinct ids from POST /register, "
                                                 "comma-separated; the answer lists them in this order.",
                                     examples=["kq3N0c2mXq5b8tY1Zr7xVw,Pq0Lm2nXc8bV5tY1Zr7xAa"],
                                     pattern=SESSION_IDS_PATTERN)],
    K: Annotated[str | None, Form(description=K_DOC + " Optional: for this frame, for every session (default: "
                                                       "each session's own).", min_length=1)] = None,
    rgb_shape: RgbShape = None,
    depth_shape: DepthShape = None,
    depth_dtype: DepthDtype = None,
) -> Response:
    frame = FrameBytes(await _read(rgb), await _read(depth), rgb_shape=rgb_shape, depth_shape=depth_shape,
                       depth_dtype=depth_dtype)
    parsed = inputs.sessions_track_input(frame, session_ids=session_ids, K=K)
    phases = phases_of(request)
    phases.lap("parse")
    body, _ = await steps.track_sessions(host, "/track/sessions", parsed, phases)
    return steps.answer_of(host.metrics, "/track/sessions", body, None, phases).response()


SessionIdPath = Annotated[str, Path(description="Session from POST /register.", pattern=ID_PATTERN)]


@router.get("/sessions/{session_id}", response_model=SessionInfo, responses=READ_ERRORS,
            summary="Read a tracking session (also refreshes its idle timer)")
async def get_session(host: HostDep, session_id: SessionIdPath) -> SessionInfo:
    host.require_ready()
    sessions = host.sessions
    stored = sessions.peek(session_id)
    idle = sessions.clock() - stored.last_used_s if stored is not None else 0.0
    session = sessions.get(session_id)  # expires it now if it is past its ttl
    return SessionInfo(session_id=session.session_id, object_id=session.object_id,
                       pose=steps.pose_json(session.pose), K=session.K.tolist(), score=session.score,
                       frames=session.frames, state=session.trust.state.state.value, idle_s=max(0.0, idle),
                       ttl_s=sessions.ttl_s)


@router.delete("/sessions/{session_id}", response_model=DeletedSession, responses=READ_ERRORS,
               summary="End a tracking session")
async def delete_session(host: HostDep, session_id: SessionIdPath) -> DeletedSession:
    host.require_ready()
    host.sessions.delete(session_id)
    return DeletedSession(session_id=session_id)

