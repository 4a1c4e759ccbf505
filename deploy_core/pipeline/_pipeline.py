"""BaseAsyncPipeline: stages run by their own threads, joined by bounded queues.

(One module of ~560 lines on purpose: the pipeline's lifecycle, admission and failure paths share one lock
discipline, which is easier to check in one place.)

Lifecycle: ``new`` -> ``running`` (``start()``, ``__enter__`` or the first ``submit``)
-> ``closing`` -> ``closed``; ``broken`` when a stage loop dies. A closed pipeline is
never restarted: build a new one.

Guarantees:

* Every admitted package completes exactly once (result, exception or cancellation)
  through ``Package.finish``, which also releases its lease. Admitted packages are
  kept in ``_inflight`` until then, so aborts and breaks can fail every one of them.
* A stage exception fails only that package, with the original exception annotated
  (note + ``pipeline_stage``); the pipeline keeps serving.
* A dead stage loop marks the pipeline broken: queued and in-flight packages fail
  with ``BrokenPipelineError`` (chained to the cause) and ``submit`` refuses work.
* ``close()``: stop admitting, close the first queue, let every stage drain and close
  its outbox, join the threads (naming any that do not stop in time), log the timing
  summary. ``close(abort=True)``: also fail everything not yet finished with
  ``ClosedError``; packages inside a running ``fn`` fail when it returns.
* ``submit`` blocks while the first queue is full (backpressure); with a ``timeout``
  it raises ``BusyError`` instead.
* Per-key order: futures of one ``key`` settle in submission order, whatever the outcome.
  A package that fails (or is dropped) early releases its lease at once, but its future
  waits until every earlier package of its key has settled.
* Deadlines and cancellation: a package whose ``deadline`` passed, or whose future the
  caller cancelled, is dropped at the next stage boundary (before the next ``fn``), its
  lease returned; its future fails with ``DeadlineError`` (or stays cancelled).
* Slot reuse on CUDA: the package's ``ready_event`` is seeded with the lease's
  ``prior_free_event``, so the first GPU stage's stream waits (GPU-side) for the previous
  lessee's last stream; the lease is released on the package's last stream, even when it
  fails mid-way.
* GPU memory of failed packages: tensors from PyTorch's caching allocator that a package
  still uses on the GPU must outlive that work. On success the host waits for the package
  before completing it. A package that fails or is dropped before that wait keeps its
  ``data`` here, with an event recorded on its last stream, until the event has completed
  (polled with ``query()``, never a host wait; ``close`` waits for the rest). We keep
  tensors alive rather than ``record_stream`` them: a stage cannot miss one.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from typing import Any

from deploy_core.errors import BrokenPipelineError, BusyError, ClosedError, DeployError
from deploy_core.pipeline._config import PipelineConfig, PipelineStats, Stage, StageStats, annotate_failure
from deploy_core.pipeline._package import Package
from deploy_core.pipeline._queue import BlockQueue
from deploy_core.pipeline._runner import _StageRunner
from deploy_core.timing import TIMING_LOGGER_NAME, TimingRecord, TimingRecorder, _Timer

__all__ = ["BaseAsyncPipeline"]

_log = logging.getLogger(__name__)
_timing_log = logging.getLogger(TIMING_LOGGER_NAME)


_DEFAULT_CONFIG = PipelineConfig()


def _data_of(pkg: Package) -> Any:
    return pkg.data


class BaseAsyncPipeline:
    """A pipeline of :class:`Stage` s: asynchronous ``submit`` and synchronous ``run``.

    stages: run in order; names must be unique.
    config: queue capacities, timeouts, stats window.
    pool: a ``MemBufferPool`` (anything with ``acquire(timeout=..., owner=...) -> lease``); when
        given, every package leases one slot before admission, which bounds the
        packages in flight; the lease is released when the package completes.
    result_fn: ``result_fn(pkg)`` gives the future's result (default ``pkg.data``).
    name: used in error messages and notes, timing lines and the summary.

    Futures are plain ``concurrent.futures.Future`` s, settled on a stage thread: done
    callbacks run there, so keep them short (an asyncio server bridges with
    ``loop.call_soon_threadsafe``). A caller may ``cancel()`` a future at any time; the
    package is then skipped at its next stage and its lease returned.

    Example::

        with BaseAsyncPipeline([Stage("decode", decode), Stage("infer", infer)]) as p:
            futures = [p.submit(frame, key=session) for frame in frames]
            results = [f.result() for f in futures]
    """

    def __init__(self, stages: Sequence[Stage], config: PipelineConfig = _DEFAULT_CONFIG,
                 pool: Any = None, result_fn: Callable[[Package], Any] | None = None,
                 name: str = "pipeline") -> None:
        stages = tuple(stages)
        if not stages:
            raise ValueError("a pipeline needs at least one stage")
        for s in stages:
            if not isinstance(s, Stage):
                raise TypeError(f"stages must be Stage objects, got {type(s).__name__}")
        names = [s.name for s in stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names must be unique, got {names}")
        if any(s.in_submitter for s in stages[1:]):
            raise ValueError(f"only the first stage may run in the submitter (in_submitter), got {names}")
        if stages[0].in_submitter and len(stages) < 2:
            raise ValueError("an in_submitter first stage needs a stage after it (it has no thread of its own)")
        self.name = name
        self.stages = stages
        self.config = config
        self.pool = pool
        self._result_fn = result_fn if result_fn is not None else _data_of
        self._recorder = TimingRecorder(window=config.stats_window, name=f"pipeline {name}")
        self._ids = itertools.count(1)
        self._inflight: dict[int, Package] = {}
        self._count_lock = threading.Lock()
        self._n_submitted = 0
        self._lifecycle = threading.Lock()
        self._state = "new"
        self._admitting = True
        # (error type, message, cause) once aborted or broken; read without a lock (one reference)
        self._terminal: tuple[type[DeployError], str, BaseException | None] | None = None
        self._terminal_lock = threading.Lock()
        self._inline_lock = threading.Lock()
        self._inline_ready = False
        # per-key completion order: admitted packages of each key, oldest first, and the keys being drained
        self._order_lock = threading.Lock()
        self._by_key: dict[Hashable, deque[tuple[Package, list[Callable[[], None] | None]]]] = {}
        self._draining: set[Hashable] = set()
        # (event on the package's last stream, package data) of failed packages, until the GPU is past them
        self._gpu_keep: deque[tuple[Any, Any]] = deque()
        self._keep_lock = threading.Lock()
        self._queues: list[BlockQueue[Package]] = []
        for i, s in enumerate(stages):
            src = "submit" if i == 0 else stages[i - 1].name
            cap = s.queue_capacity if s.queue_capacity is not None else config.queue_capacity
            self._queues.append(BlockQueue(cap, name=f"{src}->{s.name}"))
        self._runners = [
            _StageRunner(_Host(self), s, self._queues[i], self._queues[i + 1] if i + 1 < len(stages) else None)
            for i, s in enumerate(stages)
        ]

    # -- lifecycle -------------------------------------------------------------
    @property
    def state(self) -> str:
        return self._state

    @property
    def in_flight(self) -> int:
        """Packages submitted and not yet completed (a cheap read, no lock: a snapshot)."""
        return len(self._inflight)

    @property
    def recorder(self) -> TimingRecorder:
        """The pipeline's :class:`TimingRecorder` (every stage call, both paths)."""
        return self._recorder

    def start(self) -> BaseAsyncPipeline:
        """Start the stage threads and wait until each has run its setup; idempotent.

        Raises ClosedError after close, BrokenPipelineError if a setup failed, and
        TimeoutError if setups take longer than ``config.join_timeout_s``.
        """
        with self._lifecycle:
            if self._state != "new":
                if self._state in ("closing", "closed"):
                    raise ClosedError(f"pipeline {self.name!r} is closed; build a new one")
                if self._state == "broken":
                    raise self._refusal()
                return self
            self._state = "running"
            for runner in self._runners:
                runner.start()
        deadline = time.monotonic() + self.config.join_timeout_s
        for runner in self._runners:
            for _ in range(runner.thread_count):
                if not runner.started.acquire(timeout=max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"pipeline {self.name!r}: stage {runner.stage.name!r} setup did not "
                                       f"finish within {self.config.join_timeout_s} s")
        if self._terminal is not None:
            raise self._terminal_error()
        return self

    def __enter__(self) -> BaseAsyncPipeline:
        return self.start()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(abort=exc_type is not None)

    def close(self, abort: bool = False, timeout: float | None = None) -> None:
        """Stop admitting work and stop the threads; idempotent.

        Graceful (default): every admitted package is processed to completion first.
        abort: fail every package not yet finished with ClosedError (a package inside a
        running ``fn`` fails when ``fn`` returns). timeout: seconds to wait for the
        threads (default ``config.join_timeout_s``); past it a graceful close turns into
        an abort, and TimeoutError names the threads still running (their package and
        lease are released when their ``fn`` returns).
        """
        timeout = self.config.join_timeout_s if timeout is None else timeout
        with self._lifecycle:
            if self._state == "closed":
                return
            started = self._state != "new"
            self._admitting = False
            if self._state != "broken":
                self._state = "closing"
            if abort:
                self._terminate(ClosedError, f"pipeline {self.name!r} was aborted", None)
            else:  # the first queue a thread serves: end of stream flows down from there
                self._queues[1 if self.stages[0].in_submitter else 0].close()
            stuck = self._join(time.monotonic() + timeout) if started else []
            if stuck and not abort:  # escalate; threads blocked behind the stuck one can now leave
                self._terminate(ClosedError, f"pipeline {self.name!r} closed with stuck stages", None)
                stuck = self._join(time.monotonic() + min(1.0, timeout))
            leftovers = self._sweep(lambda: ClosedError(f"pipeline {self.name!r} closed before the package "
                                                        "completed"))
            if leftovers and not stuck:  # only a submit racing this close should get here
                _log.warning("pipeline %r: failed %d packages still pending after every stage stopped",
                             self.name, leftovers)
            if stuck:  # a stuck package must not hold back the later futures of its key forever
                self._settle_all_ready()
            self._release_kept(wait=True)
            self._state = "closed"
        if self.config.log_summary and started and _timing_log.isEnabledFor(logging.INFO):
            names = [s.name for s in self.stages]
            _timing_log.info("pipeline %r timing summary (ms):\n%s", self.name,
                             self._recorder.format_table(names),
                             extra={"timing_summary": {"pipeline": self.name, **self._recorder.summary(names)}})
        if stuck:
            raise TimeoutError(f"pipeline {self.name!r}: threads still running after {timeout} s: "
                               f"{', '.join(stuck)}")

    def _join(self, deadline: float) -> list[str]:
        me = threading.current_thread()
        for runner in self._runners:
            for thread in runner.threads:
                if thread is not me:
                    thread.join(max(0.0, deadline - time.monotonic()))
        return [name for r in self._runners for name in r.stuck_threads() if name != me.name]

    # -- failure paths -----------------------------------------------------------
    def _terminal_error(self) -> DeployError:
        """A fresh error for one package (one instance per future: tracebacks stay separate)."""
        terminal = self._terminal
        if terminal is None:
            return ClosedError(f"pipeline {self.name!r} is closed")
        kind, message, cause = terminal
        err = kind(message)
        err.__cause__ = cause
        return err

    def _terminate(self, kind: type[DeployError], message: str, cause: BaseException | None,
                   on_first: Callable[[], None] | None = None) -> None:
        """Enter the terminal state (first caller wins; ``on_first`` runs for it before anything
        fails) and fail every package not held by a running fn."""
        with self._terminal_lock:
            first = self._terminal is None
            if first:
                self._terminal = (kind, message, cause)
                if kind is BrokenPipelineError and self._state in ("new", "running"):
                    self._state = "broken"
            self._admitting = False
        if first and on_first is not None:
            on_first()
        for q in self._queues:
            q.close()
        self._sweep(self._terminal_error)

    def _sweep(self, make_error: Callable[[], DeployError]) -> int:
        """Fail queued packages and admitted ones no worker holds; return how many were failed."""
        failed = 0
        for q in self._queues:
            for pkg in q.drain():
                failed += pkg.finish(error=make_error())
        held = {id(p) for r in self._runners for p in r.held()}  # read after _terminal was set
        for pkg in list(self._inflight.copy().values()):  # copy(): one C call, consistent snapshot
            if id(pkg) not in held:
                failed += pkg.finish(error=make_error())
        return failed

    def _loop_died(self, stage: str, exc: BaseException, held: Package | None) -> None:
        def first() -> None:  # log once, before any future fails
            _log.error("pipeline %r: stage %r loop died; failing every pending package", self.name, stage,
                       exc_info=exc)

        self._terminate(BrokenPipelineError, f"pipeline {self.name!r}: stage {stage!r} loop died: {exc!r}", exc,
                        on_first=first)
        if held is not None:
            held.finish(error=self._terminal_error())

    def _complete(self, pkg: Package) -> None:
        """After the last stage: settle the future with ``result_fn(pkg)``.

        Once aborted or broken, even a fully processed package fails (every in-flight
        future fails, as documented), so callers see one consistent outcome.
        """
        if self._terminal is not None:
            pkg.finish(error=self._terminal_error())
            return
        try:
            if pkg.ready_event is not None:
                pkg.ready_event.synchronize()
            pkg.synced = True
            result = self._result_fn(pkg)
        except Exception as exc:
            annotate_failure(exc, self.name, "result_fn", pkg)
            pkg.finish(error=exc)
            return
        pkg.finish(result)

    def _finished(self, pkg: Package, settle: Callable[[], None]) -> None:
        """``Package.on_finish``: forget the package, keep a failed one's GPU data alive, settle in key order."""
        self._inflight.pop(pkg.package_id, None)
        if pkg.stream is not None and not pkg.synced:
            self._keep_until_done(pkg)
        self._release_kept(wait=False)
        if pkg.key is None:
            settle()
            return
        key = pkg.key
        with self._order_lock:
            for entry in self._by_key.get(key, ()):
                if entry[0] is pkg:
                    entry[1][0] = settle
                    break
            else:  # not admitted through submit (or already flushed): nothing to order against
                entry = None
            if entry is not None and key in self._draining:
                return  # the thread draining this key settles it in turn
            if entry is not None:
                self._draining.add(key)
        if entry is None:
            settle()
            return
        self._drain_key(key)

    def _drain_key(self, key: Hashable) -> None:
        """Settle the oldest packages of ``key`` while they are finished; one drainer per key at a time,
        settling outside the lock (done callbacks may submit more work)."""
        while True:
            with self._order_lock:
                queue = self._by_key.get(key)
                if not queue or queue[0][1][0] is None:
                    self._draining.discard(key)
                    if queue is not None and not queue:
                        del self._by_key[key]
                    return
                _, slot = queue.popleft()
            settle, slot[0] = slot[0], None
            settle()  # type: ignore[misc]

    def _settle_all_ready(self) -> None:
        """Settle every finished package whatever its key's order (close with a stuck stage)."""
        with self._order_lock:
            ready = [(pkg, slot) for queue in self._by_key.values() for pkg, slot in queue if slot[0] is not None]
            for queue in self._by_key.values():
                kept = [e for e in queue if e[1][0] is None]
                queue.clear()
                queue.extend(kept)
        for _, slot in ready:
            settle, slot[0] = slot[0], None
            if settle is not None:
                settle()

    def _keep_until_done(self, pkg: Package) -> None:
        event = pkg.stream.record_event()  # GPU-side marker after everything queued for the package
        with self._keep_lock:
            self._gpu_keep.append((event, pkg.data))

    def _release_kept(self, wait: bool) -> None:
        """Drop kept data whose GPU work completed (``wait``: wait for all of it; only at close)."""
        with self._keep_lock:
            keep = self._gpu_keep
            while keep:
                event = keep[0][0]
                if wait:
                    event.synchronize()
                elif not event.query():
                    return
                keep.popleft()

    @property
    def kept_for_gpu(self) -> int:
        """Failed packages whose data is still kept alive for their pending GPU work."""
        return len(self._gpu_keep)

    def _refusal(self) -> DeployError:
        """The error for work offered when not admitting: closed wins over broken."""
        if self._state not in ("closing", "closed") and self._terminal is not None \
                and self._terminal[0] is BrokenPipelineError:
            return self._terminal_error()
        return ClosedError(f"pipeline {self.name!r} is closed")

    # -- work --------------------------------------------------------------------
    def submit(self, data: Any, key: Hashable | None = None, timeout: float | None = None, *,
               deadline: float | None = None, wanted: Callable[[], bool] | None = None) -> Future[Any]:
        """Admit ``data`` and return a future for its result; starts the pipeline if needed.

        Blocks while the pool has no free slot or the first queue is full; with
        ``timeout`` (seconds, for both together) raises BusyError instead. Raises
        ClosedError after ``close`` and BrokenPipelineError once a stage loop died.
        deadline: ``time.monotonic()`` seconds; past it the package is dropped at the next
        stage boundary and its future fails with DeadlineError (the lease is returned).
        wanted: asked at every stage boundary; once it returns False the package is dropped
        there and its future cancelled (the lease is returned).
        """
        if self._state == "new":
            self.start()
        if not self._admitting:
            raise self._refusal()
        give_up = None if timeout is None else time.monotonic() + timeout
        package_id = next(self._ids)
        lease = None if self.pool is None else self.pool.acquire(timeout=timeout, owner=f"{self.name}#{package_id}")
        pkg = Package(data, key, lease, package_id=package_id, deadline=deadline, wanted=wanted,
                      on_finish=self._finished,
                      ready_event=getattr(lease, "prior_free_event", None))
        if key is not None:
            with self._order_lock:
                self._by_key.setdefault(key, deque()).append((pkg, [None]))
        self._inflight[pkg.package_id] = pkg
        if not self._admitting:  # closed while we waited for the lease
            err = self._refusal()
            pkg.finish(error=err)
            raise err
        remaining = None if give_up is None else max(0.0, give_up - time.monotonic())
        pkg.enqueued_ns = time.perf_counter_ns()
        if self.stages[0].in_submitter:  # the first stage here, in this thread; then on to the second's queue
            with self._count_lock:
                self._n_submitted += 1
            self._runners[0].run_in_caller(pkg)
            return pkg.future
        try:
            self._queues[0].put(pkg, timeout=remaining)
        except BusyError as exc:
            pkg.finish(cancel=True)
            raise BusyError(f"pipeline {self.name!r} is full: no room within {timeout} s") from exc
        except ClosedError:
            err = self._refusal()
            pkg.finish(error=err)
            raise err from None
        with self._count_lock:
            self._n_submitted += 1
        return pkg.future

    def run(self, data: Any, key: Hashable | None = None, timeout: float | None = None) -> Any:
        """Run every stage inline on the caller's thread and return ``result_fn(pkg)``.

        The reference path: same stages, same exception types and notes as ``submit``;
        no threads or queues are used (it works before ``start``), streams are ignored.
        With a pool, leases a slot first (``timeout`` as in ``submit``).
        Raises ClosedError after ``close``.
        """
        if self._state in ("closing", "closed"):
            raise ClosedError(f"pipeline {self.name!r} is closed")
        self._inline_setup()
        package_id = next(self._ids)
        lease = None if self.pool is None else self.pool.acquire(timeout=timeout, owner=f"{self.name}#{package_id}")
        pkg = Package(data, key, lease, package_id=package_id)
        prior_free = getattr(lease, "prior_free_event", None)
        if prior_free is not None:  # the caller's current stream waits for the slot's previous lessee
            import torch

            torch.cuda.current_stream().wait_event(prior_free)
        extra: dict[str, Any] = {"pipeline": self.name, "path": "sync"}
        if key is not None:
            extra["key"] = key
        add = self._recorder.add
        where = "result_fn"
        try:
            for stage in self.stages:
                if pkg.done:
                    break
                where = stage.name
                timer = _Timer(stage.name, pkg.package_id, None, 0.0, add, dict(extra))
                try:
                    with timer:
                        stage.fn(pkg)
                finally:
                    if timer.record is not None:
                        pkg.timings.append(timer.record)
            where = "result_fn"
            if not pkg.done:
                pkg.finish(self._result_fn(pkg))
        except Exception as exc:
            annotate_failure(exc, self.name, where, pkg)
            pkg.finish(error=exc)
            raise
        finally:
            if not pkg.done:  # KeyboardInterrupt and friends: still return the lease
                pkg.finish(cancel=True)
        return pkg.future.result()

    __call__ = run

    def _inline_setup(self) -> None:
        if self._inline_ready:
            return
        with self._inline_lock:
            if not self._inline_ready:
                for stage in self.stages:
                    if stage.setup is not None:
                        stage.setup()
                self._inline_ready = True

    # -- introspection -------------------------------------------------------------
    def stats(self) -> PipelineStats:
        """Per-stage counts, errors, busy time, queue-wait and wall percentiles, queue depths."""
        names = [s.name for s in self.stages]
        summary = self._recorder.summary(names, wait=False)
        out = []
        for stage, q in zip(self.stages, self._queues, strict=True):
            s = summary.get(stage.name)
            out.append(StageStats(
                name=stage.name, workers=stage.workers,
                count=int(s["count"]) if s else 0, errors=int(s["errors"]) if s else 0,
                busy_ms_total=float(s["busy_ms"]) if s else 0.0,
                queue_wait_p50_ms=float(s["queue_wait_p50"]) if s else 0.0,
                queue_wait_p90_ms=float(s["queue_wait_p90"]) if s else 0.0,
                wall_p50_ms=float(s["p50"]) if s else 0.0, wall_p90_ms=float(s["p90"]) if s else 0.0,
                gpu_p50_ms=s["gpu_p50"] if s else None,  # type: ignore[arg-type]
                queue_depth=len(q), queue_capacity=q.capacity))
        return PipelineStats(self.name, self._state, self._n_submitted, len(self._inflight), tuple(out))

    def queues(self) -> tuple[BlockQueue[Package], ...]:
        """The input queue of every stage, in stage order (for tests and monitoring)."""
        return tuple(self._queues)

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} {self.name!r} {self._state}, stages="
                f"{[s.name for s in self.stages]}, in_flight={len(self._inflight)}>")


class _Host:
    """The :class:`~deploy_core.pipeline._runner.StageHost` view of a pipeline that its stage runners use."""

    __slots__ = ("_pipeline", "name")

    def __init__(self, pipeline: BaseAsyncPipeline) -> None:
        self._pipeline = pipeline
        self.name = pipeline.name

    def terminated(self) -> bool:
        return self._pipeline._terminal is not None

    def failure(self) -> DeployError:
        return self._pipeline._terminal_error()

    def add_timing(self, record: TimingRecord) -> None:
        self._pipeline._recorder.add(record)

    def complete(self, pkg: Package) -> None:
        self._pipeline._complete(pkg)

    def loop_died(self, stage: str, exc: BaseException, held: Package | None) -> None:
        self._pipeline._loop_died(stage, exc, held)
