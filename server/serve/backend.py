"""The Ray Serve ingress' :class:`~server.flow.backend.PoseBackend`: each step is one call to a pose replica.

A replica that dies mid-call (``ActorDiedError``) is retried on another replica up to ``retry_attempts`` times; when
the pose deployment's queue is full (``max_queued_requests``) Serve raises ``BackPressureError``, answered 503 +
Retry-After like the single-process BusyError. The replica's host phases are booked in the request's phases, the
rest of the call as ``serve_hop``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

from deploy_core.errors import BusyError
from server.errors import ErrorInfo, ForwardedError, NotReadyError, RequestTimeoutError
from server.flow import wire
from server.flow.backend import PoseResult, SubmitGroup, TrackStart
from server.flow.frames import FrameBytes
from server.flow.inputs import RegisterInput, StreamFrame
from server.phases import Phases
from server.serve.calls import RegisterCall, TrackCall

__all__ = ["ServeBackend"]

log = logging.getLogger(__name__)

_LOST = (RayActorError, ReplicaUnavailableError)  # ActorDiedError and ActorUnavailableError are RayActorErrors


class ServeBackend:
    """Steps on the pose replicas behind ``ingress`` (a :class:`~server.serve.ingress.PoseIngress`: its handle,
    settings, object versions, service times and counters)."""

    def __init__(self, ingress: Any) -> None:
        self.ingress = ingress

    @property
    def max_translation_m(self) -> float | None:
        return self.ingress.config.max_translation_m  # the replicas' estimator has the same

    async def register(self, entry: Any, frame: FrameBytes, K: np.ndarray, phases: Phases, *,
                       session_id: str | None = None, box: tuple[int, int, int, int] | None = None) -> PoseResult:
        request = RegisterInput(entry.object_id, K, frame, session_id=session_id, box=box)
        call = RegisterCall(self.ingress.ref(entry), wire.fields_of(request), frame, request_id=phases.request_id)
        return await self._call("register", call, phases)

    def submit_group(self, members: int) -> SubmitGroup:
        """One replica call per step, one after another: Serve's router keys a call by the internal id of the
        request it is made in, so concurrent calls of one request would collide there (one waits forever)."""
        return SubmitGroup(members, lambda: None, concurrent=False)

    async def shared_frame(self, frame: FrameBytes, phases: Phases) -> FrameBytes:
        """As it came: each replica decodes its own call's frame (raw pixels would be larger to send)."""
        return frame

    async def track(self, entry: Any, frame: FrameBytes, K: np.ndarray | None, start: TrackStart, phases: Phases, *,
                    in_loop: bool = False, group: SubmitGroup | None = None) -> PoseResult:
        call = TrackCall(self.ingress.ref(entry), wire.fields_of(StreamFrame(frame, K)), frame, start,
                         request_id=phases.request_id)
        result = await self._call("track", call, phases)
        if result.frame_no != start.frame_no:
            raise AssertionError(f"replica answered frame {result.frame_no} for frame {start.frame_no}")
        return result

    async def _call(self, method: str, call: RegisterCall | TrackCall, phases: Phases) -> PoseResult:
        """One call to a pose replica, retried on another replica when the serving one dies mid-call."""
        ingress = self.ingress
        handle, timeout_s = ingress.pose, ingress.config.request_timeout_s
        attempts = ingress.settings.retry_attempts
        for attempt in range(1, attempts + 1):
            try:
                # the replica bounds its own wait (request_timeout_s, then 504); this bounds a replica that hangs
                reply = await asyncio.wait_for(getattr(handle, method).remote(call), timeout_s + 5.0)
            except asyncio.TimeoutError as exc:
                raise RequestTimeoutError(f"no answer from a pose replica within {timeout_s:g} s") from exc
            except BackPressureError as exc:
                ingress.backpressure_total += 1
                raise BusyError(str(exc)) from exc
            except DeploymentUnavailableError as exc:
                raise NotReadyError(f"the pose replicas are unavailable: {exc.message}") from exc
            except _LOST as exc:
                log.warning("%s: pose replica lost mid-call (try %d of %d): %s", method, attempt, attempts,
                            type(exc).__name__)
                if attempt < attempts:
                    ingress.retries_total += 1
                    continue
                ingress.lost_total += 1
                raise NotReadyError(f"{method}: {attempts} tries each hit a pose replica that died; "
                                    "retry when Serve has replaced it") from exc
            call_ms = phases.lap("serve_hop")
            if isinstance(reply, ErrorInfo):
                raise ForwardedError(reply)
            inner_ms = sum(ms for name, ms in reply.phases_ms.items() if name != "batcher_wait")  # inside the replica
            phases.ms["serve_hop"] = max(0.0, call_ms - inner_ms)
            for name, ms in reply.phases_ms.items():
                phases.add(name, ms)
            if "pipeline" in reply.phases_ms:
                ingress.service_times.observe(method, reply.phases_ms["pipeline"])  # the Retry-After estimates
            return reply
        raise AssertionError("unreachable")
