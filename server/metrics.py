"""Prometheus text exposition (format 0.0.4), written by hand: request counters and latency histograms.

:class:`Metrics` keeps what only the HTTP layer sees (requests by endpoint, method and status; their
latency; per-stage timings of each answered pose). Gauges that describe the pipeline right now (queue
depths, leases, sessions, GPU memory) are read at scrape time by the server and passed to
:meth:`Metrics.render` as :class:`Family` objects. Thread-safe (one lock).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "CONTENT_TYPE",
    "DEFAULT_BUCKETS_S",
    "PHASE_BUCKETS_S",
    "RECOVERY_OUTCOMES",
    "Family",
    "Histogram",
    "Metrics",
    "StreamCounters",
    "format_families",
]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DEFAULT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Phases of one request span tens of microseconds (encode) to seconds (a CPU register).
PHASE_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512,
                   1.0, 2.5, 10.0, 60.0)

# what a lost session's frame did about its recovery (fp_recovery_frames_total's outcome label)
RECOVERY_OUTCOMES = ("registered", "no_candidate", "refused", "deferred")

Labels = tuple[tuple[str, str], ...]


@dataclass(slots=True)
class Family:
    """One metric family: ``samples`` are (suffix, labels, value), suffix "" or "_bucket"/"_sum"/"_count"."""

    name: str
    type: str  # counter | gauge | histogram | summary
    help: str
    samples: list[tuple[str, Labels, float]] = field(default_factory=list)

    def add(self, value: float, suffix: str = "", **labels: object) -> Family:
        self.samples.append((suffix, tuple((k, str(v)) for k, v in labels.items()), float(value)))
        return self


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def format_families(families: Iterable[Family]) -> str:
    """The text exposition of ``families`` (HELP, TYPE, then one line per sample)."""
    lines: list[str] = []
    for fam in families:
        lines.append(f"# HELP {fam.name} {_escape(fam.help)}")
        lines.append(f"# TYPE {fam.name} {fam.type}")
        for suffix, labels, value in fam.samples:
            label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
            lines.append(f"{fam.name}{suffix}{{{label_text}}} {_number(value)}" if labels
                         else f"{fam.name}{suffix} {_number(value)}")
    return "\n".join(lines) + "\n"


class Histogram:
    """Observations counted into fixed buckets (upper bounds, ascending), rendered as a Prometheus histogram."""

    __slots__ = ("buckets", "counts", "sum", "count")

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)  # non-cumulative; made cumulative when rendered
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)  # the first bound >= value (a bisection in C: ~14 per request)
        if i < len(self.counts) and value == value:  # above every bound, or NaN: only the +Inf bucket
            self.counts[i] += 1
        self.sum += value
        self.count += 1

    def render_into(self, fam: Family, labels: Labels) -> None:
        running = 0
        for bound, n in zip(self.buckets, self.counts, strict=True):
            running += n
            fam.samples.append(("_bucket", labels + (("le", _number(bound)),), float(running)))
        fam.samples.append(("_bucket", labels + (("le", "+Inf"),), float(self.count)))
        fam.samples.append(("_sum", labels, self.sum))
        fam.samples.append(("_count", labels, float(self.count)))


class StreamCounters:
    """Counters of ``/track/stream``: open connections, frames received and frames skipped (newest wins).

    :meth:`wait_until` waits on the counters' own condition (tests wait for a state, never for time).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.open = 0
        self.received = 0
        self.skipped = 0

    def change(self, *, opened: int = 0, received: int = 0, skipped: int = 0) -> None:
        with self._cond:
            self.open += opened
            self.received += received
            self.skipped += skipped
            self._cond.notify_all()

    def wait_until(self, predicate, timeout: float) -> bool:
        """Block (a thread, not the loop) until ``predicate(self)`` holds; False after ``timeout`` s."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self), timeout)

    def families(self) -> list[Family]:
        with self._cond:
            return [Family("fp_streams_open", "gauge", "Open /track/stream connections.").add(self.open),
                    Family("fp_stream_frames_received_total", "counter", "Frame messages received by streams.")
                    .add(self.received),
                    Family("fp_stream_frames_skipped_total", "counter",
                           "Stream frames replaced by a newer one before they ran (newest frame wins).")
                    .add(self.skipped)]


class Metrics:
    """HTTP-side metrics: ``fp_http_requests_total``, ``fp_http_request_duration_seconds``,
    ``fp_http_requests_in_flight`` and ``fp_pose_stage_duration_seconds`` (per answered pose)."""

    def __init__(self, buckets_s: Sequence[float] = DEFAULT_BUCKETS_S) -> None:
        self.buckets_s = tuple(sorted(buckets_s))
        self._lock = threading.Lock()
        self._requests: dict[Labels, int] = {}
        self._latency: dict[Labels, Histogram] = {}
        self._stages: dict[Labels, Histogram] = {}
        self._phases: dict[Labels, Histogram] = {}
        # endpoint -> {stage or phase: its histogram in _stages / _phases}: a request's observations look their
        # histograms up by name, without building a label tuple per value (~25 per answered pose)
        self._stages_of: dict[str, dict[str, Histogram]] = {}
        self._phases_of: dict[str, dict[str, Histogram]] = {}
        self._shed: dict[Labels, int] = {}
        self._recoveries: dict[str, int] = {}
        self._in_flight = 0

    def request_started(self) -> None:
        with self._lock:
            self._in_flight += 1

    def request_finished(self, endpoint: str, method: str, status: int, seconds: float) -> None:
        labels: Labels = (("endpoint", endpoint), ("method", method), ("status", str(status)))
        with self._lock:
            self._in_flight -= 1
            self._requests[labels] = self._requests.get(labels, 0) + 1
            hist = self._latency.get(labels)
            if hist is None:
                hist = self._latency[labels] = Histogram(self.buckets_s)
            hist.observe(seconds)

    def observe_stages(self, endpoint: str, timings_ms: Mapping[str, float]) -> None:
        """Record one pose's per-stage wall times (``timings_ms`` from the pipeline's result)."""
        with self._lock:
            hists = self._stages_of.get(endpoint)
            if hists is None:
                hists = self._stages_of[endpoint] = {}
            for stage, ms in timings_ms.items():
                if stage == "batch" or not math.isfinite(ms):
                    continue
                hist = hists.get(stage)
                if hist is None:
                    hist = hists[stage] = self._stages[(("endpoint", endpoint), ("stage", stage))] = \
                        Histogram(self.buckets_s)
                hist.observe(ms / 1e3)

    def observe_phases(self, endpoint: str, phases_ms: Mapping[str, float]) -> None:
        """Record one request's host-time phases (:mod:`server.phases`)."""
        with self._lock:
            hists = self._phases_of.get(endpoint)
            if hists is None:
                hists = self._phases_of[endpoint] = {}
            for phase, ms in phases_ms.items():
                hist = hists.get(phase)
                if hist is None:
                    hist = hists[phase] = self._phases[(("endpoint", endpoint), ("phase", phase))] = \
                        Histogram(PHASE_BUCKETS_S)
                hist.observe(ms / 1e3)

    def shed(self, endpoint: str, reason: str) -> None:
        """Count a request refused by admission control (``reason``: session_busy, track_full, ...)."""
        labels: Labels = (("endpoint", endpoint), ("reason", reason))
        with self._lock:
            self._shed[labels] = self._shed.get(labels, 0) + 1

    def recovery(self, outcome: str) -> None:
        """Count one lost session's frame by what its recovery did (``outcome``: one of :data:`RECOVERY_OUTCOMES`)."""
        if outcome not in RECOVERY_OUTCOMES:
            raise ValueError(f"outcome must be one of {RECOVERY_OUTCOMES}, got {outcome!r}")
        with self._lock:
            self._recoveries[outcome] = self._recoveries.get(outcome, 0) + 1

    def recovery_count(self, outcome: str) -> int:
        with self._lock:
            return self._recoveries.get(outcome, 0)

    def request_count(self, endpoint: str, status: int | None = None) -> int:
        """Requests recorded for ``endpoint`` (optionally with this status); for tests and logs."""
        with self._lock:
            return sum(n for labels, n in self._requests.items()
                       if dict(labels)["endpoint"] == endpoint and (status is None or dict(labels)["status"] == str(status)))

    def request_counts(self) -> list[tuple[str, str, str, int]]:
        """Every (endpoint, method, status, count) recorded so far (an ingest worker reports them to the GPU process)."""
        with self._lock:
            return [(dict(labels)["endpoint"], dict(labels)["method"], dict(labels)["status"], n)
                    for labels, n in self._requests.items()]

    def families(self) -> list[Family]:
        with self._lock:
            requests = Family("fp_http_requests_total", "counter", "HTTP requests answered, by endpoint, method and status.")
            for labels, n in sorted(self._requests.items()):
                requests.samples.append(("", labels, float(n)))
            latency = Family("fp_http_request_duration_seconds", "histogram",
                             "Time from request start to the end of the answer, by endpoint, method and status.")
            for labels, hist in sorted(self._latency.items()):
                hist.render_into(latency, labels)
            stages = Family("fp_pose_stage_duration_seconds", "histogram",
                            "Wall time of each pipeline stage of answered poses (from the result's timings_ms).")
            for labels, hist in sorted(self._stages.items()):
                hist.render_into(stages, labels)
            phases = Family("fp_request_phase_seconds", "histogram",
                            "Host time of each phase of answered pose requests (receive, parse, decode, validate, "
                            "queue, submit, batcher_wait, pipeline, resume, encode).")
            for labels, hist in sorted(self._phases.items()):
                hist.render_into(phases, labels)
            shed = Family("fp_requests_shed_total", "counter", "Requests refused by admission control, by reason.")
            for labels, n in sorted(self._shed.items()):
                shed.samples.append(("", labels, float(n)))
            recoveries = Family("fp_recovery_frames_total", "counter",
                                "Frames of lost sessions by what their recovery did: registered (a register on a "
                                "candidate answered), no_candidate, refused (too little depth under it: tracked), "
                                "deferred (the register lane had no frame free: tracked, no candidate searched).")
            for outcome, n in sorted(self._recoveries.items()):
                recoveries.add(n, outcome=outcome)
            in_flight = Family("fp_http_requests_in_flight", "gauge", "HTTP requests being handled now.")
            in_flight.add(self._in_flight)
        return [requests, latency, stages, phases, shed, recoveries, in_flight]

    def render(self, extra: Iterable[Family] = ()) -> str:
        """The full exposition: this object's families, then ``extra`` (scrape-time gauges)."""
        return format_families([*self.families(), *extra])
