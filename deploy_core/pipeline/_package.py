"""Package: one unit of work (a frame or request) travelling through a pipeline."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Protocol

from deploy_core.timing import TimingRecord

__all__ = ["Lease", "Package"]

_log = logging.getLogger(__name__)
_UNSET: Any = object()


class Lease(Protocol):
    """What a package needs from a pool lease (``deploy_core.memory.Lease``).

    ``release(stream)`` is called with the package's CUDA stream when it has one. A lease may also
    have ``prior_free_event`` (the previous lessee's "free" event, or None): the pipeline seeds the
    package's ``ready_event`` with it, so the first GPU stage waits for the slot to be free.
    """

    def release(self) -> None: ...


@dataclass(eq=False, slots=True)
class Package:
    """A caller's data plus everything the pipeline carries with it.

    data: the caller's payload; stages read and replace it (``pkg.data = ...``).
    key: the caller's ordering key (e.g. a session id); results for one key complete
        in submission order.
    lease: buffers leased from a ``MemBufferPool`` for this package, or None.
    timings: one :class:`TimingRecord` per stage run, appended by the pipeline.
    future: completed exactly once by :meth:`finish` (result, exception or cancel).
    package_id: unique within its pipeline, increasing in admission order.
    submitted_ns: ``time.perf_counter_ns()`` at admission.
    ready_event: CUDA event recorded on the last GPU stage's stream after it enqueued
        its work; the next GPU stage's stream waits on it (None on CPU). Seeded at admission
        with the lease's ``prior_free_event``: the first GPU stage waits for the previous
        lessee of the slot (no host sync).
    stream: the CUDA stream of the last GPU stage that worked on the package (None on
        CPU); the lease is released on it, so the pool's "free" event follows that work
        even when the package fails mid-way.
    enqueued_ns: when the package was last handed to a queue (for queue-wait timing).
    deadline: ``time.monotonic()`` seconds after which the package is dropped at the next
        stage boundary (its future fails with ``DeadlineError``); None = no deadline.
    wanted: asked at each stage boundary; False drops the package like a cancelled future
        (e.g. a batch whose requests were all cancelled). None = always wanted.
    synced: set once the host has waited for all GPU work of the package (the final sync);
        until then a failed package's data is kept alive by the pipeline (see
        ``BaseAsyncPipeline``, "GPU memory of failed packages").
    on_finish: ``on_finish(pkg, settle)`` is called once by :meth:`finish`, after the lease is
        released; it must call ``settle()`` (now or later) to settle the future (the pipeline
        uses it to keep per-key completion order). Without it the future is settled at once.
    """

    data: Any
    key: Hashable | None = None
    lease: Lease | None = None
    timings: list[TimingRecord] = field(default_factory=list)
    future: Future[Any] = field(default_factory=Future)
    package_id: int = 0
    submitted_ns: int = field(default_factory=time.perf_counter_ns)
    ready_event: Any = None
    stream: Any = None
    enqueued_ns: int = 0
    deadline: float | None = None
    wanted: Callable[[], bool] | None = field(default=None, repr=False)
    synced: bool = False
    on_finish: Callable[[Package, Callable[[], None]], None] | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _done: bool = field(default=False, init=False, repr=False)

    @property
    def done(self) -> bool:
        """True once :meth:`finish` has run (or the caller cancelled the future)."""
        return self._done or self.future.cancelled()

    def finish(self, result: Any = _UNSET, *, error: BaseException | None = None,
               cancel: bool = False) -> bool:
        """Complete the package: release its lease, then settle its future. Exactly once.

        Give one of ``result``, ``error`` or ``cancel=True``. Returns True for the call
        that completed the package and False for every later call (a no-op), so
        concurrent finishers (a stage thread and an abort) are safe. If releasing the
        lease fails while finishing with a result, the future gets that error instead.
        A future the caller already cancelled stays cancelled.
        """
        if result is _UNSET and error is None and not cancel:
            raise ValueError("finish() needs a result, an error or cancel=True")
        with self._lock:
            if self._done:
                return False
            self._done = True
        release_error: Exception | None = None
        lease = self.lease
        if lease is not None:
            try:
                if self.stream is None:
                    lease.release()
                else:
                    lease.release(self.stream)  # type: ignore[call-arg]
            except Exception as exc:  # a double release is a bug somewhere: report it, once
                release_error = exc
                _log.error("package %s: releasing its lease failed", self.package_id, exc_info=exc)

        def settle() -> None:
            self._settle(result, error, cancel, release_error)

        if self.on_finish is not None:
            self.on_finish(self, settle)
        else:
            settle()
        return True

    def _settle(self, result: Any, error: BaseException | None, cancel: bool,
                release_error: Exception | None) -> None:
        future = self.future
        try:
            if cancel:
                future.cancel()
            elif error is not None:
                future.set_exception(error)
            elif release_error is not None:
                release_error.add_note(f"package_id={self.package_id} (while releasing its lease)")
                future.set_exception(release_error)
            else:
                future.set_result(result)
        except InvalidStateError:
            pass  # the caller cancelled the future meanwhile: nothing to deliver
        if future.cancelled():
            # concurrent.futures.wait/as_completed only see a cancelled future once it is "notified"
            try:
                future.set_running_or_notify_cancel()
            except RuntimeError:
                pass  # already notified
