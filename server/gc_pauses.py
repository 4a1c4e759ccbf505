"""Python's cyclic garbage collector in a latency-bound server: freeze what start-up built, and time every collection.

A full (generation 2) collection walks every object the collector tracks, with the GIL held: every thread of the
process stops meanwhile, the event loop and the threads feeding the GPU included. After start-up the server process
tracks ~270,000 objects even with the tiny CPU config (networks, compiled kernels, caches; more with CUDA and
``torch.compile``), and one full collection of them took ~150 ms on a 2-core machine. Nearly all of them live as long
as the server, so start-up ends with :func:`freeze_startup_objects`: one collection, then ``gc.freeze()`` moves what
is left to the permanent generation, which later collections skip (a full one then takes microseconds). Garbage made
while serving is collected as before. The cost: a cycle of start-up objects dropped later (an object replaced by a
new upload) is not collected; its memory stays until exit.

:class:`GcPauses` times each collection (``gc.callbacks``) for ``/metrics``, so that a pause that remains shows up.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections import deque
from typing import Any

from server.metrics import Family, Histogram

__all__ = ["GC_PAUSE_BUCKETS_S", "GcPauses", "freeze_startup_objects"]

log = logging.getLogger(__name__)

GC_PAUSE_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


def freeze_startup_objects() -> tuple[int, float]:
    """Collect once, then freeze every object left (``gc.freeze``): (objects frozen in all, the collection's ms).
    Call when start-up is done; later collections skip these objects."""
    started = time.perf_counter()
    gc.collect()
    collect_ms = (time.perf_counter() - started) * 1e3
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("gc: froze %d start-up objects (their last full collection took %.1f ms)", frozen, collect_ms)
    return frozen, collect_ms


class GcPauses:
    """Times every collection of this process by generation while installed (:meth:`install` / :meth:`uninstall`).

    The callback runs in whichever thread triggered the collection, with the GIL held, at any allocation: also
    inside this class's own readers, whose allocations can start a collection while they hold ``_lock``. So the
    callback never waits for the lock: it queues its observation (``deque.append`` is atomic) and folds the queue
    into the histograms only when the lock is free at once; readers fold what is left before they read. Collections
    never overlap (the interpreter runs one at a time), so the per-thread start times need no lock either.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the histograms; never waited for inside a collection
        self._started: dict[int, float] = {}  # thread id -> start of its collection in progress
        self._unfolded: deque[tuple[int, float]] = deque()  # (generation, seconds) not yet in the histograms
        self._pauses = {generation: Histogram(GC_PAUSE_BUCKETS_S) for generation in (0, 1, 2)}
        self._longest = dict.fromkeys((0, 1, 2), 0.0)
        self._installed = False

    def install(self) -> None:
        if not self._installed:
            gc.callbacks.append(self._on_gc)
            self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._on_gc)
            self._installed = False

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter()
        thread = threading.get_ident()
        if phase == "start":
            self._started[thread] = now
            return
        started = self._started.pop(thread, None)
        if started is None:  # installed during this collection
            return
        self._unfolded.append((int(info.get("generation", 2)), now - started))
        if self._lock.acquire(blocking=False):  # held (by a reader, perhaps this very thread): it folds this later
            try:
                self._fold()
            finally:
                self._lock.release()

    def _fold(self) -> None:
        """Move the queued observations into the histograms (``_lock`` held)."""
        while True:
            try:
                generation, seconds = self._unfolded.popleft()
            except IndexError:
                return
            self._pauses[generation].observe(seconds)
            self._longest[generation] = max(self._longest[generation], seconds)

    def count(self, generation: int) -> int:
        with self._lock:
            self._fold()
            return self._pauses[generation].count

    def families(self) -> list[Family]:
        pauses = Family("fp_gc_pause_seconds", "histogram",
                        "Collections of Python's cyclic garbage collector in this process and how long each held "
                        "the GIL (every thread stopped), by generation.")
        longest = Family("fp_gc_pause_max_seconds", "gauge", "The longest collection so far, by generation.")
        frozen = Family("fp_gc_frozen_objects", "gauge",
                        "Objects in the permanent generation (frozen after start-up: no collection walks them).")
        with self._lock:
            self._fold()
            for generation, histogram in self._pauses.items():
                histogram.render_into(pauses, (("generation", str(generation)),))
                longest.add(self._longest[generation], generation=generation)
        frozen.add(gc.get_freeze_count())
        return [pauses, longest, frozen]
