"""Dynamic batching in front of a pipeline: many small requests, one package per batch.

A :class:`MicroBatcher` owns one collector thread. It takes the oldest waiting request,
then keeps collecting until it has ``max_batch`` requests or ``max_wait_s`` has passed
since that first request, and submits the list as one package to the pipeline (whose
stages work on the whole batch, e.g. one network call for all of it). When the package
completes, each request's future gets its own entry of the result list: a value, or an
exception instance for a request that failed alone. A package that fails as a whole fails
every request in it with the same exception.

Guarantees: every submitted future completes exactly once (result, error or cancellation
at close); requests leave in the order they came, so per-key order holds as long as the
pipeline keeps order; ``submit`` blocks (or raises BusyError with a timeout) when
``capacity`` requests are already waiting, and raises ClosedError after ``close``.

* The collector is guarded like a stage loop: if it dies, every waiting request fails
  with ``BrokenPipelineError`` (chained to the cause), the batcher is broken and later
  submits raise that error.
* When the pipeline is full, the collector waits on its own condition, woken by the
  completion of one of its batches or by ``close`` (no polling). The batcher must be the
  only submitter of its pipeline: room appears when one of its batches completes.
* Deadlines and cancellation: a request whose ``deadline`` passed, or whose future the
  caller cancelled, is dropped before it joins a batch. A batch whose requests were all
  cancelled is cancelled in the pipeline (dropped at its next stage boundary, its slot
  returned: ``wanted`` of the pipeline's ``submit``); a batch carries the latest deadline of its requests (none if one has none).
* With ``idle_dispatch``, the first request of a batch waits for company only while the
  pipeline has work in flight (its batch could not start earlier anyway); into an idle
  pipeline it goes at once, with whatever is already waiting, so a lone request never pays
  ``max_wait_s``. Under load the pipeline is busy and batches fill as before.
* :meth:`MicroBatcher.hold`: a caller about to submit several requests one after another (the
  sessions of one frame) asks the collector to keep collecting until it releases the hold (at
  most ``max_s``), so they join one batch even when the pipeline is idle. While a hold is
  active the collector checks it every :data:`HOLD_POLL_S`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from deploy_core.errors import BrokenPipelineError, BusyError, ClosedError, DeadlineError, EmptyError
from deploy_core.pipeline import BaseAsyncPipeline, BlockQueue
from deploy_core.thread_names import name_native_thread

__all__ = ["BatchItem", "BatcherStats", "MicroBatcher"]

log = logging.getLogger(__name__)

HOLD_POLL_S = 0.0005  # how often the collector looks at an active hold


@dataclass(slots=True)
class BatchItem:
    """One request inside a batch: the caller's data and the future the caller holds.

    deadline: ``time.monotonic()`` seconds after which nobody waits for the result; None = none.
    """

    data: Any
    key: Hashable | None = None
    future: Future[Any] = field(default_factory=Future)
    submitted_ns: int = field(default_factory=time.perf_counter_ns)
    deadline: float | None = None


@dataclass(frozen=True, slots=True)
class BatcherStats:
    """A snapshot of a :class:`MicroBatcher`.

    waiting: requests queued, not yet in a batch; in_flight: batches in the pipeline;
    batches / items: batches submitted and the requests in them so far; dropped: requests
    dropped before batching (cancelled or past their deadline); state: "running", "closed"
    or "broken".
    """

    name: str
    state: str
    waiting: int
    in_flight: int
    batches: int
    items: int
    dropped: int
    blocked: bool  # the collector holds a batch and waits for room in the pipeline


class MicroBatcher:
    """Collects requests into batches for ``pipeline`` (package data = ``list[BatchItem]``).

    The pipeline's result for a batch must be a list with one entry per item, in order;
    an entry that is an exception instance fails that item's future only.
    """

    def __init__(
        self,
        pipeline: BaseAsyncPipeline,
        *,
        max_batch: int,
        max_wait_s: float = 0.001,
        capacity: int = 256,
        name: str = "batcher",
        idle_dispatch: bool = False,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self.pipeline = pipeline
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.idle_dispatch = idle_dispatch
        self.name = name
        self._inbox: BlockQueue[BatchItem] = BlockQueue(capacity, name=f"{name}.inbox")
        # daemon for the reason the pipeline's stage threads are (close() still joins it)
        self._thread = threading.Thread(target=self._serve, name=f"fp-{name}", daemon=True)
        self._started = False
        self._start_lock = threading.Lock()
        # guards the counters below; notified when a batch completes and at close (the collector waits on it)
        self._cond = threading.Condition()
        self._aborted = False
        self._closed = False
        self._broken: BaseException | None = None
        self._in_flight = 0
        self._completed = 0
        self._blocked = False
        self.batches = 0
        self.items = 0
        self._dropped = 0
        self._holds: dict[int, float] = {}  # hold token -> when it lapses (time.monotonic())
        self._hold_tokens = 0

    @property
    def waiting(self) -> int:
        """Requests queued and not yet in a batch."""
        return self._inbox.size

    def stats(self) -> BatcherStats:
        with self._cond:
            return self._stats_locked()

    def _stats_locked(self) -> BatcherStats:
        state = "broken" if self._broken is not None else "closed" if self._closed else "running"
        return BatcherStats(self.name, state, self._inbox.size, self._in_flight, self.batches, self.items,
                            self._dropped, self._blocked)

    def wait_until(self, predicate: Callable[[BatcherStats], bool], timeout: float | None = None) -> bool:
        """Wait on the batcher's own condition (notified when a batch is submitted or completes, when the
        collector blocks or dies, and at close) until ``predicate(self.stats())``; False after ``timeout``."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self._stats_locked()), timeout)

    def submit(self, data: Any, key: Hashable | None = None, timeout: float | None = None, *,
               deadline: float | None = None) -> Future[Any]:
        """Queue one request; returns its future. BusyError when full after ``timeout``;
        ClosedError after ``close``; BrokenPipelineError once the collector died.
        deadline: ``time.monotonic()`` seconds (see the module docstring)."""
        if self._broken is not None:
            raise self._broken_error()
        with self._start_lock:
            if not self._started:
                self._started = True
                self._thread.start()
        item = BatchItem(data, key, deadline=deadline)
        try:
            self._inbox.put(item, timeout=timeout)
        except ClosedError:
            if self._broken is not None:
                raise self._broken_error() from None
            raise
        return item.future

    def hold(self, max_s: float) -> Callable[[], None]:
        """Keep the collector collecting (up to ``max_batch``) until the returned release is called or ``max_s``
        passed, so that requests submitted one after another join one batch. Release is idempotent."""
        with self._cond:
            self._hold_tokens += 1
            token = self._hold_tokens
            self._holds[token] = time.monotonic() + max_s

        def release() -> None:
            with self._cond:
                self._holds.pop(token, None)

        return release

    def _held_until(self, now: float) -> float:
        """When the latest active hold lapses (0.0: none); lapsed holds are forgotten."""
        with self._cond:
            for token in [t for t, until in self._holds.items() if until <= now]:
                del self._holds[token]
            return max(self._holds.values(), default=0.0)

    def close(self, abort: bool = False, timeout: float | None = None) -> None:
        """Stop taking requests; flush (or, with ``abort``, cancel) the waiting ones; join the collector
        (at most ``timeout`` seconds; None = until it ends)."""
        self._inbox.close()
        with self._cond:
            self._closed = True
            if abort:
                self._aborted = True  # the collector gives up a batch it cannot hand over
            self._cond.notify_all()
        if abort:
            for item in self._inbox.drain():
                if item.future.cancel():
                    item.future.set_running_or_notify_cancel()  # wakes concurrent.futures.wait()
                else:
                    _fail(item, ClosedError(f"{self.name} was closed"))
        if self._started:
            self._thread.join(timeout)

    # -- collector thread ---------------------------------------------------------
    def _broken_error(self) -> BrokenPipelineError:
        err = BrokenPipelineError(f"{self.name}: the batch collector died: {self._broken!r}")
        err.__cause__ = self._broken
        return err

    def _serve(self) -> None:
        name_native_thread()
        batch: list[BatchItem] = []
        try:
            self._collect(batch)
        except BaseException as exc:  # the loop itself died: fail every waiter, refuse new work
            log.error("%s: batch collector died; failing every waiting request", self.name, exc_info=exc)
            with self._cond:
                self._broken = exc
                self._cond.notify_all()
            self._inbox.close()
            for item in [*batch, *self._inbox.drain()]:
                _fail(item, self._broken_error())

    def _collect(self, batch: list[BatchItem]) -> None:
        inbox = self._inbox
        while True:
            batch.clear()
            try:
                batch.append(inbox.get())
            except ClosedError:
                return
            idle = self.idle_dispatch and self.pipeline.in_flight == 0
            deadline = time.monotonic() + (0.0 if idle else self.max_wait_s)  # idle: take what waits, go
            while len(batch) < self.max_batch:
                now = time.monotonic()
                held_until = self._held_until(now) if self._holds else 0.0
                if held_until > now:  # a caller is still submitting its group
                    try:
                        batch.append(inbox.get(timeout=min(held_until - now, HOLD_POLL_S)))
                    except EmptyError:
                        pass
                    except ClosedError:
                        break
                    continue
                remaining = deadline - now
                try:
                    batch.append(inbox.get_nowait() if remaining <= 0 else inbox.get(timeout=remaining))
                except (EmptyError, ClosedError):
                    break
            self._dispatch(batch)

    def _live(self, batch: list[BatchItem]) -> list[BatchItem]:
        """The requests somebody still waits for; the others are settled here."""
        now = time.monotonic()
        live = []
        for item in batch:
            if item.future.cancelled():
                item.future.set_running_or_notify_cancel()  # wakes concurrent.futures.wait()
            elif item.deadline is not None and now >= item.deadline:
                _fail(item, DeadlineError(f"{self.name}: the request passed its deadline "
                                          f"{(now - item.deadline) * 1e3:.1f} ms before it joined a batch"))
            else:
                live.append(item)
                continue
            with self._cond:
                self._dropped += 1
        return live

    def _dispatch(self, batch: list[BatchItem]) -> None:
        while True:
            batch = self._live(batch)
            if not batch:
                return
            deadlines = [item.deadline for item in batch]
            latest = None if None in deadlines else max(deadlines)  # type: ignore[type-var]
            with self._cond:
                seen = self._completed
            try:
                future = self.pipeline.submit(list(batch), timeout=0, deadline=latest,
                                              wanted=lambda items=batch: not all(i.future.cancelled() for i in items))
                break
            except BusyError:  # full: wait for one of our batches to complete (or close), then retry
                with self._cond:
                    self._blocked = True
                    self._cond.notify_all()
                    self._cond.wait_for(lambda seen=seen: self._completed != seen or self._aborted)
                    self._blocked = False
                    aborted = self._aborted
                if aborted:
                    for item in batch:
                        _fail(item, ClosedError(f"{self.name} was closed before the request started"))
                    return
            except Exception as exc:  # closed or broken pipeline: every request learns why
                for item in batch:
                    _fail(item, exc)
                return
        with self._cond:
            self.batches += 1
            self.items += len(batch)
            self._in_flight += 1
            self._cond.notify_all()
        future.add_done_callback(lambda f, items=batch: self._done(f, items))

    def _done(self, future: Future[Any], items: list[BatchItem]) -> None:
        try:
            _distribute(future, items)
        finally:
            with self._cond:
                self._in_flight -= 1
                self._completed += 1
                self._cond.notify_all()


def _fail(item: BatchItem, exc: BaseException) -> None:
    _settle(item, exc)


def _settle(item: BatchItem, value: Any) -> None:
    """Give ``item`` its result (an exception instance fails it); a cancelled request only gets notified."""
    future = item.future
    if future.cancelled():
        try:
            future.set_running_or_notify_cancel()  # wakes concurrent.futures.wait()
        except RuntimeError:
            pass  # already notified
        return
    try:
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)
    except InvalidStateError:
        pass  # settled meanwhile (cancelled by the caller, or failed at close)


def _distribute(future: Future[Any], items: list[BatchItem]) -> None:
    if future.cancelled():
        for item in items:
            _fail(item, ClosedError("the batch was cancelled at close"))
        return
    exc = future.exception()
    if exc is not None:
        for item in items:
            _fail(item, exc)
        return
    results = future.result()
    if not isinstance(results, list) or len(results) != len(items):
        bad = TypeError(f"batch result must be a list of {len(items)} entries, got {type(results).__name__}")
        for item in items:
            _fail(item, bad)
        return
    for item, value in zip(items, results, strict=True):
        _settle(item, value)
