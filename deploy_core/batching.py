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
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from deploy_core.errors import BusyError, ClosedError, EmptyError
from deploy_core.pipeline import BaseAsyncPipeline, BlockQueue

__all__ = ["MicroBatcher", "BatchItem"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class BatchItem:
    """One request inside a batch: the caller's data and the future the caller holds."""

    data: Any
    key: Hashable | None = None
    future: Future[Any] = field(default_factory=Future)
    submitted_ns: int = field(default_factory=time.perf_counter_ns)


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
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self.pipeline = pipeline
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.name = name
        self._inbox: BlockQueue[BatchItem] = BlockQueue(capacity, name=f"{name}.inbox")
        # daemon for the reason the pipeline's stage threads are (close() still joins it)
        self._thread = threading.Thread(target=self._collect, name=f"fp-{name}", daemon=True)
        self._started = False
        self._aborted = False
        self._start_lock = threading.Lock()
        self.batches = 0
        self.items = 0

    @property
    def waiting(self) -> int:
        """Requests queued and not yet in a batch."""
        return self._inbox.size

    def submit(self, data: Any, key: Hashable | None = None, timeout: float | None = None) -> Future[Any]:
        """Queue one request; returns its future. BusyError when full after ``timeout``."""
        with self._start_lock:
            if not self._started:
                self._started = True
                self._thread.start()
        item = BatchItem(data, key)
        self._inbox.put(item, timeout=timeout)
        return item.future

    def close(self, abort: bool = False, timeout: float | None = None) -> None:
        """Stop taking requests; flush (or, with ``abort``, cancel) the waiting ones; join the collector
        (at most ``timeout`` seconds; None = until it ends)."""
        self._inbox.close()
        if abort:
            self._aborted = True  # the collector gives up a batch it cannot hand over
            for item in self._inbox.drain():
                if item.future.cancel():
                    item.future.set_running_or_notify_cancel()  # wakes concurrent.futures.wait()
                else:
                    _fail(item, ClosedError(f"{self.name} was closed"))
        if self._started:
            self._thread.join(timeout)

    def _collect(self) -> None:
        inbox = self._inbox
        while True:
            try:
                first = inbox.get()
            except ClosedError:
                return
            batch = [first]
            deadline = time.monotonic() + self.max_wait_s
            while len(batch) < self.max_batch:
                remaining = deadline - time.monotonic()
                try:
                    batch.append(inbox.get_nowait() if remaining <= 0 else inbox.get(timeout=remaining))
                except EmptyError:
                    break
                except ClosedError:
                    break
            self._dispatch(batch)

    def _dispatch(self, batch: list[BatchItem]) -> None:
        batch = [item for item in batch if item.future.set_running_or_notify_cancel()]
        if not batch:
            return
        self.batches += 1
        self.items += len(batch)
        while True:
            try:
                # Short timeouts so that an abort is noticed while the pipeline is full.
                future = self.pipeline.submit(batch, timeout=0.05)
                break
            except BusyError:
                if self._aborted:
                    for item in batch:
                        _fail(item, ClosedError(f"{self.name} was closed before the request started"))
                    return
            except Exception as exc:  # closed or broken pipeline: every request learns why
                for item in batch:
                    _fail(item, exc)
                return
        future.add_done_callback(lambda f, items=batch: _distribute(f, items))


def _fail(item: BatchItem, exc: BaseException) -> None:
    if not item.future.done():
        item.future.set_exception(exc)


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
        if item.future.done():
            continue
        if isinstance(value, BaseException):
            item.future.set_exception(value)
        else:
            item.future.set_result(value)
