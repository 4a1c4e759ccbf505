"""BlockQueue: a bounded, closable FIFO between two pipeline stages.

Why bounded: a full queue blocks its producer, which is how backpressure travels
from a slow stage back to ``submit``; a small capacity (1 to 4) keeps latency low,
because a package never waits behind more than ``capacity`` others.

Guarantees (all under one lock, so each holds at every instant):

* ``put`` blocks while full; ``put_nowait`` (or an expired timeout) raises
  :class:`BusyError`. Both raise :class:`ClosedError` once the queue is closed.
* ``get`` blocks while empty; ``get_nowait`` (or an expired timeout) raises
  :class:`EmptyError`. After ``close()`` consumers still drain what is queued, then
  every ``get`` raises :class:`ClosedError` (end of stream) and iteration stops.
* ``close()`` is idempotent and wakes every blocked producer and consumer.
* ``wait_until(pred)`` waits on the queue's own condition, which is notified on every
  change of :meth:`statistics` (size, waiters, closed): tests wait for states, not time.

The blocking and non-blocking calls share one code path. Waiter counts are kept by
hand so that ``notify`` is only called when someone is waiting (hot path).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from deploy_core.errors import BusyError, ClosedError, EmptyError

__all__ = ["BlockQueue", "QueueStatistics"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class QueueStatistics:
    """A snapshot of a :class:`BlockQueue`."""

    size: int
    capacity: int
    waiting_put: int
    waiting_get: int
    closed: bool


class BlockQueue(Generic[T]):
    """Bounded blocking FIFO with close semantics (see module docstring).

    capacity: maximum number of queued items (>= 1).
    name: shown in ``repr`` and error messages, e.g. ``"render->score"``.
    """

    def __init__(self, capacity: int, name: str = "queue") -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
        self.name = name
        self._capacity = capacity
        self._items: collections.deque[T] = collections.deque()
        self._lock = threading.Lock()
        self._not_full = threading.Condition(self._lock)
        self._not_empty = threading.Condition(self._lock)
        self._changed = threading.Condition(self._lock)
        self._waiting_put = 0
        self._waiting_get = 0
        self._watchers = 0
        self._closed = False

    # -- introspection ---------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def size(self) -> int:
        return len(self._items)

    def __len__(self) -> int:
        return len(self._items)

    @property
    def closed(self) -> bool:
        return self._closed

    def statistics(self) -> QueueStatistics:
        """A frozen snapshot: size, capacity, waiting producers/consumers, closed."""
        with self._lock:
            return self._stats_locked()

    def _stats_locked(self) -> QueueStatistics:
        return QueueStatistics(len(self._items), self._capacity, self._waiting_put, self._waiting_get,
                               self._closed)

    def __repr__(self) -> str:
        s = self.statistics()
        text = f"<BlockQueue {self.name} {s.size}/{s.capacity}"
        if s.waiting_put:
            text += f", {s.waiting_put} put waiting"
        if s.waiting_get:
            text += f", {s.waiting_get} get waiting"
        if s.closed:
            text += ", closed"
        return text + ">"

    def _changed_locked(self) -> None:
        if self._watchers:
            self._changed.notify_all()

    # -- producer side ---------------------------------------------------------
    def put(self, item: T, timeout: float | None = None) -> None:
        """Append ``item``, blocking while full (at most ``timeout`` seconds when given).

        Raises BusyError when the timeout expires (``timeout <= 0`` never waits) and
        ClosedError when the queue is, or becomes, closed.
        """
        with self._lock:
            if self._closed:
                raise ClosedError(f"put on closed queue {self.name!r}")
            if len(self._items) >= self._capacity:
                self._wait_for_room_locked(timeout)
            self._items.append(item)
            if self._waiting_get:
                self._not_empty.notify()
            if self._watchers:
                self._changed.notify_all()

    def put_nowait(self, item: T) -> None:
        """Append ``item`` or raise BusyError (full) / ClosedError (closed) at once."""
        self.put(item, timeout=0)

    def _wait_for_room_locked(self, timeout: float | None) -> None:
        if timeout is not None and timeout <= 0:
            raise BusyError(f"queue {self.name!r} is full ({self._capacity}/{self._capacity})")
        deadline = None if timeout is None else time.monotonic() + timeout
        self._waiting_put += 1
        self._changed_locked()
        try:
            while len(self._items) >= self._capacity and not self._closed:
                if deadline is None:
                    self._not_full.wait()
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise BusyError(f"queue {self.name!r} still full after {timeout} s")
                self._not_full.wait(remaining)
        finally:
            self._waiting_put -= 1
            self._changed_locked()
        if self._closed:
            raise ClosedError(f"queue {self.name!r} was closed while a put was waiting")

    # -- consumer side ---------------------------------------------------------
    def get(self, timeout: float | None = None) -> T:
        """Remove and return the oldest item, blocking while empty.

        Raises EmptyError when the timeout expires (``timeout <= 0`` never waits) and
        ClosedError once the queue is closed *and* drained (end of stream).
        """
        with self._lock:
            if not self._items:
                self._wait_for_item_locked(timeout)
            item = self._items.popleft()
            if self._waiting_put:
                self._not_full.notify()
            if self._watchers:
                self._changed.notify_all()
            return item

    def get_nowait(self) -> T:
        """Remove and return the oldest item or raise EmptyError / ClosedError at once."""
        return self.get(timeout=0)

    def _wait_for_item_locked(self, timeout: float | None) -> None:
        if self._closed:
            raise ClosedError(f"queue {self.name!r} is closed and drained")
        if timeout is not None and timeout <= 0:
            raise EmptyError(f"queue {self.name!r} is empty")
        deadline = None if timeout is None else time.monotonic() + timeout
        self._waiting_get += 1
        self._changed_locked()
        try:
            while not self._items and not self._closed:
                if deadline is None:
                    self._not_empty.wait()
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise EmptyError(f"queue {self.name!r} still empty after {timeout} s")
                self._not_empty.wait(remaining)
        finally:
            self._waiting_get -= 1
            self._changed_locked()
        if not self._items:
            raise ClosedError(f"queue {self.name!r} is closed and drained")

    def __iter__(self) -> Iterator[T]:
        """Yield items until the queue is closed and drained."""
        while True:
            try:
                yield self.get()
            except ClosedError:
                return

    def drain(self) -> list[T]:
        """Remove and return every queued item without blocking (oldest first)."""
        with self._lock:
            items = list(self._items)
            self._items.clear()
            if items:
                self._not_full.notify_all()
                self._changed_locked()
            return items

    # -- lifecycle -------------------------------------------------------------
    def close(self) -> None:
        """Refuse further puts and wake every waiter; idempotent.

        Blocked producers raise ClosedError; consumers drain the remaining items and
        then see end of stream.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._not_full.notify_all()
            self._not_empty.notify_all()
            self._changed_locked()

    def wait_until(self, predicate: Callable[[QueueStatistics], bool], timeout: float | None = None) -> bool:
        """Block until ``predicate(self.statistics())`` is true; False if ``timeout`` expired first."""
        with self._lock:
            self._watchers += 1
            try:
                return self._changed.wait_for(lambda: predicate(self._stats_locked()), timeout)
            finally:
                self._watchers -= 1
