"""The pose replica: one :class:`~server.state.ServerState` (estimator, ``PoseService``, objects) per Serve replica.

Each replica builds its own estimator and service from the shared ``ServerConfig`` (on the GPU share
Ray gave it), loads the shared objects directory, warms up, and only then reports itself started,
so Serve routes nothing to a replica that is still loading. Calls carry the frame's bytes as received
(a :class:`~server.flow.frames.FrameBytes`: encoded images or raw pixels); the replica decodes,
validates and submits them with the single-process server's backend (:class:`~server.flow.backend.LocalBackend`)
and answers its :class:`~server.flow.backend.PoseResult` (with its host phases) or the
:class:`~server.errors.ErrorInfo` of its error.

Any replica can serve any session's frame: the call carries the whole tracking state (session
affinity is the router's business, :mod:`server.serve.routing`). A call's typed input is rebuilt from the flow's
encoding between processes (:mod:`server.flow.wire`), not parsed again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys

import anyio
import torch
from ray import serve

from foundationpose.errors import UnknownObjectError
from server.cli import SWITCH_INTERVAL_S
from server.errors import ErrorInfo, classify
from server.flow.backend import LocalBackend, PoseResult
from server.flow.steps import check_finite_pose, split_timings
from server.metrics import Family
from server.objects import ObjectEntry
from server.phases import Phases
from server.serve.calls import ObjectRef, RegisterCall, TrackCall, object_ref
from server.serve.cluster import warn_if_deprioritised
from server.serve.metrics_board import board_handle
from server.serve.settings import ServeSettings
from server.state import ServerState

__all__ = ["PoseReplica"]

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 3600.0  # networks, engines and warm-up; a TensorRT build can take minutes


class PoseReplica:
    """A Serve deployment class (wrapped by :func:`server.serve.app.build_app`)."""

    async def __init__(self, settings: ServeSettings) -> None:
        warn_if_deprioritised()
        if settings.torch_threads is not None:
            torch.set_num_threads(settings.torch_threads)
        sys.setswitchinterval(SWITCH_INTERVAL_S)  # this replica's process, as python -m server sets its own
        self.settings = settings
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        # the ingress serves every port: a replica runs no ingest workers of its own
        self.state = ServerState(dataclasses.replace(settings.server, ingest_workers=0), owns_process=True)
        self.backend = LocalBackend(self.state)
        await self.state.start()
        if not await anyio.to_thread.run_sync(self.state.wait_ready, _START_TIMEOUT_S):
            raise RuntimeError(f"pose replica {self.replica_id} did not start: {self.state.failure or self.state.phase}")
        root = self.state.objects.root
        self._versions = {e.object_id: object_ref(root, e).version for e in self.state.objects.entries()}
        self._loading: dict[str, asyncio.Lock] = {}
        self._publisher = asyncio.create_task(self._publish_loop(), name="fp-metrics-publish")
        log.info("pose replica %s ready on %s with %d objects", self.replica_id, self.state.estimator.device,
                 len(self.state.objects))

    # -- calls from the ingress ------------------------------------------------------------------
    async def register(self, call: RegisterCall) -> PoseResult | ErrorInfo:
        try:
            phases = Phases(request_id=call.request_id)
            entry = await self._entry(call.obj)
            request = call.request
            result = await self.backend.register(entry, request.frame, request.K, phases,
                                                 session_id=request.session_id, box=request.box)
            check_finite_pose(result.cam_from_mesh, "register")
            self.state.metrics.observe_stages("/register", split_timings(result.timings_ms))
            return dataclasses.replace(result, replica=self.replica_id)
        except Exception as exc:
            return self._forwarded(exc)

    async def track(self, call: TrackCall) -> PoseResult | ErrorInfo:
        try:
            phases = Phases(request_id=call.request_id)
            entry = await self._entry(call.obj)
            request = call.request
            result = await self.backend.track(entry, request.frame, request.K, call.start, phases)
            check_finite_pose(result.cam_from_mesh, "track")
            self.state.metrics.observe_stages("/track", split_timings(result.timings_ms))
            return dataclasses.replace(result, replica=self.replica_id)
        except Exception as exc:
            return self._forwarded(exc)

    def describe(self) -> dict:
        """For the ingress' ``/readyz``: this replica's id, device and whether it runs on random weights."""
        est = self.state.estimator
        return {"replica": self.replica_id, "device": str(est.device),
                "random_weights": bool(getattr(est.networks, "random_weights", False)),
                "objects": len(self.state.objects)}

    def check_health(self) -> None:
        """Serve's health check: raising makes Serve replace this replica."""
        if self.state.phase != "ready":
            raise RuntimeError(f"pose replica {self.replica_id} is {self.state.phase}")
        pipeline = self.state.pipeline_state()
        if pipeline != "ok":
            raise RuntimeError(f"pose replica {self.replica_id}: pose pipeline {pipeline}")

    async def __del__(self) -> None:  # Serve's graceful shutdown of this replica
        self._publisher.cancel()
        await asyncio.gather(self._publisher, return_exceptions=True)
        await self.state.stop()

    # -- helpers ---------------------------------------------------------------------------------
    async def _entry(self, ref: ObjectRef) -> ObjectEntry:
        """This replica's copy of the object, (re)loaded from the shared directory when its version differs."""
        if self._versions.get(ref.object_id) == ref.version:
            return self.state.objects.get(ref.object_id)
        lock = self._loading.setdefault(ref.object_id, asyncio.Lock())
        async with lock:
            if self._versions.get(ref.object_id) != ref.version:
                entry = await self.state.in_thread(self.state.objects.load_one, ref.object_id)
                version = object_ref(self.state.objects.root, entry).version
                self._versions[ref.object_id] = version
                if version != ref.version:  # the files changed again meanwhile: the ingress is behind
                    raise UnknownObjectError(f"object_id: {ref.object_id!r} changed on disk while the request ran")
                log.info("pose replica %s loaded object %r (%s)", self.replica_id, ref.object_id, version)
        return self.state.objects.get(ref.object_id)

    def _forwarded(self, exc: Exception) -> ErrorInfo:
        info = classify(exc, retry_after_s=self.state.config.retry_after_s)
        if info.internal:
            log.error("pose replica %s: unexpected %s", self.replica_id, type(exc).__name__, exc_info=exc)
            return ErrorInfo(500, "InternalError",
                             f"internal server error in pose replica {self.replica_id} (details are in its log)")
        return info

    def _families(self) -> list[Family]:
        """This replica's pipeline, pose-stage and GPU families (not the sessions or HTTP ones: the ingress has those)."""
        own = [*self.state.metrics.families(), *self.state.metric_families()]
        return [f for f in own if not f.name.startswith(("fp_http_", "fp_sessions_"))]

    async def _publish_loop(self) -> None:
        board = None
        while True:
            try:
                if board is None:
                    board = await anyio.to_thread.run_sync(board_handle, self.settings.app_name)
                await board.publish.remote(self.replica_id, self._families())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the board died with its owner: make a new one next time
                log.debug("metrics publish failed (%s); retrying", exc)
                board = None
            await asyncio.sleep(self.settings.metrics_interval_s)

