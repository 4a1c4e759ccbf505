"""The event loop's health: how late its timers run, and a warning with its stack when it stops running.

Everything the server answers passes through one asyncio event loop per process. Work that holds it (a decode on
the loop, a lock wait, a long garbage collection) delays every connection at once, and a loop that never comes back
(a deadlock) leaves clients waiting with nothing in the log. :class:`LoopWatch` schedules a timer on the loop every
``beat_s`` and measures how late it ran (``fp_event_loop_lag_seconds``); a daemon thread checks the last beat, and
when none came for ``stall_s`` it logs a warning with the loop thread's current stack, once per stall
(``fp_event_loop_stalls_total``), and again when the loop runs again. The thread needs the GIL to report: a loop
blocked in a call that holds the GIL is reported once that call returns.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

from deploy_core.thread_names import name_native_thread
from server.metrics import Family, Histogram

__all__ = ["LOOP_BEAT_S", "LOOP_LAG_BUCKETS_S", "LoopStats", "LoopWatch", "loop_families"]

log = logging.getLogger(__name__)

LOOP_BEAT_S = 0.1  # the timer period: lag is measured this often
LOOP_LAG_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class LoopWatch:
    """Watches one event loop from :meth:`start` (called on the loop) to :meth:`stop`.

    stall_s: no beat for this long is a stall (a warning with the loop's stack). beat_s: the timer's period; its
    lateness is observed each beat. name: the process's part, in the log lines (``server``, ``ingest worker 3``).
    """

    def __init__(self, stall_s: float, beat_s: float = LOOP_BEAT_S, name: str = "server") -> None:
        if not stall_s > 0 or not 0 < beat_s < stall_s:
            raise ValueError(f"need stall_s > beat_s > 0, got stall_s={stall_s!r}, beat_s={beat_s!r}")
        self.stall_s, self.beat_s, self.name = stall_s, beat_s, name
        self._cond = threading.Condition()  # guards the lag histogram and the counters; notified when they change
        self._lag = Histogram(LOOP_LAG_BUCKETS_S)
        self._stalls = 0
        self._stalled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._due = 0.0  # when the pending beat should run (perf_counter)
        self._last_beat = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def start(self) -> None:
        """Begin on the running loop (call from a coroutine or callback of it); again after :meth:`stop`, on this
        loop or another (an app whose lifespan runs twice). The counters go on."""
        if self._watcher is not None and not self._stop.is_set():
            return
        self._stop = threading.Event()
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        with self._cond:
            self._last_beat, self._stalled = time.perf_counter(), False
        self._schedule()
        self._watcher = threading.Thread(target=self._watch, args=(self._stop,), name="fp-loop-watch", daemon=True)
        self._watcher.start()

    def stop(self) -> None:
        """End the beats and the watcher (from the loop's thread or any other)."""
        self._stop.set()
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=5.0)

    @property
    def watching(self) -> bool:
        """Whether the watcher thread runs (between :meth:`start` and :meth:`stop`)."""
        return self._watcher is not None and self._watcher.is_alive()

    # single reads, without the lock: wait_until's predicates read them while it holds it
    @property
    def stalls(self) -> int:
        """Stalls so far."""
        return self._stalls

    @property
    def beats(self) -> int:
        """Timer runs observed so far."""
        return self._lag.count

    @property
    def stalled(self) -> bool:
        """Whether the loop is stalled now."""
        return self._stalled

    def wait_until(self, predicate, timeout: float) -> bool:
        """Block (a thread, not the loop) until ``predicate(self)`` holds (it reads the properties above); False
        after ``timeout`` s."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self), timeout)

    # -- on the loop -------------------------------------------------------------------------------
    def _schedule(self) -> None:
        if self._stop.is_set() or self._loop is None:
            return
        self._due = time.perf_counter() + self.beat_s
        self._timer = self._loop.call_later(self.beat_s, self._beat)

    def _beat(self) -> None:
        now = time.perf_counter()
        lag = max(0.0, now - self._due)
        with self._cond:
            self._lag.observe(lag)
            self._last_beat = now
            if self._stalled:  # logged before the state changes: whoever waits for it finds the line
                log.warning("%s: the event loop runs again after %.2f s without running its timers", self.name,
                            lag + self.beat_s)
            self._stalled = False
            self._cond.notify_all()
        self._schedule()

    # -- the watcher thread ------------------------------------------------------------------------
    def _watch(self, stop: threading.Event) -> None:
        name_native_thread()  # "fp-loop-watch" in top -H and tools/proc_cpu.py
        check_s = min(self.beat_s * 2, self.stall_s / 4)
        while not stop.wait(check_s):
            with self._cond:
                last_beat, stalled = self._last_beat, self._stalled
            behind = time.perf_counter() - last_beat
            if behind < self.stall_s or stalled:
                continue
            frame = sys._current_frames().get(self._loop_thread)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "(its thread has ended)\n"
            log.warning("%s: the event loop has not run its timers for %.1f s; every connection waits. "
                        "Its thread is at:\n%s", self.name, behind, stack.rstrip())
            with self._cond:  # counted once logged (tests wait for the count, then read the log)
                self._stalls += 1
                self._stalled = self._last_beat == last_beat  # not when the loop ran meanwhile
                self._cond.notify_all()

    # -- /metrics ----------------------------------------------------------------------------------
    def snapshot(self) -> LoopStats:
        """The counters now (an ingest worker sends them to the GPU process's ``/metrics``)."""
        with self._cond:
            return LoopStats(list(self._lag.counts), self._lag.count, self._lag.sum, self._stalls, int(self._stalled))

    def families(self) -> list[Family]:
        return loop_families(self.snapshot(), "fp_event_loop", "this process's event loop", self.beat_s, self.stall_s)


@dataclass(frozen=True, slots=True)
class LoopStats:
    """A :class:`LoopWatch`'s counters: the lag histogram's per-bucket counts (not cumulative), its count and sum,
    the stalls so far and whether it is stalled now (1 / 0; summed over several loops, how many are)."""

    counts: list[int]
    count: int
    sum: float
    stalls: int
    stalled: int

    @classmethod
    def empty(cls) -> LoopStats:
        return cls([0] * len(LOOP_LAG_BUCKETS_S), 0, 0.0, 0, 0)

    @classmethod
    def of(cls, fields: Any) -> LoopStats:
        """From the list :meth:`as_list` made (another process's); ValueError when it does not fit."""
        counts, count, total, stalls, stalled = fields
        if len(counts) != len(LOOP_LAG_BUCKETS_S):
            raise ValueError(f"{len(counts)} lag buckets, expected {len(LOOP_LAG_BUCKETS_S)}")
        return cls([int(n) for n in counts], int(count), float(total), int(stalls), int(stalled))

    def as_list(self) -> list[Any]:
        return [self.counts, self.count, self.sum, self.stalls, self.stalled]

    def __add__(self, other: LoopStats) -> LoopStats:
        return LoopStats([a + b for a, b in zip(self.counts, other.counts, strict=True)], self.count + other.count,
                         self.sum + other.sum, self.stalls + other.stalls, self.stalled + other.stalled)


def loop_families(stats: LoopStats, prefix: str, whose: str, beat_s: float, stall_s: float) -> list[Family]:
    """``<prefix>_lag_seconds`` (histogram), ``<prefix>_stalls_total`` and ``<prefix>_stalled`` of ``stats``; whose:
    the loops they count, for the help texts ("this process's event loop")."""
    lag = Family(f"{prefix}_lag_seconds", "histogram",
                 f"How late {whose} ran a timer due every {beat_s:g} s: the time other work held it (every "
                 "connection it serves waits meanwhile).")
    histogram = Histogram(LOOP_LAG_BUCKETS_S)
    histogram.counts, histogram.count, histogram.sum = list(stats.counts), stats.count, stats.sum
    histogram.render_into(lag, ())
    return [lag,
            Family(f"{prefix}_stalls_total", "counter",
                   f"Times {whose} ran no timer for {stall_s:g} s or more (each logged with its stack).")
            .add(stats.stalls),
            Family(f"{prefix}_stalled", "gauge", f"{whose[:1].upper()}{whose[1:]} stalled now (how many loops).").add(stats.stalled)]
