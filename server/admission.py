"""Admission control of pose requests: bounded waiting, shed with a Retry-After that was measured.

Track (one :class:`TrackAdmission` per server):

* at most ``capacity`` track requests are admitted at once across all sessions (running in the
  pipeline or waiting for their session's turn); beyond that, :class:`OverloadedError` (503);
* while the lane is saturated (``parallel`` or more admitted) and its recent measured latency exceeds
  ``latency_budget_ms``, new track requests are refused with :class:`OverloadedError` (503) too: a
  count bound alone sheds nothing on a slow device (64 clients on a CPU waited 15-35 s for 256 places);
* per session at most ``1 + session_waiting`` are admitted (one running, the rest waiting in arrival
  order); beyond that, :class:`SessionBusyError` (429). A stream (``/track/stream``) never has more than
  one frame admitted: newest frame wins before admission.

Register (one :class:`RegisterAdmission`): at most ``capacity`` registers admitted at once (decoding,
validating, waiting for a pipeline slot or running), by default twice the register frames in flight; beyond
that, :class:`OverloadedError` (503) before the body is decoded. Without it a flood of registers was decoded
and validated only to be refused by the lane (py-spy, 64 clients on the H200: 24% of the server's samples
were PNG decoding, 1,158 of those registers refused with 503).

Every refusal carries ``retry_after_ms`` estimated from :class:`ServiceTimes`, the recent measured
submit-to-result time of that lane: for a session, the requests ahead of it times one track; for the
lane, the admitted requests over what the lane works on at once, times one track; for register, the
in-flight registers over ``frames_in_flight``, times one register. Before any measurement the
configured ``retry_after_s`` stands in.

Admission runs on the event loop only (like the session store); the condition is there so that other
threads (tests, diagnostics) can wait for a state (:meth:`TrackAdmission.wait_until`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Hashable

from server.errors import OverloadedError, SessionBusyError

__all__ = ["RegisterAdmission", "ServiceTimes", "Ticket", "TrackAdmission", "admit_track"]

_EWMA_ALPHA = 0.2  # weight of the newest sample: follows a load change within ~10 requests


class ServiceTimes:
    """Recent service time (submit -> result, ms) per lane, as an exponentially weighted mean."""

    def __init__(self, fallback_ms: float) -> None:
        self.fallback_ms = fallback_ms
        self._ms: dict[str, float] = {}

    def observe(self, lane: str, ms: float) -> None:
        if not math.isfinite(ms) or ms < 0:
            return
        old = self._ms.get(lane)
        self._ms[lane] = ms if old is None else old + _EWMA_ALPHA * (ms - old)

    def ms(self, lane: str) -> float:
        """The lane's recent service time, or the fallback before the first measurement."""
        return self._ms.get(lane, self.fallback_ms)

    def measured(self, lane: str) -> bool:
        return lane in self._ms

    def register_retry_ms(self, in_flight: int, frames_in_flight: int) -> float:
        return self.ms("register") * max(1.0, in_flight / max(1, frames_in_flight))


class TrackAdmission:
    """Bounded admission of track requests (see the module docstring).

    capacity: track requests admitted at once, all sessions. session_waiting: admitted requests per
    session beyond the running one. parallel: how many requests the track lane works on at once
    (max batch x batches in flight), for the lane-wide Retry-After.
    """

    def __init__(self, *, capacity: int, session_waiting: int, parallel: int, times: ServiceTimes,
                 latency_budget_ms: float | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if session_waiting < 0:
            raise ValueError(f"session_waiting must be >= 0, got {session_waiting}")
        if latency_budget_ms is not None and not latency_budget_ms > 0:
            raise ValueError(f"latency_budget_ms must be > 0 or None, got {latency_budget_ms!r}")
        self.capacity = capacity
        self.latency_budget_ms = latency_budget_ms
        self.session_waiting = session_waiting
        self.parallel = max(1, parallel)
        self.times = times
        self.admitted = 0
        self._per_key: dict[Hashable, int] = {}
        self._changed = threading.Condition()

    def __repr__(self) -> str:
        return f"<TrackAdmission {self.admitted}/{self.capacity} admitted, {len(self._per_key)} sessions>"

    def held_by(self, key: Hashable) -> int:
        return self._per_key.get(key, 0)

    def acquire(self, key: Hashable | None) -> Ticket:
        """Admit one request (release the ticket when it is answered); raises SessionBusyError /
        OverloadedError at once instead of waiting."""
        track_ms = self.times.ms("track")
        if key is not None:
            ahead = self._per_key.get(key, 0)
            if ahead > self.session_waiting:
                raise SessionBusyError(
                    f"session_id: this session already has {ahead} track requests admitted (1 running, at most "
                    f"{self.session_waiting} waiting); send the next frame after an answer, or use /track/stream",
                    retry_after_ms=track_ms * ahead, field="session_id")
        if self.admitted >= self.capacity:
            retry_ms = track_ms * self.admitted / self.parallel
            raise OverloadedError(f"the track lane is full ({self.admitted} requests admitted, capacity "
                                  f"{self.capacity}); retry in about {retry_ms:.0f} ms", retry_after_ms=retry_ms)
        budget = self.latency_budget_ms
        if (budget is not None and self.admitted >= self.parallel and self.times.measured("track")
                and track_ms > budget):
            retry_ms = track_ms * self.admitted / self.parallel
            raise OverloadedError(f"the track lane is saturated (recent latency {track_ms:.0f} ms, budget "
                                  f"{budget:.0f} ms, {self.admitted} requests admitted); retry in about "
                                  f"{retry_ms:.0f} ms", retry_after_ms=retry_ms)
        with self._changed:
            self.admitted += 1
            if key is not None:
                self._per_key[key] = self._per_key.get(key, 0) + 1
            self._changed.notify_all()
        return Ticket(self, key)

    def _release(self, key: Hashable | None) -> None:
        with self._changed:
            self.admitted -= 1
            if key is not None:
                left = self._per_key[key] - 1
                if left:
                    self._per_key[key] = left
                else:
                    del self._per_key[key]
            self._changed.notify_all()

    def wait_until(self, predicate: Callable[[TrackAdmission], bool], timeout: float) -> bool:
        """Block (a thread, never the loop) until ``predicate(self)`` holds; False after ``timeout`` s."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(self), timeout)


class RegisterAdmission:
    """Bounded admission of registers (see the module docstring).

    capacity: registers admitted at once. frames_in_flight: registers the lane runs at once (for Retry-After).
    """

    def __init__(self, *, capacity: int, frames_in_flight: int, times: ServiceTimes) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.frames_in_flight = max(1, frames_in_flight)
        self.times = times
        self.admitted = 0
        self._changed = threading.Condition()

    def __repr__(self) -> str:
        return f"<RegisterAdmission {self.admitted}/{self.capacity} admitted>"

    def acquire(self) -> Ticket:
        """Admit one register (release the ticket when it is answered); raises OverloadedError at once."""
        with self._changed:
            if self.admitted >= self.capacity:
                retry_ms = self.times.register_retry_ms(self.admitted, self.frames_in_flight)
                raise OverloadedError(
                    f"the register lane is full ({self.admitted} registers admitted, capacity {self.capacity}); "
                    f"retry in about {retry_ms:.0f} ms", retry_after_ms=retry_ms)
            self.admitted += 1
            self._changed.notify_all()
        return Ticket(self, None)

    def try_spare(self) -> Ticket | None:
        """Admit one register only while the lane has a frame free (fewer than ``frames_in_flight`` admitted), else
        None: for work that yields to the clients' registers and never queues behind them (a lost session's
        recovery register)."""
        with self._changed:
            if self.admitted >= min(self.frames_in_flight, self.capacity):
                return None
            self.admitted += 1
            self._changed.notify_all()
        return Ticket(self, None)

    def _release(self, key: Hashable | None) -> None:
        with self._changed:
            self.admitted -= 1
            self._changed.notify_all()

    def wait_until(self, predicate: Callable[[RegisterAdmission], bool], timeout: float) -> bool:
        """Block (a thread, never the loop) until ``predicate(self)`` holds; False after ``timeout`` s."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(self), timeout)


def admit_track(admission: TrackAdmission, key: Hashable | None, *, metrics, endpoint: str) -> Ticket:
    """A track admission ticket, or the refusal, counted in ``metrics`` (``fp_requests_shed_total``: why)."""
    try:
        return admission.acquire(key)
    except OverloadedError as exc:
        metrics.shed(endpoint, "session_busy" if isinstance(exc, SessionBusyError) else "track_full")
        raise


class Ticket:
    """One admitted request; :meth:`release` (idempotent) gives its place back."""

    __slots__ = ("_admission", "key", "_held")

    def __init__(self, admission: TrackAdmission | RegisterAdmission, key: Hashable | None) -> None:
        self._admission = admission
        self.key = key
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._admission._release(self.key)

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()
