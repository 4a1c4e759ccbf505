"""Per-stage timers ("timing macros"): wall time always, CUDA event time without a sync.

Three pieces:

* :func:`timed` -- context manager *and* decorator. It measures wall time with
  ``time.perf_counter_ns`` and, when given a CUDA ``stream``, records a start/end
  ``torch.cuda.Event`` pair on that stream. It never synchronises: the GPU time is
  resolved later, when the end event has completed (``record.resolve()``) or at
  summary time (``TimingRecorder.flush()``).
* :class:`TimingRecord` -- one measurement (stage, package id, wall ms, GPU ms, queue
  wait ms, extras).
* :class:`TimingRecorder` -- a thread-safe collector that keeps per-stage counts and a
  bounded window of samples for percentiles, and emits one JSON line per record.

Logging
-------
Records go to the logger ``"deploy_core.timing"`` at **DEBUG**, one JSON object per
line with the keys in a fixed order: ``stage, package_id, wall_ms, gpu_ms,
queue_wait_ms`` followed by the extras (e.g. ``key``, ``error``). Nothing is
formatted unless the logger is enabled for DEBUG (``logger.isEnabledFor`` is checked
first, so a disabled timer costs two clock reads and one small object). A named
recorder (``TimingRecorder(name=...)``) also logs a one-line summary per stage at
**INFO** every ``summary_every_s`` seconds (count, p50, p90, max of the records since
the last summary): what a person reads in a service's log. The library never attaches
handlers; CLIs call :func:`configure_timing_log` (or :func:`configure_timing_log_from_env`,
which reads ``FP_TIMING_LOG``) to write every record to a JSON-lines file.

Example::

    recorder = TimingRecorder()
    with timed("render", package_id=7, stream=stream, sink=recorder) as t:
        render(...)
    t.record.wall_ms           # float
    recorder.summary()["render"]["p50"]
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = [
    "TIMING_LOGGER_NAME",
    "TimingRecord",
    "TimingRecorder",
    "configure_timing_log",
    "configure_timing_log_from_env",
    "emit_record",
    "percentile",
    "records_enabled",
    "timed",
]

TIMING_LOGGER_NAME = "deploy_core.timing"
TIMING_LOG_ENV = "FP_TIMING_LOG"

_timing_log = logging.getLogger(TIMING_LOGGER_NAME)
_NS_PER_MS = 1e6


def _record_event(stream: Any) -> Any:
    """Record a timing-enabled CUDA event on ``stream`` (asynchronous; no sync)."""
    import torch  # lazy: CPU-only users of timing never import torch here

    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


@dataclass(frozen=True, slots=True)
class TimingRecord:
    """One stage measurement.

    ``gpu_ms`` is ``None`` for CPU stages, and also for GPU stages until the record is
    resolved (``gpu_pending`` is then True): call :meth:`resolve` for a copy with it set.
    ``extra`` holds JSON-friendly extras (``key``, ``error``, batch size, ...).
    """

    stage: str
    package_id: int | str | None
    wall_ms: float
    gpu_ms: float | None = None
    queue_wait_ms: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    # (start, end) CUDA events not yet read; never compared or printed.
    gpu_events: tuple[Any, Any] | None = field(default=None, compare=False, repr=False)

    @property
    def gpu_pending(self) -> bool:
        """True while the GPU time is recorded on events that have not been read yet."""
        return self.gpu_events is not None

    def resolve(self, wait: bool = False) -> TimingRecord:
        """Return a copy with ``gpu_ms`` read from the events, or ``self`` if not ready.

        Without ``wait`` this only queries the end event (never blocks). With ``wait``
        it synchronises on the end event: use it at summary time, not in a hot loop.
        """
        if self.gpu_events is None:
            return self
        start, end = self.gpu_events
        if wait:
            end.synchronize()
        elif not end.query():
            return self
        return replace(self, gpu_ms=float(start.elapsed_time(end)), gpu_events=None)

    def as_dict(self) -> dict[str, Any]:
        """The log-line fields, in their fixed order (extras last)."""
        out: dict[str, Any] = {
            "stage": self.stage,
            "package_id": self.package_id,
            "wall_ms": round(self.wall_ms, 4),
            "gpu_ms": None if self.gpu_ms is None else round(self.gpu_ms, 4),
            "queue_wait_ms": round(self.queue_wait_ms, 4),
        }
        for name, value in self.extra.items():
            out.setdefault(name, value)
        return out


def records_enabled() -> bool:
    """Whether :func:`emit_record` logs anything now: callers with many records skip building them when not."""
    return _timing_log.isEnabledFor(logging.DEBUG)


def emit_record(record: TimingRecord) -> None:
    """Log ``record`` as one JSON line on ``deploy_core.timing`` (DEBUG), if enabled."""
    if _timing_log.isEnabledFor(logging.DEBUG):
        fields = record.as_dict()
        _timing_log.debug("%s", json.dumps(fields, default=str), extra={"timing": fields})


def _sink_adder(sink: Any) -> Callable[[TimingRecord], None] | None:
    if sink is None:
        return None
    add = getattr(sink, "add", None)
    if callable(add):
        return add
    if callable(sink):
        return sink
    raise TypeError(f"sink must be a TimingRecorder, an object with .add(record) or a callable; got {sink!r}")


class _Timer:
    """The object :func:`timed` returns: a one-shot context manager, reusable as a decorator."""

    __slots__ = ("stage", "package_id", "stream", "queue_wait_ms", "extra", "record",
                 "_add", "_t0", "_start_event")

    def __init__(self, stage: str, package_id: int | str | None, stream: Any, queue_wait_ms: float,
                 add: Callable[[TimingRecord], None] | None, extra: dict[str, Any]) -> None:
        self.stage = stage
        self.package_id = package_id
        self.stream = stream
        self.queue_wait_ms = queue_wait_ms
        self.extra = extra
        self.record: TimingRecord | None = None
        self._add = add
        self._t0 = 0
        self._start_event: Any = None

    def __enter__(self) -> _Timer:
        if self.stream is not None:
            self._start_event = _record_event(self.stream)
        self._t0 = time.perf_counter_ns()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        wall_ms = (time.perf_counter_ns() - self._t0) / _NS_PER_MS
        events = None
        if self._start_event is not None:
            events = (self._start_event, _record_event(self.stream))
            self._start_event = None
        extra = self.extra
        if exc_type is not None:
            extra = {**extra, "error": exc_type.__name__}
        record = TimingRecord(self.stage, self.package_id, wall_ms, None, self.queue_wait_ms, extra, events)
        self.record = record
        if self._add is not None:
            self._add(record)
        else:
            emit_record(record)

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Decorate ``fn``: every call is timed with this timer's settings (a fresh timer per call)."""
        stage, package_id, stream, wait, add, extra = (
            self.stage, self.package_id, self.stream, self.queue_wait_ms, self._add, self.extra)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with _Timer(stage, package_id, stream, wait, add, dict(extra)):
                return fn(*args, **kwargs)

        return wrapper


def timed(stage: str, *, package_id: int | str | None = None, stream: Any = None,
          queue_wait_ms: float = 0.0, sink: Any = None, **extra: Any) -> _Timer:
    """Time a block (``with timed(...) as t:``) or every call of a function (``@timed(...)``).

    stage: stage name. package_id: the package/frame id for the log line.
    stream: a ``torch.cuda.Stream`` to time on with an event pair (no sync), or None.
    queue_wait_ms: time the package waited before this stage (copied into the record).
    sink: where the record goes: a :class:`TimingRecorder` (or any object with
        ``.add(record)``) or a callable. Without a sink the record is logged directly.
        A record is emitted exactly once: by the recorder, or here when there is no sink.
    extra: JSON-friendly fields appended to the record (``n=252``, ``key="s3"``).

    After the block, ``t.record`` holds the :class:`TimingRecord`. An exception in the
    block is recorded as ``extra["error"] = <type name>`` and propagates unchanged.
    """
    return _Timer(stage, package_id, stream, queue_wait_ms, _sink_adder(sink), extra)


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method) of an ascending list.

    q in [0, 100]. Returns NaN for an empty list.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100], got {q}")
    n = len(sorted_values)
    if n == 0:
        return float("nan")
    pos = (n - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    frac = pos - lo
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac


class _StageBucket:
    """Exact counters plus a bounded window of recent samples for one stage."""

    __slots__ = ("count", "errors", "wall_sum", "wall_max", "gpu_count", "gpu_sum", "wall", "wait", "gpu")

    def __init__(self, window: int) -> None:
        self.count = 0
        self.errors = 0
        self.wall_sum = 0.0
        self.wall_max = 0.0
        self.gpu_count = 0
        self.gpu_sum = 0.0
        self.wall: collections.deque[float] = collections.deque(maxlen=window)
        self.wait: collections.deque[float] = collections.deque(maxlen=window)
        self.gpu: collections.deque[float] = collections.deque(maxlen=window)


class TimingRecorder:
    """Thread-safe collector of :class:`TimingRecord` s, summarised per stage.

    ``count``, ``max``, ``mean``, ``errors`` and ``busy_ms`` are exact over every
    record; percentiles are over the last ``window`` records of each stage (bounded
    memory for long-running services). Records with pending GPU events are held until
    their end event completes (polled on every ``add``) or until :meth:`flush`; they
    are logged when resolved, so their log line carries ``gpu_ms``.
    """

    def __init__(self, window: int = 10_000, *, name: str | None = None, summary_every_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if not summary_every_s > 0:
            raise ValueError(f"summary_every_s must be > 0, got {summary_every_s}")
        self._window = window
        self._lock = threading.Lock()
        self._buckets: dict[str, _StageBucket] = {}
        self._pending: list[TimingRecord] = []
        # the periodic INFO summary (named recorders only): records since the last one, per stage
        self.name = name
        self._summary_every_s = summary_every_s
        self._clock = clock
        self._since: dict[str, list[float]] = {}
        self._summary_due = clock() + summary_every_s

    def add(self, record: TimingRecord) -> None:
        """Collect one record and log its JSON line (now, or once its GPU time is known)."""
        if self._pending:
            self._poll_pending(wait=False)
        if record.gpu_events is not None:
            resolved = record.resolve(wait=False)
            if resolved.gpu_events is not None:
                with self._lock:
                    self._pending.append(resolved)
                return
            record = resolved
        self._ingest(record)

    def flush(self, wait: bool = True) -> None:
        """Resolve held GPU records (synchronising on their end events when ``wait``)."""
        self._poll_pending(wait=wait)

    def _poll_pending(self, wait: bool) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        still: list[TimingRecord] = []
        for record in pending:
            resolved = record.resolve(wait=wait)
            if resolved.gpu_events is None:
                self._ingest(resolved)
            else:
                still.append(resolved)
        if still:
            with self._lock:
                self._pending[:0] = still

    def _ingest(self, record: TimingRecord) -> None:
        with self._lock:
            bucket = self._buckets.get(record.stage)
            if bucket is None:
                bucket = self._buckets[record.stage] = _StageBucket(self._window)
            bucket.count += 1
            bucket.wall_sum += record.wall_ms
            if record.wall_ms > bucket.wall_max:
                bucket.wall_max = record.wall_ms
            bucket.wall.append(record.wall_ms)
            bucket.wait.append(record.queue_wait_ms)
            if record.gpu_ms is not None:
                bucket.gpu_count += 1
                bucket.gpu_sum += record.gpu_ms
                bucket.gpu.append(record.gpu_ms)
            if "error" in record.extra:
                bucket.errors += 1
            summary = None
            if self.name is not None:
                self._since.setdefault(record.stage, []).append(record.wall_ms)
                now = self._clock()
                if now >= self._summary_due:
                    summary, self._since = self._since, {}
                    self._summary_due = now + self._summary_every_s
        emit_record(record)
        if summary is not None:
            self._log_summary(summary)

    def _log_summary(self, since: dict[str, list[float]]) -> None:
        """One INFO line: ``name: stage n=.. p50=.. p90=.. max=.. ms`` per stage, for the records since the last."""
        if not _timing_log.isEnabledFor(logging.INFO):
            return
        parts = []
        for stage, walls in since.items():
            walls.sort()
            parts.append(f"{stage} n={len(walls)} p50={percentile(walls, 50):.2f} p90={percentile(walls, 90):.2f} "
                         f"max={walls[-1]:.2f}")
        _timing_log.info("%s timings (ms, last %.0f s): %s", self.name, self._summary_every_s, "; ".join(parts),
                         extra={"timing_summary": {"recorder": self.name, "stages": list(since)}})

    def stages(self) -> list[str]:
        """Stage names in the order they were first seen."""
        with self._lock:
            return list(self._buckets)

    def summary(self, stages: Iterable[str] | None = None, *,
                wait: bool = True) -> dict[str, dict[str, float | int | None]]:
        """Per-stage statistics (milliseconds), after resolving held GPU records.

        stages: restrict to (and order by) these names; stages without records are left out.
        wait: synchronise on held GPU events first (default); False only polls them, so
        it never blocks (run-time stats).

        Keys per stage: ``count, p50, p90, max, mean`` (wall time), ``errors``,
        ``busy_ms`` (total wall), ``queue_wait_p50, queue_wait_p90``, and
        ``gpu_p50, gpu_mean`` (None when the stage has no GPU records).
        """
        self.flush(wait=wait)
        with self._lock:
            names = list(self._buckets) if stages is None else [s for s in stages if s in self._buckets]
            snap = {n: (self._buckets[n], sorted(self._buckets[n].wall), sorted(self._buckets[n].wait),
                        sorted(self._buckets[n].gpu)) for n in names}
            out: dict[str, dict[str, float | int | None]] = {}
            for name, (b, wall, wait, gpu) in snap.items():
                out[name] = {
                    "count": b.count,
                    "p50": percentile(wall, 50),
                    "p90": percentile(wall, 90),
                    "max": b.wall_max,
                    "mean": b.wall_sum / b.count,
                    "errors": b.errors,
                    "busy_ms": b.wall_sum,
                    "queue_wait_p50": percentile(wait, 50),
                    "queue_wait_p90": percentile(wait, 90),
                    "gpu_p50": percentile(gpu, 50) if gpu else None,
                    "gpu_mean": b.gpu_sum / b.gpu_count if b.gpu_count else None,
                }
        return out

    def format_table(self, stages: Iterable[str] | None = None) -> str:
        """A fixed-width text table of :meth:`summary` (one row per stage, times in ms)."""
        rows = self.summary(stages)
        head = f"{'stage':<16} {'count':>8} {'p50':>9} {'p90':>9} {'max':>9} {'mean':>9} {'gpu_p50':>9} {'wait_p50':>9}"
        lines = [head, "-" * len(head)]
        for name, s in rows.items():
            gpu = "-" if s["gpu_p50"] is None else f"{s['gpu_p50']:.3f}"
            lines.append(f"{name:<16} {s['count']:>8} {s['p50']:>9.3f} {s['p90']:>9.3f} {s['max']:>9.3f} "
                         f"{s['mean']:>9.3f} {gpu:>9} {s['queue_wait_p50']:>9.3f}")
        return "\n".join(lines)


class _JsonLineFormatter(logging.Formatter):
    """Formats timing lines as-is and every other message as ``{"message": ...}``: pure JSON lines."""

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "timing", None)
        if fields is not None:
            return json.dumps(fields, default=str)
        out: dict[str, Any] = {"message": record.getMessage()}
        summary = getattr(record, "timing_summary", None)
        if summary is not None:
            out["summary"] = summary
        return json.dumps(out, default=str)


def configure_timing_log(path: str | os.PathLike[str] | None) -> logging.Handler | None:
    """Write ``deploy_core.timing`` to a JSON-lines file at ``path`` (CLI helper).

    Sets the logger to DEBUG (every record), stops it propagating (so timing lines do not
    flood the console), and replaces the handler a previous call attached. ``None`` removes that
    handler and restores propagation. Returns the new handler (or None).
    """
    for handler in list(_timing_log.handlers):
        if getattr(handler, "_deploy_core_timing", False):
            _timing_log.removeHandler(handler)
            handler.close()
    if path is None:
        _timing_log.propagate = True
        _timing_log.setLevel(logging.NOTSET)
        return None
    handler = logging.FileHandler(os.fspath(path), mode="a", encoding="utf-8")
    handler.setFormatter(_JsonLineFormatter())
    handler._deploy_core_timing = True  # type: ignore[attr-defined]
    _timing_log.addHandler(handler)
    _timing_log.setLevel(logging.DEBUG)
    _timing_log.propagate = False
    return handler


def configure_timing_log_from_env() -> logging.Handler | None:
    """Call :func:`configure_timing_log` with ``$FP_TIMING_LOG`` when it is set (CLIs only)."""
    path = os.environ.get(TIMING_LOG_ENV)
    return configure_timing_log(path) if path else None
