"""CUDA-graph capture, written once: the capture procedure and a runner's cache of captured steps.

:func:`capture_graph` warms a function up on a side stream (lazy library initialisation, constant caches, JIT),
then captures one run of it as a ``torch.cuda.CUDAGraph`` in a given memory pool. Everything that captures uses it:
the inference cores' per-batch network graphs (:mod:`deploy_core.infer._cuda_graph`) and the whole-step runners
built on :class:`StepRunner` (an application's register and track steps).

:class:`CapturedSteps` holds a runner's entries (one per key: its static buffers and, where capturable, its graph)
least recently used first, captures a new entry once (after :data:`WARMUP_RUNS` eager runs on the runner's stream;
every graph of the runner in one memory pool), drops the least recently used beyond ``max_entries``, and replays or
runs an entry. A capture that fails leaves that entry eager (a capture bug never fails a request) and is tried again
on the entry's next use, up to :data:`CAPTURE_ATTEMPTS` in all: a failure caused by something else the process did
at that moment heals; one of the step itself stays eager after a few tries. The first failure is logged with its
traceback. The runner holds its lock around every call, so that copy-in, launch and copy-out of one
request are enqueued together.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import torch

from deploy_core.cuda import new_stream

__all__ = ["CAPTURE_ATTEMPTS", "CapturedSteps", "StepEntry", "StepRunner", "WARMUP_RUNS", "capture_graph",
           "runner_stream"]

logger = logging.getLogger(__name__)

WARMUP_RUNS = 2  # eager runs on the capture stream before capture (lazy library init, constant caches, JIT)
CAPTURE_ATTEMPTS = 3  # captures tried per entry (its first use, then its next uses after a failure)


# One capture at a time in the process: a capture's warm-up allocates and synchronises its stream, and two runners
# capturing at once (a track prepare beside a first register) must not see each other's half-built graphs.
_CAPTURE_LOCK = threading.Lock()


def capture_graph(run: Callable[[], Any], device: torch.device, stream: torch.cuda.Stream, *,
                  pool: Any = None, warmup_runs: int = WARMUP_RUNS) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Warm ``run`` up ``warmup_runs`` times on ``stream`` (after the current stream's prior work), then capture one
    call of it; returns ``(graph, what the captured call returned)`` (its tensors live in the graph's pool and are
    rewritten by every replay). ``run`` must be capturable: no host synchronisation, no data-dependent shapes.

    Synchronises ``stream`` only, never the device: the capture begins with ``CUDAGraph.capture_begin`` in
    ``thread_local`` mode rather than ``torch.cuda.graph``, whose entry synchronises the whole device and empties
    the allocator's cache, which fails (and breaks) a capture running in another thread. Captures of the process
    run one at a time. Raises what the capture raised."""
    with _CAPTURE_LOCK, torch.cuda.device(device):
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(warmup_runs):
                run()
            stream.synchronize()  # constants and scratch made by the warm-up are ready
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                out = run()
            except BaseException:
                try:  # end the broken capture so the stream takes work again; the step's error is the one raised
                    graph.capture_end()
                except Exception:  # noqa: BLE001 - an invalidated capture ends with an error of its own
                    pass
                raise
            graph.capture_end()
        stream.synchronize()
    return graph, out


def runner_stream(device: torch.device, priority: int) -> torch.cuda.Stream | None:
    """A runner's CUDA stream (None on the CPU), from a high-priority pool (``priority`` < 0). PyTorch hands out
    streams round-robin from a pool of 32 per priority; the default-priority pool is shared with every stage stream
    of a process, and a capture on a stream another thread also enqueues on would record that thread's kernels into
    the graph. The high-priority pools are the runners' alone (a few per process), and under load the GPU schedules
    their steps ahead of eager work."""
    if priority >= 0:
        raise ValueError(f"a runner's stream needs a high priority (< 0), got {priority}")
    return new_stream(device, priority=priority)


class StepEntry(Protocol):
    obj: Any  # held: the key's id(obj) stays unique while the entry lives
    graph: torch.cuda.CUDAGraph | None


class CapturedSteps:
    """Entries of one runner, keyed by tuples whose first item is ``id(obj)``; see the module docstring.

    stream: the runner's CUDA stream (None on the CPU: nothing is captured). capturable: whether new entries are
    captured (the runner decides: CUDA and a capturable step). name: the runner's kind, for the log.
    Not thread-safe on its own: the owner holds its lock around every method.
    """

    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None, *, capturable: bool,
                 max_entries: int, name: str) -> None:
        self.device = device
        self.stream = stream
        self.capturable = bool(capturable and stream is not None)
        self.max_entries = max_entries
        self.name = name
        self._pool = torch.cuda.graph_pool_handle() if self.capturable else None
        self._entries: OrderedDict[tuple, Any] = OrderedDict()
        self._warned = False
        self.captures = 0  # graphs captured so far (a new key costs one)
        self.capture_failures = 0
        self._failed: dict[tuple, int] = {}  # keys whose capture failed, and how many times (while eager)

    def keys(self) -> list[tuple]:
        """The cached keys, least recently used first."""
        return list(self._entries)

    def __contains__(self, key: tuple) -> bool:
        return key in self._entries

    def is_graphed(self, key: tuple) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.graph is not None

    def get(self, key: tuple, make: Callable[[], Any], step: Callable[[Any], None]) -> Any:
        """The entry of ``key``, made by ``make()`` (and captured running ``step(entry)``) when new; the least
        recently used entries beyond ``max_entries`` are dropped (after the stream's pending replays)."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            if entry.graph is None and 0 < self._failed.get(key, 0) < CAPTURE_ATTEMPTS:
                self._capture(entry, key, step)  # its capture failed before: tried again
            return entry
        entry = make()
        if self.capturable:
            self._capture(entry, key, step)
        self._entries[key] = entry
        while len(self._entries) > self.max_entries:
            if self.stream is not None:  # its replays may still read the buffers the allocator gets back
                self.stream.synchronize()
            dropped, _ = self._entries.popitem(last=False)
            self._failed.pop(dropped, None)
            logger.info("%s graph cache full (%d): dropped %s", self.name, self.max_entries, dropped)
        return entry

    def forget(self, obj: Any) -> int:
        """Drop every entry of ``obj`` (graphs and buffers); returns how many. Pending replays finish first."""
        return self.forget_where(lambda e: e.obj is obj, obj)

    def forget_where(self, drop: Callable[[Any], bool], obj: Any = None) -> int:
        """Drop every entry for which ``drop(entry)`` is true (graphs and buffers); returns how many. Pending
        replays finish first. obj: named in the log line."""
        keys = [k for k, e in self._entries.items() if drop(e)]
        if keys and self.stream is not None:  # its replays may still read the buffers the allocator gets back
            self.stream.synchronize()
        for k in keys:
            del self._entries[k]
            self._failed.pop(k, None)
        if keys:
            logger.info("%s graphs of obj=%s dropped: %d", self.name, id(obj), len(keys))
        return len(keys)

    @staticmethod
    def launch(entry: Any, step: Callable[[Any], None]) -> bool:
        """Replay the entry's graph (or run ``step(entry)`` eagerly) on the current stream; True when replayed."""
        if entry.graph is not None:
            entry.graph.replay()
            return True
        step(entry)
        return False

    def _capture(self, entry: Any, key: tuple, step: Callable[[Any], None]) -> None:
        """Warm up on the capture stream, then capture; on failure the entry stays eager (and counts the attempt)."""
        assert self.stream is not None
        try:
            graph, _ = capture_graph(lambda: step(entry), self.device, self.stream, pool=self._pool)
        except Exception:  # noqa: BLE001 - a capture bug must not break the service: eager meanwhile
            self.capture_failures += 1
            attempts = self._failed[key] = self._failed.get(key, 0) + 1
            then = "tried again on its next use" if attempts < CAPTURE_ATTEMPTS else "eager from now on"
            logger.warning("%s step capture failed for %s (attempt %d of %d); running it eagerly, %s", self.name, key,
                           attempts, CAPTURE_ATTEMPTS, then, exc_info=not self._warned)
            self._warned = True
            try:
                self.stream.synchronize()  # the failed warm-up's work: this stream's only, never the device's
            except Exception as exc:  # noqa: BLE001 - the eager step that follows reports a broken stream itself
                logger.warning("%s stream synchronise after a failed capture: %s", self.name, exc)
            return
        entry.graph = graph
        self.captures += 1
        retried = self._failed.pop(key, 0)
        logger.info("%s step captured: %s%s", self.name, key, f" (after {retried} failed)" if retried else "")


class StepRunner:
    """What a runner of captured steps exposes about them. The subclass calls :meth:`_init_steps` and defines
    ``_step(entry)``, the function that is captured."""

    _stream: torch.cuda.Stream | None
    _steps: CapturedSteps

    def _init_steps(self, device: torch.device, *, capturable: bool, max_entries: int, name: str,
                    priority: int, stream: torch.cuda.Stream | None = None) -> None:
        """``stream``: the runner's own stream where given (e.g. an SM partition's), else a new one of ``priority``."""
        if stream is None and device.type == "cuda":
            stream = runner_stream(device, priority)
        self._stream = stream
        self._steps = CapturedSteps(device, self._stream, capturable=capturable, max_entries=max_entries, name=name)
        self._lock = threading.Lock()  # submissions are serialised: one stream, one memory pool

    def _step(self, entry: Any) -> None:
        raise NotImplementedError

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The CUDA stream every copy and replay is enqueued on (None on the CPU)."""
        return self._stream

    @property
    def captures(self) -> int:
        """Graphs captured so far (a new key costs one)."""
        return self._steps.captures

    @property
    def capture_failures(self) -> int:
        return self._steps.capture_failures

    def keys(self) -> list[tuple]:
        """Cached keys (``(id(obj), size, H, W, iterations)``), least recently used first."""
        return self._steps.keys()

    def is_graphed(self, key: tuple) -> bool:
        return self._steps.is_graphed(key)

    def forget(self, obj: Any) -> int:
        """Drop every entry of ``obj`` (graphs and buffers); returns how many. Pending replays finish first."""
        with self._lock:
            return self._steps.forget(obj)

    def forget_where(self, drop: Callable[[Any], bool], obj: Any = None) -> int:
        """Drop every entry for which ``drop(entry)`` is true; returns how many. Pending replays finish first."""
        with self._lock:
            return self._steps.forget_where(drop, obj)

    def _launch(self, entry: Any) -> bool:
        """Replay the entry's graph (or run the step eagerly) on the current stream; True when replayed."""
        return self._steps.launch(entry, self._step)

    def _timed_launch(self, entry: Any, copy_in: Callable[[], None] | None = None) -> tuple[float | None, float]:
        """One launch of ``entry`` (after ``copy_in``, untimed, on the same stream): ``(GPU ms from events around it
        on the runner's stream, None on the CPU; the host's ms in the launch call)``. Synchronises: bench only; the
        caller holds the lock."""
        device = self._steps.device
        if self._stream is None:
            if copy_in is not None:
                copy_in()
            t0 = time.perf_counter()
            self._launch(entry)
            return None, (time.perf_counter() - t0) * 1e3
        with torch.cuda.device(device):
            self._stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._stream):
                if copy_in is not None:
                    copy_in()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(self._stream)
                t0 = time.perf_counter()
                self._launch(entry)
                wall = (time.perf_counter() - t0) * 1e3
                end.record(self._stream)
        end.synchronize()
        return start.elapsed_time(end), wall
