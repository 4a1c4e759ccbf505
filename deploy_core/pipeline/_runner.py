"""The threads that serve one stage: take from the inbox, run ``fn``, hand on.

Guarantees and the races they avoid (read with ``_pipeline.py``):

* A package that fails in ``fn`` (any ``Exception``) fails its own future with the
  original exception, annotated, and the loop serves the next package.
* Before each ``fn`` a package whose future was cancelled (or that is no longer ``wanted``),
  or whose ``deadline`` passed,
  is dropped (cancelled / ``DeadlineError``) and its lease returned.
* Anything else escaping the loop (a ``BaseException`` from ``fn``, or a bug here) is
  a dead loop: the pipeline is marked broken and every pending future is failed
  (``BaseAsyncPipeline._terminate``). The dying thread fails the package it held.
* ``current[slot]`` names the package a worker holds. A worker publishes it *before*
  it checks the pipeline's terminal state; ``_terminate`` sets that state *before* it
  reads ``current``. So for every package either the worker sees the terminal state
  and does not run ``fn``, or the terminator sees the package held and leaves it to
  the worker, which fails it once ``fn`` returns. Nobody releases the lease of a
  package whose ``fn`` is still running.
* With ``workers > 1`` each package gets a sequence number when it is taken (under a
  lock), and leaves through a reorder buffer in that order; failed or skipped
  packages retire their number so later ones are never stuck behind them.
* The last worker of a stage to exit closes the outbox, so the next stage sees end of
  stream only after everything upstream is through.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

from deploy_core.errors import ClosedError, DeadlineError, DeployError
from deploy_core.pipeline._config import Stage, annotate_failure
from deploy_core.pipeline._package import Package
from deploy_core.pipeline._queue import BlockQueue
from deploy_core.thread_names import name_native_thread
from deploy_core.timing import TimingRecord, _Timer

__all__ = ["StageHost"]

_log = logging.getLogger(__name__)


class StageHost(Protocol):
    """What a stage runner needs from the pipeline that owns it (the pipeline hands it an adapter)."""

    name: str

    def terminated(self) -> bool:
        """Whether the pipeline was aborted or broke (its packages fail from then on)."""
        ...

    def failure(self) -> DeployError:
        """A fresh error for one package that cannot go on: the pipeline's terminal error, else ClosedError."""
        ...

    def add_timing(self, record: TimingRecord) -> None:
        """Collect one stage timing."""
        ...

    def complete(self, pkg: Package) -> None:
        """Settle ``pkg`` after the last stage."""
        ...

    def loop_died(self, stage: str, exc: BaseException, held: Package | None) -> None:
        """A stage's loop itself raised: break the pipeline, fail ``held`` and everything pending."""
        ...


class _StageRunner:
    """Owns the worker threads of one stage."""

    def __init__(self, pipeline: StageHost, stage: Stage, inbox: BlockQueue[Package],
                 outbox: BlockQueue[Package] | None) -> None:
        self.pipeline = pipeline
        self.stage = stage
        self.inbox = inbox
        self.outbox = outbox
        self.threads: list[threading.Thread] = []
        self.current: list[Package | None] = [None] * stage.workers
        self.started = threading.Semaphore(0)
        self._exit_lock = threading.Lock()
        self._running = stage.workers
        # workers > 1: sequence numbers in, reorder buffer out
        self._take_lock = threading.Lock()
        self._order_lock = threading.Lock()
        self._next_in = 0
        self._next_out = 0
        self._parked: dict[int, Package | None] = {}
        # an in_submitter stage: the packages inside fn in submitting threads (held, like current[slot])
        self._in_callers: set[Package] = set()
        self._callers_lock = threading.Lock()

    @property
    def thread_count(self) -> int:
        """Threads this stage starts (0 for an in_submitter stage: it runs in the submitters')."""
        return 0 if self.stage.in_submitter else self.stage.workers

    def start(self) -> None:
        if self.stage.in_submitter:
            return
        n = self.stage.workers
        for slot in range(n):
            name = f"fp-{self.stage.name}" if n == 1 else f"fp-{self.stage.name}-{slot}"
            # Daemon: close() joins every thread, but a stage stuck in a long call past close()'s timeout
            # must not keep the process alive (a SIGTERM'd server would hang until the call returns).
            thread = threading.Thread(target=self._serve, args=(slot,), name=name, daemon=True)
            self.threads.append(thread)
            thread.start()

    # -- thread body -----------------------------------------------------------
    def _serve(self, slot: int) -> None:
        name_native_thread()
        stage = self.stage
        ready = False
        try:
            if stage.setup is not None:
                stage.setup()
            stream = stage.stream_factory() if stage.stream_factory is not None else None
            self.started.release()
            ready = True
            if stage.workers == 1:
                self._loop_single(slot, stream)
            else:
                self._loop_ordered(slot, stream)
        except BaseException as exc:  # the loop itself died: fail everything, refuse new work
            held, self.current[slot] = self.current[slot], None
            try:
                self.pipeline.loop_died(stage.name, exc, held)
            finally:
                if not ready:  # after loop_died, so start() sees the broken state
                    self.started.release()
        finally:
            if stage.teardown is not None:
                try:
                    stage.teardown()
                except Exception:
                    _log.exception("stage %r: teardown failed in thread %s", stage.name,
                                   threading.current_thread().name)
            with self._exit_lock:
                self._running -= 1
                last = self._running == 0
            if last and self.outbox is not None:
                self.outbox.close()

    def _loop_single(self, slot: int, stream: Any) -> None:
        get = self.inbox.get
        current = self.current
        process = self._process
        deliver = self._deliver
        while True:
            try:
                pkg = get()
            except ClosedError:
                return
            current[slot] = pkg
            if process(pkg, stream):
                deliver(pkg)
            current[slot] = None

    def _loop_ordered(self, slot: int, stream: Any) -> None:
        while True:
            with self._take_lock:
                try:
                    pkg = self.inbox.get()
                except ClosedError:
                    return
                seq = self._next_in
                self._next_in += 1
            self.current[slot] = pkg
            keep = self._process(pkg, stream)
            with self._order_lock:
                self._parked[seq] = pkg if keep else None
                while self._next_out in self._parked:
                    ready = self._parked.pop(self._next_out)
                    self._next_out += 1
                    if ready is not None:
                        self._deliver(ready)
            self.current[slot] = None

    # -- one package -----------------------------------------------------------
    def _process(self, pkg: Package, stream: Any) -> bool:
        """Run the stage on ``pkg``; True when it should be handed on."""
        pipeline = self.pipeline
        if pipeline.terminated():
            pkg.finish(error=pipeline.failure())
            return False
        if pkg.done or (pkg.wanted is not None and not pkg.wanted()):
            # the caller cancelled the future (or nobody wants it), or an earlier stage finished it
            pkg.finish(cancel=True)
            return False
        if pkg.deadline is not None and time.monotonic() >= pkg.deadline:  # nobody waits for it any more
            late_ms = (time.monotonic() - pkg.deadline) * 1e3
            pkg.finish(error=DeadlineError(
                f"pipeline {pipeline.name!r}: package {pkg.package_id} passed its deadline {late_ms:.1f} ms "
                f"before stage {self.stage.name!r}; dropped"))
            return False
        now = time.perf_counter_ns()
        extra: dict[str, Any] = {"pipeline": pipeline.name}
        if pkg.key is not None:
            extra["key"] = pkg.key
        timer = _Timer(self.stage.name, pkg.package_id, stream, (now - pkg.enqueued_ns) / 1e6,
                       pipeline.add_timing, extra)
        try:
            if stream is None:
                with timer:
                    self.stage.fn(pkg)
            else:
                self._run_on_stream(pkg, stream, timer)
        except Exception as exc:
            if timer.record is not None:
                pkg.timings.append(timer.record)
            annotate_failure(exc, pipeline.name, self.stage.name, pkg)
            pkg.finish(error=exc)
            return False
        pkg.timings.append(timer.record)  # type: ignore[arg-type]
        return not pkg.done

    def _run_on_stream(self, pkg: Package, stream: Any, timer: _Timer) -> None:
        import torch  # only GPU stages get here

        pkg.stream = stream  # from now on the lease is released on this stream
        with torch.cuda.stream(stream):
            if pkg.ready_event is not None:
                stream.wait_event(pkg.ready_event)
            with timer:
                self.stage.fn(pkg)
            pkg.ready_event = stream.record_event()

    def _deliver(self, pkg: Package) -> None:
        """Hand ``pkg`` to the next stage, or complete it after the last one."""
        outbox = self.outbox
        if outbox is None:
            self.pipeline.complete(pkg)
            return
        pkg.enqueued_ns = time.perf_counter_ns()
        try:
            outbox.put(pkg)
        except ClosedError:  # only closed early when the pipeline aborts or breaks
            pkg.finish(error=self.pipeline.failure())

    def stuck_threads(self) -> list[str]:
        return [t.name for t in self.threads if t.is_alive()]

    def held(self) -> list[Package]:
        with self._callers_lock:
            in_callers = list(self._in_callers)
        return [p for p in list(self.current) if p is not None] + in_callers

    def run_in_caller(self, pkg: Package) -> None:
        """An in_submitter stage: run ``fn`` on ``pkg`` in this (the submitting) thread and hand it on, with the
        guarantees of a worker. The package is published as held before ``_process`` checks the terminal state
        (as ``current[slot]`` is), so a concurrent abort leaves it to this thread, which fails it once ``fn``
        returns (``_deliver`` into a closed queue)."""
        with self._callers_lock:
            self._in_callers.add(pkg)
        try:
            if self._process(pkg, None):
                self._deliver(pkg)
        finally:
            with self._callers_lock:
                self._in_callers.discard(pkg)

