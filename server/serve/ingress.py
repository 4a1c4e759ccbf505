"""The ingress: the HTTP API of ``python -m server`` on Serve's FastAPI ingress, in front of the pose replicas.

What it does itself: authentication, body limits, request ids and HTTP metrics (the same middlewares
as the single-process server), the object registry (on CPU: it lists objects and stores uploads in
the shared directory, with the same limits; replicas reload changed objects lazily), the tracking
sessions with the same track admission (429 / 503), and the WS ``/track/stream`` connections
(:mod:`server.serve.stream`: each frame goes to a replica like a session's ``/track``).

Sessions live here, in one :class:`~server.sessions.SessionStore`: object id, the last pose in the
centred frame (float32), K, image size and frame count. A track call carries that state to the
replica, so any replica can serve any session's next frame; the ingress applies the answer only to
the frame it was computed for (frames of one session run one at a time under the session's lock), so
a call retried after a replica died is idempotent. A session's call names the replica that served its
last frame, which the pose deployment's router (:mod:`server.serve.routing`) prefers while it is alive
and not full; registers go by Serve's power-of-two choices to the less loaded of two replicas.

Failure and overload: a replica that dies mid-call (``ActorDiedError``) is retried on another replica
up to ``retry_attempts`` times; when the pose deployment's queue is full (``max_queued_requests``)
Serve raises ``BackPressureError``, answered 503 + Retry-After like the single-process BusyError.
One ingress replica holds the sessions (it is light: it parses forms and awaits replies).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Annotated

import anyio
import numpy as np
from fastapi import FastAPI, File, Form, Path, Request, Response, UploadFile, WebSocket
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi_offline import FastAPIOffline
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deploy_core.errors import BusyError
from foundationpose.errors import InputError, UnknownObjectError
from server import codecs
from server.admission import ServiceTimes, TrackAdmission
from server.auth import DOCS_ASSETS_PREFIX, AuthMiddleware
from server.errors import (
    ErrorInfo,
    ForwardedError,
    NotReadyError,
    RequestTimeoutError,
    install_error_handlers,
    request_id_of,
)
from server.fields import ID_PATTERN
from server.limits import register_cost_budget
from server.metrics import CONTENT_TYPE, Family, Metrics, StreamCounters
from server.middleware import BodyLimitMiddleware, RequestContextMiddleware
from server.objects import OBJECT_ID_PATTERN, ObjectEntry, ObjectRegistry
from server.phases import Phases, ReceiveTimingMiddleware
from server.pose_flow import FrameBytes, admit, answer, pose_json
from server.routes_objects import UPLOAD_DESCRIPTION, store_object
from server.routes_pose import (
    DEPTH_DOC,
    DEPTH_DTYPE_DOC,
    DEPTH_SHAPE_DOC,
    K_DOC,
    MASK_DOC,
    MASK_SHAPE_DOC,
    REGISTER_BINARY_DESCRIPTION,
    RGB_DOC,
    RGB_SHAPE_DOC,
    TRACK_BINARY_DESCRIPTION,
    TRACK_BINARY_OPENAPI,
    parse_binary_register,
    parse_binary_track,
    read_binary_body,
)
from server.routes_stream import ENDPOINT as STREAM_ENDPOINT
from server.routes_stream import run_stream
from server.schemas import (
    ERROR_RESPONSES,
    DeletedObject,
    DeletedSession,
    HealthBody,
    ObjectInfo,
    ObjectList,
    ReadyBody,
    RegisterResponse,
    SessionInfo,
    TrackResponse,
)
from server.serve.calls import ObjectRef, PoseReply, RegisterCall, TrackCall, object_ref
from server.serve.metrics_board import board_handle, labelled
from server.serve.settings import ServeSettings
from server.serve.stream import ServeStream
from server.sessions import Session, SessionStore

__all__ = ["PoseIngress", "SERVED_BY_HEADER"]

log = logging.getLogger(__name__)

SERVED_BY_HEADER = "X-Served-By"  # the pose replica that computed the answer
POSE_DEPLOYMENT = "PoseReplica"
FULL_GRID = 252  # register hypotheses without --hypotheses (foundationpose.sampling.rotation_grid, no symmetry)
_LOST = (RayActorError, ReplicaUnavailableError)  # ActorDiedError and ActorUnavailableError are RayActorErrors


class PoseIngress:
    """A Serve deployment class (wrapped by :func:`server.serve.app.build_app`); routes in :func:`build_api`."""

    async def __init__(self, pose: DeploymentHandle, settings: ServeSettings) -> None:
        cfg = settings.server
        self.settings = settings
        self.config = cfg
        self.pose = pose
        self.metrics = Metrics()
        self.sessions = SessionStore(ttl_s=cfg.session_ttl_s, max_sessions=cfg.max_sessions)
        budget = cfg.object_limits.max_register_cost
        if budget is None:  # what the replicas' device renders in half the request timeout
            budget = register_cost_budget("cuda" if settings.num_gpus > 0 else "cpu", cfg.request_timeout_s)
        self.objects = ObjectRegistry(
            cfg.objects_dir, device="cpu", limits=cfg.object_limits, max_register_cost=budget,
            register_shape=(cfg.estimator.num_hypotheses or FULL_GRID, cfg.estimator.register_iterations))
        await anyio.to_thread.run_sync(self.objects.load_all)
        # the version of each object's files when this process loaded them (what replicas must have)
        self.versions = {e.object_id: object_ref(self.objects.root, e) for e in self.objects.entries()}
        # track admission as in the single-process server (one running + session_waiting per session, 429;
        # track_capacity per replica in total, 503), with Retry-After from the replicas' measured times
        self.service_times = ServiceTimes(fallback_ms=cfg.retry_after_s * 1e3)
        self.admission = TrackAdmission(
            capacity=cfg.track_capacity * settings.replicas, session_waiting=cfg.session_waiting,
            parallel=settings.replicas * cfg.service.track_max_batch * cfg.service.track_batches_in_flight,
            times=self.service_times,
            latency_budget_ms=cfg.track_latency_budget_ms)
        self.streams = StreamCounters()  # WS /track/stream connections (server.serve.stream)
        self.retries_total = 0
        self.backpressure_total = 0
        self.lost_total = 0
        self.phase = "ready"
        self._sweeper = asyncio.create_task(self.sessions.sweep_every(cfg.sweep_interval_s), name="fp-session-sweep")

    def ref(self, entry: ObjectEntry) -> ObjectRef:
        """The reference replicas get for ``entry`` (its files' version when the ingress loaded it)."""
        return self.versions.get(entry.object_id) or object_ref(self.objects.root, entry)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_api(self)

    async def __del__(self) -> None:
        self.phase = "stopping"
        self._sweeper.cancel()
        await asyncio.gather(self._sweeper, return_exceptions=True)

    # -- calls to the pose replicas ----------------------------------------------------------------
    async def call_pose(self, method: str, call: RegisterCall | TrackCall, phases: Phases) -> PoseReply:
        """One call to a pose replica, retried on another replica when the serving one dies mid-call.

        Books the replica's host phases in ``phases``, and the rest of the call as ``serve_hop``.
        """
        handle = self.pose
        attempts = self.settings.retry_attempts
        for attempt in range(1, attempts + 1):
            try:
                # the replica bounds its own wait (request_timeout_s, then 504); this bounds a replica that hangs
                reply = await asyncio.wait_for(getattr(handle, method).remote(call), self.config.request_timeout_s + 5.0)
            except asyncio.TimeoutError as exc:
                raise RequestTimeoutError(f"no answer from a pose replica within {self.config.request_timeout_s:g} s") from exc
            except BackPressureError as exc:
                self.backpressure_total += 1
                raise BusyError(str(exc)) from exc
            except DeploymentUnavailableError as exc:
                raise NotReadyError(f"the pose replicas are unavailable: {exc.message}") from exc
            except _LOST as exc:
                log.warning("%s: pose replica lost mid-call (try %d of %d): %s", method, attempt, attempts,
                            type(exc).__name__)
                if attempt < attempts:
                    self.retries_total += 1
                else:
                    self.lost_total += 1
                    raise NotReadyError(f"{method}: {attempts} tries each hit a pose replica that died; "
                                        "retry when Serve has replaced it") from exc
                continue
            call_ms = phases.lap("serve_hop")
            if isinstance(reply, ErrorInfo):
                raise ForwardedError(reply)
            inner_ms = sum(ms for name, ms in reply.phases_ms.items() if name != "batcher_wait")  # inside pipeline
            phases.ms["serve_hop"] = max(0.0, call_ms - inner_ms)
            for name, ms in reply.phases_ms.items():
                phases.add(name, ms)
            if "pipeline" in reply.phases_ms:
                self.service_times.observe(method, reply.phases_ms["pipeline"])  # the Retry-After estimates
            return reply
        raise AssertionError("unreachable")

    # -- the session steps of HTTP and the stream ------------------------------------------------------
    async def register_session(self, entry: ObjectEntry, frame: FrameBytes, K_text: str | None,
                               phases: Phases) -> tuple[Session, PoseReply]:
        """Register on a pose replica and create the session (its id is drawn first: the router sees it)."""
        session_id = self.sessions.new_id()
        call = RegisterCall(self.ref(entry), frame, K_text, session_id=session_id, request_id=phases.request_id)
        reply = await self.call_pose("register", call, phases)
        if not self.objects.is_current(entry):
            raise UnknownObjectError(f"object_id: {entry.object_id!r} was deleted while the request ran")
        session = self.sessions.create(object_id=entry.object_id, obj=entry.model, K=reply.K, image_hw=reply.image_hw,
                                       cam_from_centred=reply.cam_from_centred, pose=reply.cam_from_mesh,
                                       score=np.nan if reply.score is None else reply.score, session_id=session_id)
        session.replica = reply.replica
        return session, reply

    async def track_session(self, session: Session, frame: FrameBytes, K_text: str | None, phases: Phases,
                            endpoint: str) -> tuple[PoseReply, int]:
        """One track step of a session on a pose replica: (reply, the session's frame count it answers)."""
        sessions = self.sessions
        with admit(self, endpoint, session.session_id):  # one running + session_waiting waiting, else 429
            async with session.lock:  # FIFO: frames of one session apply in arrival order
                phases.lap("queue")
                if not sessions.is_live(session):
                    sessions.get(session.session_id)  # raises UnknownSessionError (deleted while we waited)
                entry = self.objects.get(session.object_id)
                frame_no = session.frames + 1
                call = TrackCall(self.ref(entry), frame, K_text, session.cam_from_centred.astype(np.float64),
                                 "centred", session_K=session.K, session_hw=session.image_hw,
                                 session_id=session.session_id, frame_no=frame_no, prefer_replica=session.replica,
                                 request_id=phases.request_id)
                reply = await self.call_pose("track", call, phases)
                if reply.frame_no != frame_no:
                    raise AssertionError(f"replica answered frame {reply.frame_no} for frame {frame_no}")
                if session.frames == frame_no - 1 and sessions.advance(
                        session, cam_from_centred=reply.cam_from_centred, pose=reply.cam_from_mesh,
                        image_hw=reply.image_hw):
                    session.replica = reply.replica
                else:
                    log.info("session %s ended while its track request ran; the result is returned, not stored",
                             session.session_id)
                return reply, session.frames if sessions.is_live(session) else frame_no

    # -- readiness and metrics -----------------------------------------------------------------------
    async def pose_replicas_running(self) -> int:
        """Pose replicas Serve reports RUNNING (asked in a thread: ``serve.status`` blocks)."""
        def running() -> int:
            app = serve.status().applications.get(self.settings.app_name)
            deployment = app.deployments.get(POSE_DEPLOYMENT) if app is not None else None
            return int(deployment.replica_states.get("RUNNING", 0)) if deployment is not None else 0

        return await anyio.to_thread.run_sync(running)

    async def replica_families(self) -> list[Family]:
        """Every pose replica's latest metric families, labelled by replica (stale ones dropped)."""
        board = await anyio.to_thread.run_sync(board_handle, self.settings.app_name)
        snapshots = await board.snapshots.remote(3 * self.settings.metrics_interval_s + 1.0)
        fams = labelled(snapshots)
        fams.append(Family("fp_serve_replicas_reporting", "gauge", "Pose replicas whose metrics are fresh.")
                    .add(len(snapshots)))
        return fams

    def ingress_families(self) -> list[Family]:
        return [
            Family("fp_ready", "gauge", "1 while the ingress is ready.").add(self.phase == "ready"),
            Family("fp_sessions_active", "gauge", "Live tracking sessions.").add(len(self.sessions)),
            Family("fp_sessions_busy", "gauge", "Sessions with a request in progress.").add(self.sessions.busy_count()),
            Family("fp_sessions_created_total", "counter", "Sessions created.").add(self.sessions.created_total),
            Family("fp_sessions_expired_total", "counter", "Sessions expired after idling.")
            .add(self.sessions.expired_total),
            Family("fp_sessions_evicted_total", "counter", "Idle sessions evicted at the session cap.")
            .add(self.sessions.evicted_total),
            Family("fp_objects_loaded", "gauge", "Registered objects.").add(len(self.objects)),
            Family("fp_serve_retries_total", "counter", "Pose calls retried because their replica died mid-call.")
            .add(self.retries_total),
            Family("fp_serve_replica_lost_total", "counter", "Pose calls that failed on every try (503).")
            .add(self.lost_total),
            Family("fp_serve_backpressure_total", "counter",
                   "Pose calls refused because the replicas' queue was full (503).").add(self.backpressure_total),
        ]


class _LeaveRequestIdToProxy:
    """Drop ``X-Request-ID`` from answers: Serve's proxy adds it to every answer itself (the same id: it hands
    the request's id to the app, which the request-context middleware adopts), so it would appear twice."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_once(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"x-request-id"]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_once if scope["type"] == "http" else send)


ObjectIdPath = Annotated[str, Path(description="Id of a loaded object.", pattern=ID_PATTERN)]
SessionIdPath = Annotated[str, Path(description="Session from POST /register.", pattern=ID_PATTERN)]


def _phases(request: Request) -> Phases:
    return Phases.for_request(request.scope, request_id_of(request))


def _answer(ingress: PoseIngress, endpoint: str, body: dict, reply: PoseReply, phases: Phases) -> Response:
    """The JSON answer, as the single-process server's (:func:`server.pose_flow.answer`), naming the replica."""
    response = answer(ingress.metrics, endpoint, body, reply.timings_ms, phases)
    response.headers[SERVED_BY_HEADER] = reply.replica
    return response


def build_api(ingress: PoseIngress) -> FastAPI:
    """The FastAPI app of one ingress replica (built in the replica: it closes over the live ``ingress``)."""
    cfg = ingress.config
    # Swagger UI / ReDoc assets served by the ingress itself (fastapi-offline), never from a CDN
    api = FastAPIOffline(title="FoundationPose service (Ray Serve)", version="0.1.0",
                         description="The API of `python -m server`, scaled out over Ray Serve replicas. "
                                     f"Pose answers name the replica that computed them in `{SERVED_BY_HEADER}`.",
                         static_url=DOCS_ASSETS_PREFIX.rstrip("/"), swagger_ui_parameters={"persistAuthorization": True})
    install_error_handlers(api, retry_after_s=cfg.retry_after_s)
    _add_ops_routes(api, ingress)
    _add_object_routes(api, ingress)
    _add_pose_routes(api, ingress)
    _add_stream_route(api, ingress)
    templates = tuple((r.path_regex, r.path) for r in api.routes if hasattr(r, "path_regex"))
    # add_middleware wraps outermost last: header filter -> request context -> auth -> body limit
    # -> receive timing -> routes
    api.add_middleware(ReceiveTimingMiddleware)
    api.add_middleware(BodyLimitMiddleware, max_bytes=cfg.max_upload_bytes)
    api.add_middleware(AuthMiddleware, api_key=cfg.api_key)
    api.add_middleware(RequestContextMiddleware, metrics=ingress.metrics, retry_after_s=cfg.retry_after_s,
                       templates=templates)
    api.add_middleware(_LeaveRequestIdToProxy)
    return api


def _add_stream_route(api: FastAPI, ingress: PoseIngress) -> None:
    @api.websocket(STREAM_ENDPOINT)
    async def track_stream(websocket: WebSocket) -> None:
        await websocket.accept()
        await run_stream(ServeStream(ingress, websocket, secrets.token_hex(4)))


def _add_ops_routes(api: FastAPI, ingress: PoseIngress) -> None:
    @api.get("/healthz", response_model=HealthBody, summary="Liveness of the ingress (no API key needed)")
    async def healthz() -> JSONResponse:
        return JSONResponse(HealthBody(status="ok", phase=ingress.phase).model_dump())

    @api.get("/readyz", response_model=ReadyBody, responses={503: {"model": ReadyBody}},
             summary="Readiness: objects loaded and at least one pose replica running")
    async def readyz() -> JSONResponse:
        running = await ingress.pose_replicas_running()
        ready = ingress.phase == "ready" and running > 0
        described: dict = {}
        if ready:
            try:
                described = await asyncio.wait_for(ingress.pose.describe.remote(), ingress.config.request_timeout_s)
            except Exception as exc:  # a replica that just died: not ready for this probe
                ready, described = False, {"reason": f"describe failed: {type(exc).__name__}"}
        reason = None if ready else described.get("reason", f"{running} pose replicas running")
        body = ReadyBody(ready=ready, phase=ingress.phase, reason=reason, device=described.get("device"),
                         objects=len(ingress.objects), random_weights=described.get("random_weights"))
        headers = {} if ready else {"Retry-After": str(ingress.config.retry_after_s)}
        return JSONResponse(body.model_dump(), status_code=200 if ready else 503, headers=headers)

    @api.get("/metrics", response_class=PlainTextResponse,
             summary="Prometheus metrics of the ingress and of every pose replica (label `replica`)")
    async def metrics() -> PlainTextResponse:
        extra = ingress.ingress_families() + await ingress.replica_families()
        return PlainTextResponse(ingress.metrics.render(extra), media_type=CONTENT_TYPE)


def _add_object_routes(api: FastAPI, ingress: PoseIngress) -> None:
    registry = ingress.objects

    @api.post("/objects", status_code=201, response_model=ObjectInfo, responses=ERROR_RESPONSES,
              summary="Upload an object mesh (stored in the shared objects directory)", description=UPLOAD_DESCRIPTION)
    async def upload_object(
        object_id: Annotated[str, Form(description=f"New object's id, {OBJECT_ID_PATTERN}.", pattern=ID_PATTERN)],
        mesh: Annotated[UploadFile, File(description="OBJ, PLY or GLB mesh in metres.")],
        texture: Annotated[UploadFile | None, File(description="Optional PNG/JPEG texture for the mesh's UVs.")] = None,
        simplify: Annotated[bool, Form(description="Decimate a mesh above the face limit to it instead of "
                                                   "answering 413.")] = False,
    ) -> ObjectInfo:
        entry = await store_object(registry, object_id, mesh, texture, simplify)
        ingress.versions[object_id] = object_ref(registry.root, entry)
        return ObjectInfo(**entry.info())

    @api.get("/objects", response_model=ObjectList, responses=ERROR_RESPONSES, summary="List the loaded objects")
    async def list_objects() -> ObjectList:
        return ObjectList(objects=[ObjectInfo(**e.info()) for e in registry.entries()])

    @api.get("/objects/{object_id}", response_model=ObjectInfo, responses=ERROR_RESPONSES, summary="Describe one object")
    async def get_object(object_id: ObjectIdPath) -> ObjectInfo:
        return ObjectInfo(**registry.get(object_id).info())

    @api.delete("/objects/{object_id}", response_model=DeletedObject, responses=ERROR_RESPONSES,
                summary="Delete an object, its files and its tracking sessions")
    async def delete_object(object_id: ObjectIdPath) -> DeletedObject:
        entry = registry.remove(object_id)
        ingress.versions.pop(object_id, None)
        ended = ingress.sessions.delete_object(object_id)
        await anyio.to_thread.run_sync(registry.delete_files, entry)
        return DeletedObject(object_id=object_id, sessions_ended=ended)


def _add_pose_routes(api: FastAPI, ingress: PoseIngress) -> None:
    registry, sessions = ingress.objects, ingress.sessions

    @api.post("/register", response_model=RegisterResponse, responses=ERROR_RESPONSES,
              summary="Register an object in a first frame (on the less loaded of two pose replicas)")
    async def register(
        request: Request,
        object_id: Annotated[str, Form(description="Id of a loaded object (GET /objects).", pattern=ID_PATTERN)],
        K: Annotated[str, Form(description=K_DOC)],
        rgb: Annotated[UploadFile, File(description=RGB_DOC)],
        depth: Annotated[UploadFile, File(description=DEPTH_DOC)],
        mask: Annotated[UploadFile, File(description=MASK_DOC)],
        rgb_shape: Annotated[str | None, Form(description=RGB_SHAPE_DOC)] = None,
        depth_shape: Annotated[str | None, Form(description=DEPTH_SHAPE_DOC)] = None,
        depth_dtype: Annotated[str | None, Form(description=DEPTH_DTYPE_DOC)] = None,
        mask_shape: Annotated[str | None, Form(description=MASK_SHAPE_DOC)] = None,
    ) -> Response:
        phases = _phases(request)
        entry = registry.get(object_id)
        frame = FrameBytes(await rgb.read(), await depth.read(), await mask.read(), rgb_shape=rgb_shape,
                           depth_shape=depth_shape, depth_dtype=depth_dtype, mask_shape=mask_shape)
        phases.lap("parse")
        return await _register(phases, "/register", entry, frame, K)

    @api.post("/register/binary", response_model=RegisterResponse, responses=ERROR_RESPONSES,
              summary="Register an object in a first frame (one binary body; as POST /register)",
              description=REGISTER_BINARY_DESCRIPTION, openapi_extra=TRACK_BINARY_OPENAPI)
    async def register_binary(request: Request) -> Response:
        data = await read_binary_body(request, "/register")
        phases = _phases(request)  # after the body: receive = its first to last byte
        reg = parse_binary_register(data)
        entry = registry.get(reg.object_id)
        phases.lap("parse")
        return await _register(phases, "/register/binary", entry, reg.frame, reg.K_text)

    async def _register(phases: Phases, endpoint: str, entry: ObjectEntry, frame: FrameBytes, K_text: str) -> Response:
        session, reply = await ingress.register_session(entry, frame, K_text, phases)
        body = {"session_id": session.session_id, "object_id": entry.object_id, "pose": pose_json(reply.cam_from_mesh),
                "score": reply.score}
        return _answer(ingress, endpoint, body, reply, phases)

    @api.post("/track", response_model=TrackResponse, responses=ERROR_RESPONSES,
              summary="Track an object into the next frame (preferably on the replica of the session's last frame)")
    async def track(
        request: Request,
        rgb: Annotated[UploadFile, File(description=RGB_DOC)],
        depth: Annotated[UploadFile, File(description=DEPTH_DOC)],
        session_id: Annotated[str | None, Form(description="Session from POST /register.", pattern=ID_PATTERN)] = None,
        K: Annotated[str | None, Form(description=K_DOC + " Optional with a session_id.")] = None,
        pose: Annotated[str | None, Form(description="Stateless: previous pose, JSON 4x4 cam_from_mesh.")] = None,
        object_id: Annotated[str | None, Form(description="Stateless: the object's id.", pattern=ID_PATTERN)] = None,
        rgb_shape: Annotated[str | None, Form(description=RGB_SHAPE_DOC)] = None,
        depth_shape: Annotated[str | None, Form(description=DEPTH_SHAPE_DOC)] = None,
        depth_dtype: Annotated[str | None, Form(description=DEPTH_DTYPE_DOC)] = None,
    ) -> Response:
        phases = _phases(request)
        frame = FrameBytes(await rgb.read(), await depth.read(), rgb_shape=rgb_shape, depth_shape=depth_shape,
                           depth_dtype=depth_dtype)
        phases.lap("parse")
        return await _track(phases, "/track", frame, session_id=session_id, K_text=K, pose_text=pose,
                            object_id=object_id)

    @api.post("/track/binary", response_model=TrackResponse, responses=ERROR_RESPONSES,
              summary="Track an object into the next frame (one binary body; as POST /track)",
              description=TRACK_BINARY_DESCRIPTION, openapi_extra=TRACK_BINARY_OPENAPI)
    async def track_binary(request: Request) -> Response:
        data = await read_binary_body(request)
        phases = _phases(request)  # after the body: receive = its first to last byte
        track = parse_binary_track(data)
        phases.lap("parse")
        return await _track(phases, "/track/binary", track.frame, session_id=track.session_id, K_text=track.K_text,
                            pose_text=track.pose_text, object_id=track.object_id)

    async def _track(phases: Phases, endpoint: str, frame: FrameBytes, *, session_id: str | None, K_text: str | None,
                     pose_text: str | None, object_id: str | None) -> Response:
        """A track of either form (multipart or binary body): on the session's replica, or stateless."""
        if session_id is not None:
            if pose_text is not None or object_id is not None:
                given = " and ".join(n for n, v in (("pose", pose_text), ("object_id", object_id)) if v)
                raise InputError("session_id", "either session_id, or pose and object_id (stateless), not both",
                                 "session_id with " + given)
            session = sessions.get(session_id)
            reply, answered = await ingress.track_session(session, frame, K_text, phases, endpoint)
            body = {"session_id": session.session_id, "object_id": session.object_id,
                    "pose": pose_json(reply.cam_from_mesh), "frame": answered}
            return _answer(ingress, endpoint, body, reply, phases)
        if pose_text is None or object_id is None:
            raise InputError("session_id", "a session_id, or pose and object_id for stateless tracking",
                             "neither" if pose_text is None and object_id is None else "only one of pose and object_id")
        entry = registry.get(object_id)
        prev = codecs.parse_pose(pose_text, "pose")
        call = TrackCall(ingress.ref(entry), frame, K_text, prev, "mesh", request_id=phases.request_id)
        with admit(ingress, endpoint, None):
            phases.lap("queue")
            reply = await ingress.call_pose("track", call, phases)
        body = {"session_id": None, "object_id": object_id, "pose": pose_json(reply.cam_from_mesh), "frame": None}
        return _answer(ingress, endpoint, body, reply, phases)

    @api.get("/sessions/{session_id}", response_model=SessionInfo, responses=ERROR_RESPONSES,
             summary="Read a tracking session (also refreshes its idle timer)")
    async def get_session(session_id: SessionIdPath) -> SessionInfo:
        stored = sessions.peek(session_id)
        idle = sessions.clock() - stored.last_used_s if stored is not None else 0.0
        session = sessions.get(session_id)
        return SessionInfo(session_id=session.session_id, object_id=session.object_id, pose=pose_json(session.pose),
                           K=session.K.tolist(), score=session.score, frames=session.frames, idle_s=max(0.0, idle),
                           ttl_s=sessions.ttl_s)

    @api.delete("/sessions/{session_id}", response_model=DeletedSession, responses=ERROR_RESPONSES,
                summary="End a tracking session")
    async def delete_session(session_id: SessionIdPath) -> DeletedSession:
        sessions.delete(session_id)
        return DeletedSession(session_id=session_id)
