"""Where the host time of one pose request goes: named phases, in milliseconds.

Phases of ``/track`` and ``/register`` (all wall time, in the order they happen)::

    receive       first body byte -> last body byte (the multipart parser streams, so it overlaps)
    parse         last body byte -> handler start (rest of the form parse, dependency solving)
    queue         waiting for admission: the session's turn (HTTP), or a stream frame waiting for its turn
    serve_hop     Ray Serve only (:mod:`server.serve`): the ingress' call to a pose replica minus the
                  replica's own phases below (routing, Serve's queue, transport both ways)
    decode        PNG / JPEG / .npy / raw bytes -> arrays
    validate      shape / dtype / K / pose checks
    submit        handing the job to the pipeline (batcher put; its in-service validation)
    batcher_wait  in the micro-batcher until its batch left (track only; from the lane's result)
    pipeline      submit returned -> the pipeline's future completed (batcher wait + stages + their queues); a
                  track into an idle lane runs inside the submit call (inline), and that call is its pipeline
    resume        future completed -> the request's coroutine ran again (event-loop latency)
    encode        building and serialising the answer

All but ``batcher_wait`` (a part of ``pipeline``) follow one another: their sum in an answer's
``timings_ms`` (:func:`accounted_ms`) is the server's wall time up to the answer, so a client's round trip
minus it is the time spent outside the server's phases (transport, the client's own work).
``encode`` cannot be inside the body it times: the JSON answer carries every phase before it, and
the ``Server-Timing`` header and ``/metrics`` (``fp_request_phase_seconds``) carry all of them.
Each phase is also logged as one JSON line on ``deploy_core.timing`` when that logger is enabled.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deploy_core.timing import TimingRecord, emit_record, records_enabled

__all__ = ["PHASES", "SEQUENTIAL_PHASES", "Phases", "ReceiveTimingMiddleware", "accounted_ms", "server_timing"]

PHASES = ("receive", "parse", "queue", "serve_hop", "decode", "validate", "submit", "batcher_wait", "pipeline", "resume", "encode")
SEQUENTIAL_PHASES = tuple(p for p in PHASES if p != "batcher_wait")  # batcher_wait lies inside pipeline
_NS_PER_MS = 1e6
_RECEIVE_KEY = "fp_receive_ns"


class Phases:
    """A stopwatch with laps: ``lap(name)`` books the time since the previous lap under ``name``.

    Not thread-safe, but it may move between threads (the request hands it to its worker thread and
    back; only one of them uses it at a time).
    """

    __slots__ = ("ms", "_t", "request_id")

    def __init__(self, start_ns: int | None = None, request_id: str | None = None) -> None:
        self.ms: dict[str, float] = {}
        self._t = time.perf_counter_ns() if start_ns is None else start_ns
        self.request_id = request_id

    def lap(self, name: str, now_ns: int | None = None) -> float:
        now = time.perf_counter_ns() if now_ns is None else now_ns
        ms = (now - self._t) / _NS_PER_MS
        self.add(name, ms)
        self._t = now
        return ms

    def skip(self, now_ns: int | None = None) -> None:
        """Restart the stopwatch without booking the time since the last lap."""
        self._t = time.perf_counter_ns() if now_ns is None else now_ns

    def add(self, name: str, ms: float) -> None:
        self.ms[name] = self.ms.get(name, 0.0) + ms

    @classmethod
    def for_request(cls, scope: Scope, request_id: str | None = None) -> Phases:
        """Phases of an HTTP request: ``receive`` and ``parse`` from :class:`ReceiveTimingMiddleware`'s marks."""
        marks = scope.get("state", {}).get(_RECEIVE_KEY)
        if marks is None:
            return cls(request_id=request_id)
        first, last = marks
        phases = cls(start_ns=last, request_id=request_id)
        phases.add("receive", (last - first) / _NS_PER_MS)
        phases.lap("parse")
        return phases

    def log(self, endpoint: str) -> None:
        """One ``deploy_core.timing`` line per phase (a no-op unless that logger is enabled)."""
        if not records_enabled():  # the usual case: no record objects per request
            return
        for name, ms in self.ms.items():
            emit_record(TimingRecord(name, self.request_id, ms, extra={"endpoint": endpoint}))


def server_timing(ms: dict[str, float], names: Iterable[str] = PHASES) -> str:
    """The ``Server-Timing`` header value (``decode;dur=1.23, ...``) of the phases present."""
    return ", ".join(f"{n};dur={ms[n]:.3f}" for n in names if n in ms)


def accounted_ms(timings_ms: Mapping[str, float]) -> float:
    """The server's wall time booked in an answer's ``timings_ms``: the sum of its sequential phases."""
    return float(sum(timings_ms.get(name, 0.0) for name in SEQUENTIAL_PHASES))


class ReceiveTimingMiddleware:
    """Mark when the first and the last body chunk of an HTTP request arrived (``scope['state']``)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        first = time.perf_counter_ns()

        async def timed_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                state[_RECEIVE_KEY] = (first, time.perf_counter_ns())
            return message

        await self.app(scope, timed_receive, send)
