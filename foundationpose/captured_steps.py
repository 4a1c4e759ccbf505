"""What the captured track and register runners share: steps on static buffers, kept per key, captured once.

:class:`CapturedSteps` holds a runner's entries (one per key: its static buffers and, on CUDA with everything
capturable, its ``torch.cuda.CUDAGraph``) least recently used first, captures a new entry after two eager warm-up
runs on the runner's stream (lazy library init, constant caches, JIT; every graph in one memory pool), drops the
least recently used beyond ``max_entries``, and replays or runs an entry. A capture that fails is logged once with
its traceback and leaves that entry eager: a capture bug never fails a request. The runners
(:class:`foundationpose.track_graph.TrackGraphRunner`, :class:`foundationpose.register_graph.RegisterGraphRunner`)
hold the lock around every call, so that copy-in, launch and copy-out of one request are enqueued together.
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

__all__ = ["REGISTER_STREAM_PRIORITY", "TRACK_STREAM_PRIORITY", "CapturedSteps", "StepEntry", "StepRunner",
           "WARMUP_RUNS", "runner_stream"]

logger = logging.getLogger(__name__)

WARMUP_RUNS = 2  # eager runs on the capture stream before capture (lazy library init, constant caches, JIT)
# torch stream priorities of the runners' streams (lower = higher; 0 = the default pool of every stage stream). A
# track batch is a few ms of small kernels that a waiting client needs now; a register is ~80 ms of large ones. With
# tracks above registers, the GPU's block scheduler starts a track kernel's blocks before the register's next ones,
# so a register beside 64 track sessions delays them by a kernel, not by the register.
TRACK_STREAM_PRIORITY = -2
REGISTER_STREAM_PRIORITY = -1


def runner_stream(device: torch.device, priority: int) -> torch.cuda.Stream | None:
    """A runner's CUDA stream (None on the CPU), from a high-priority pool (``priority`` < 0). PyTorch hands out
    streams round-robin from a pool of 32 per priority; the default-priority pool is shared with every stage stream
    and renderer of a service, and a capture on a stream another thread also enqueues on would record that thread's
    kernels into the graph. The high-priority pools are the runners' alone (a few per process), and under load the
    GPU schedules their steps ahead of eager work."""
    if priority >= 0:
        raise ValueError(f"a runner's stream needs a high priority (< 0), got {priority}")
    return new_stream(device, priority=priority)


class StepEntry(Protocol):
    obj: Any  # held: the key's id(obj) stays unique while the entry lives
    graph: torch.cuda.CUDAGraph | None


class CapturedSteps:
    """Entries of one runner, keyed by tuples whose first item is ``id(obj)``; see the module docstring.

    stream: the runner's CUDA stream (None on the CPU: nothing is captured). capturable: whether new entries are
    captured (CUDA, a capturable renderer and networks). name: "track" or "register", for the log.
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
            return entry
        entry = make()
        if self.capturable:
            self._capture(entry, key, step)
        self._entries[key] = entry
        while len(self._entries) > self.max_entries:
            if self.stream is not None:  # its replays may still read the buffers the allocator gets back
                self.stream.synchronize()
            dropped, _ = self._entries.popitem(last=False)
            logger.info("%s graph cache full (%d): dropped %s", self.name, self.max_entries, dropped)
        return entry

    def forget(self, obj: Any) -> int:
        """Drop every entry of ``obj`` (graphs and buffers); returns how many. Pending replays finish first."""
        keys = [k for k, e in self._entries.items() if e.obj is obj]
        if keys and self.stream is not None:  # its replays may still read the buffers the allocator gets back
            self.stream.synchronize()
        for k in keys:
            del self._entries[k]
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
        """Warm up on the capture stream, then capture; on failure log once and leave the entry eager."""
        assert self.stream is not None
        try:
            with torch.cuda.device(self.device):
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.stream):
                    for _ in range(WARMUP_RUNS):
                        step(entry)
                self.stream.synchronize()  # constants and scratch made by the warm-up are ready
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool, stream=self.stream, capture_error_mode="thread_local"):
                    step(entry)
                self.stream.synchronize()
        except Exception:  # noqa: BLE001 - a capture bug must not break the service: eager from now on
            self.capture_failures += 1
            if not self._warned:
                self._warned = True
                logger.warning("%s step capture failed for %s; running it eagerly", self.name, key, exc_info=True)
            torch.cuda.synchronize(self.device)
            return
        entry.graph = graph
        self.captures += 1
        logger.info("%s step captured: %s", self.name, key)


class StepRunner:
    """What a runner of captured steps exposes about them (:class:`foundationpose.track_graph.TrackGraphRunner`,
    :class:`foundationpose.register_graph.RegisterGraphRunner`). The subclass calls :meth:`_init_steps` and defines
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
