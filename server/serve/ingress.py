"""The ingress: the HTTP API of ``python -m server`` (the same routes, :mod:`server.api`) on Serve's FastAPI
ingress, in front of the pose replicas.

The ingress is the API's :class:`~server.flow.steps.Host`: authentication, body limits, request ids and HTTP
metrics (the same middlewares as the single-process server), the object registry (on CPU: it lists objects and
stores uploads in the shared directory, with the same limits; replicas reload changed objects lazily), the
tracking sessions with the same track admission (429 / 503), and the WS ``/track/stream`` connections. Its backend
(:class:`~server.serve.backend.ServeBackend`) sends each register and track step to a pose replica.

Sessions live here, in one :class:`~server.sessions.SessionStore`: object id, the last pose in the centred frame
(float32), K, image size and frame count. A track call carries that state to the replica, so any replica can serve
any session's next frame; the flow applies the answer only to the frame it was computed for (frames of one session
run one at a time under the session's lock), so a call retried after a replica died is idempotent. A session's
call names the replica that served its last frame, which the pose deployment's router (:mod:`server.serve.routing`)
prefers while it is alive and not full; registers go by Serve's power-of-two choices to the less loaded of two
replicas. One ingress replica holds the sessions (it is light: it parses requests and awaits replies).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import anyio
from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.admission import ServiceTimes, Ticket, TrackAdmission, admit_track
from server.api.app import build_api
from server.errors import ConflictError, NotReadyError
from server.flow.steps import SERVED_BY_HEADER
from server.limits import register_cost_budget
from server.metrics import Family, Metrics, StreamCounters
from server.objects import ObjectEntry, ObjectRegistry
from server.schemas import HealthBody, ReadyBody
from server.serve.backend import ServeBackend
from server.serve.calls import ObjectRef, object_ref
from server.serve.metrics_board import board_handle, labelled
from server.serve.settings import ServeSettings
from server.sessions import SessionStore

__all__ = ["POSE_DEPLOYMENT", "SERVED_BY_HEADER", "PoseIngress"]

log = logging.getLogger(__name__)

POSE_DEPLOYMENT = "PoseReplica"
FULL_GRID = 252  # register hypotheses without --hypotheses (foundationpose.sampling.rotation_grid, no symmetry)
DESCRIPTION = ("The API of `python -m server`, scaled out over Ray Serve replicas. Pose answers name the replica that "
               f"computed them in `{SERVED_BY_HEADER}`.")


class PoseIngress:
    """A Serve deployment class (wrapped by :func:`server.serve.app.build_app`); its app is :func:`build_api`'s."""

    async def __init__(self, pose: DeploymentHandle, settings: ServeSettings) -> None:
        cfg = settings.server
        self.settings = settings
        self.config = cfg
        self.pose = pose
        self.metrics = Metrics()
        self.sessions = SessionStore(ttl_s=cfg.session_ttl_s, max_sessions=cfg.max_sessions,
                                     recovery=cfg.recovery_config)
        budget = cfg.max_register_cost
        if budget is None:  # what the replicas' device renders in half the request timeout
            budget = register_cost_budget("cuda" if settings.num_gpus > 0 else "cpu", cfg.request_timeout_s)
        self.objects = ObjectRegistry(cfg.objects_dir, device="cpu", limits=cfg.object_limits,
                                      max_register_cost=budget,
                                      register_shape=(cfg.hypotheses or FULL_GRID, cfg.iterations))
        await anyio.to_thread.run_sync(self.objects.load_all)
        # the version of each object's files when this process loaded them (what replicas must have)
        self.versions = {e.object_id: object_ref(self.objects.root, e) for e in self.objects.entries()}
        # track admission as in the single-process server (one running + session_waiting per session, 429;
        # track_capacity per replica in total, 503), with Retry-After from the replicas' measured times
        self.service_times = ServiceTimes(fallback_ms=cfg.retry_after_s * 1e3)
        self.admission = TrackAdmission(
            capacity=cfg.track_capacity * settings.replicas, session_waiting=cfg.session_waiting,
            parallel=settings.replicas * cfg.track_max_batch * cfg.service.track_batches_in_flight,
            times=self.service_times, latency_budget_ms=cfg.track_latency_budget_ms)
        self.streams = StreamCounters()  # WS /track/stream connections
        self.backend = ServeBackend(self)
        self.retries_total = 0
        self.backpressure_total = 0
        self.lost_total = 0
        self.phase = "ready"
        self._sweeper = asyncio.create_task(self.sessions.sweep_every(), name="fp-session-sweep")

    def ref(self, entry: ObjectEntry) -> ObjectRef:
        """The reference replicas get for ``entry`` (its files' version when the ingress loaded it)."""
        return self.versions.get(entry.object_id) or object_ref(self.objects.root, entry)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_api(self, title="FoundationPose service (Ray Serve)", description=DESCRIPTION,
                         outer=[Middleware(_LeaveRequestIdToProxy)])

    async def __del__(self) -> None:
        self.phase = "stopping"
        self._sweeper.cancel()
        await asyncio.gather(self._sweeper, return_exceptions=True)

    # -- the host of the routes --------------------------------------------------------------------------------------
    def require_ready(self) -> None:
        if self.phase != "ready":
            raise NotReadyError(f"the ingress is not ready: {self.phase}")

    def admit_register(self, endpoint: str) -> contextlib.nullcontext:
        """Registers are admitted by the replicas (their register lanes; a full queue is Serve's backpressure)."""
        return contextlib.nullcontext()

    def admit_track(self, endpoint: str, key: str | None) -> Ticket:
        """A track admission ticket, or the refusal (counted in ``fp_requests_shed_total``)."""
        return admit_track(self.admission, key, metrics=self.metrics, endpoint=endpoint)

    def health(self) -> tuple[HealthBody, bool]:
        return HealthBody(status="ok", phase=self.phase), True

    async def readiness(self) -> tuple[ReadyBody, bool]:
        """Objects loaded and at least one pose replica running (and answering ``describe``)."""
        running = await self.pose_replicas_running()
        ready = self.phase == "ready" and running > 0
        described: dict = {}
        if ready:
            try:
                described = await asyncio.wait_for(self.pose.describe.remote(), self.config.request_timeout_s)
            except Exception as exc:  # noqa: BLE001 - a replica that just died: not ready for this probe
                ready, described = False, {"reason": f"describe failed: {type(exc).__name__}"}
        reason = None if ready else described.get("reason", f"{running} pose replicas running")
        body = ReadyBody(ready=ready, phase=self.phase, reason=reason, device=described.get("device"),
                         objects=len(self.objects), random_weights=described.get("random_weights"),
                         settings={"hypotheses": self.config.hypotheses or FULL_GRID,
                                   "register_iterations": self.config.iterations,
                                   "track_iterations": self.config.track_iterations})
        return body, ready

    def retry(self) -> ReadyBody:
        raise ConflictError(f"nothing to retry: the ingress is {self.phase} (Serve restarts failed replicas)",
                            field=None)

    async def metrics_text(self) -> str:
        return self.metrics.render(self.ingress_families() + await self.replica_families())

    def object_stored(self, entry: ObjectEntry) -> None:
        """An upload is in the shared directory: replicas load this version when a call names it."""
        self.versions[entry.object_id] = object_ref(self.objects.root, entry)

    def object_deleted(self, object_id: str) -> None:
        self.versions.pop(object_id, None)

    # -- readiness and metrics -----------------------------------------------------------------------------------------
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
            *self.sessions.families(),
            Family("fp_objects_loaded", "gauge", "Registered objects.").add(len(self.objects)),
            Family("fp_serve_retries_total", "counter", "Pose calls retried because their replica died mid-call.")
            .add(self.retries_total),
            Family("fp_serve_replica_lost_total", "counter", "Pose calls that failed on every try (503).")
            .add(self.lost_total),
            Family("fp_serve_backpressure_total", "counter",
                   "Pose calls refused because the replicas' queue was full (503).").add(self.backpressure_total),
            *self.streams.families(),
        ]


class _LeaveRequestIdToProxy:
    """Drop ``X-Request-ID`` from answers: Serve's proxy adds it to every answer itself (the same id: it hands the
    request's id to the app, which the request-context middleware adopts), so it would appear twice."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_once(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"x-request-id"]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_once if scope["type"] == "http" else send)

