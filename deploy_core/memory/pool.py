"""A fixed set of preallocated buffer slots, lent out one :class:`Lease` at a time.

Guarantees (and the races they avoid):

* Every buffer is allocated once, in the constructor, at its maximum shape. ``Lease.view`` only cuts views
  (metadata) out of those buffers, so the hot path never allocates device or host memory.
* The number of slots is the admission bound: ``acquire`` blocks while all slots are out, gives up with
  ``BusyError`` when the caller's timeout passes, and fails with ``ClosedError`` once the pool is closed;
  ``close()`` wakes every blocked ``acquire`` (they raise ``ClosedError``) instead of only setting a flag.
* A slot has a generation counter, bumped on every release. A lease remembers the generation it was granted;
  any use after release (or a second release) raises ``LeaseError`` rather than silently touching a buffer
  that somebody else now owns.
* Returning a slot is a host action that may run ahead of the GPU. On CUDA, ``release(stream)`` records the
  slot's "free" event on the last user's stream (the current stream when none is given); the next lessee's
  first GPU work waits for that event on the GPU (``lease.wait(its_stream)``, or a pipeline seeds the
  package's ready event from ``lease.prior_free_event``). The host never syncs. On CPU there are no events
  and ``wait`` does nothing (one code path).
* The chain is transitive: before recording the free event, ``release`` makes the release stream wait on
  the previous lessee's free event. So a lessee that never touched the buffers (dropped before its first
  stage) still hands on an event that follows every earlier lessee's work.
* All bookkeeping happens under one condition variable; ``view`` reads only immutable data plus the slot's
  generation, so it takes no lock.

Outstanding leases survive ``close()``: in-flight work may finish, read its views and release normally.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from deploy_core.cuda import as_device, is_cuda, wait_event
from deploy_core.errors import BusyError, CapacityError, ClosedError, LeaseError
from deploy_core.memory.spec import BufferSpec, PoolStats

if TYPE_CHECKING:
    from torch.cuda import Event, Stream

__all__ = ["Lease", "MemBufferPool"]

logger = logging.getLogger(__name__)


class _Slot:
    """One set of named buffers plus its lending state (guarded by the pool's condition)."""

    __slots__ = ("index", "buffers", "flat", "generation", "free_event", "event_recorded", "owner")

    def __init__(self, index: int, buffers: dict[str, torch.Tensor], free_event: Event | None) -> None:
        self.index = index
        self.buffers = buffers                                   # name -> full-capacity tensor
        self.flat = {k: v.view(-1) for k, v in buffers.items()}  # name -> 1-D alias, for cheap views
        self.generation = 0
        self.free_event = free_event                             # CUDA: re-recorded at every release
        self.event_recorded = False
        self.owner: Hashable | None = None


class Lease:
    """Exclusive use of one pool slot until :meth:`release` (or the end of a ``with`` block).

    Obtain one from :meth:`MemBufferPool.acquire`; never construct it directly.
    """

    __slots__ = ("_pool", "_slot", "_generation", "_wait_event", "_released", "owner")

    def __init__(self, pool: MemBufferPool, slot: _Slot, wait_for: Event | None, owner: Hashable | None) -> None:
        self._pool = pool
        self._slot = slot
        self._generation = slot.generation
        self._wait_event = wait_for
        self._released = False
        self.owner = owner

    # -- identity ----------------------------------------------------------------------------------------
    @property
    def pool(self) -> MemBufferPool:
        return self._pool

    @property
    def slot(self) -> int:
        """Index of the leased slot (0 .. pool.slots - 1)."""
        return self._slot.index

    @property
    def generation(self) -> int:
        """The slot's generation when this lease was granted."""
        return self._generation

    @property
    def released(self) -> bool:
        return self._released

    def _check_alive(self) -> None:
        if self._released or self._slot.generation != self._generation:
            raise LeaseError(
                f"lease of pool {self._pool.name!r} slot {self._slot.index} (generation {self._generation}, "
                f"owner {self.owner!r}) was already released; acquire a new lease"
            )

    # -- buffers -----------------------------------------------------------------------------------------
    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """Full-capacity buffers of this slot, by name (a fresh dict; the tensors are the pool's own)."""
        self._check_alive()
        return dict(self._slot.buffers)

    def view(self, name: str, shape: Iterable[int]) -> torch.Tensor:
        """A contiguous view of the first ``prod(shape)`` elements of buffer ``name``, reshaped to ``shape``.

        The rank of ``shape`` must equal the rank of the buffer's capacity shape (a guard against flattening
        mistakes); the element count must not exceed the capacity. The dtype and device are the buffer's.
        Contents are whatever the previous lessee left: callers overwrite what they read.

        Raises ``CapacityError`` (naming the buffer, the request and the capacity) when too large,
        ``ValueError`` for an unknown name, a rank mismatch or a negative dim, ``LeaseError`` after release.
        """
        self._check_alive()
        flat = self._slot.flat.get(name)
        if flat is None:
            raise ValueError(
                f"pool {self._pool.name!r} has no buffer {name!r}; buffers: {sorted(self._slot.buffers)}"
            )
        shape = tuple(int(d) for d in shape)
        capacity = self._slot.buffers[name].shape
        if len(shape) != len(capacity):
            raise ValueError(
                f"buffer {name!r}: requested shape {shape} has rank {len(shape)}, the buffer's capacity "
                f"{tuple(capacity)} has rank {len(capacity)}"
            )
        numel = 1
        for d in shape:
            if d < 0:
                raise ValueError(f"buffer {name!r}: requested shape {shape} has a negative dim")
            numel *= d
        if numel > flat.numel():
            raise CapacityError(
                f"buffer {name!r}: requested {shape} ({numel} elements) exceeds capacity {tuple(capacity)} "
                f"({flat.numel()} elements)"
            )
        return flat[:numel].view(shape)

    # -- ordering and release ----------------------------------------------------------------------------
    @property
    def prior_free_event(self) -> Event | None:
        """The previous lessee's "free" event: the first GPU work on these buffers must wait on it
        (``stream.wait_event``); None on CPU or for a never-used slot."""
        return self._wait_event

    def wait(self, stream: Stream | None = None) -> None:
        """Make ``stream`` (CUDA; ``None`` = current stream) wait on the GPU until the previous lessee's work
        on these buffers is done. No host synchronisation; a no-op on CPU or for a never-used slot.
        Call it before the first GPU access to the buffers."""
        self._check_alive()
        wait_event(stream, self._wait_event)

    def wait_host(self) -> None:
        """Block the host until the previous lessee's GPU work on this slot has completed. Call it before the
        host writes a (pinned) host buffer that the previous lessee's asynchronous copies may still read: a
        GPU-side wait cannot order a host write. Returns at once when that work is done (the steady state:
        the previous lessee's final sync saw to it; only a lessee that failed mid-way leaves work behind),
        for a never-used slot and on CPU."""
        self._check_alive()
        event = self._wait_event
        if event is not None and not event.query():
            event.synchronize()

    def release(self, stream: Stream | None = None) -> None:
        """Return the slot to the pool. Releasing twice raises ``LeaseError``.

        On CUDA the slot's "free" event is recorded on ``stream`` (the current stream of the pool's device when
        ``None``): pass the stream of the last GPU work that touched the buffers.
        """
        self._pool._release(self, stream)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        # A lease released early inside the block is fine; only an unreleased one is returned here.
        if not self._released:
            self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else "held"
        return f"<Lease {self._pool.name!r} slot {self._slot.index} gen {self._generation} {state} owner={self.owner!r}>"


class MemBufferPool:
    """``slots`` sets of named buffers (``specs``), preallocated on ``device`` and lent out as leases.

    specs:  the named buffers of every slot, each at its maximum shape (see :class:`BufferSpec`); none: the slots
            only bound the work in flight, with the same leases and free events (a lane whose data lives elsewhere).
    slots:  number of slots; also the bound on work in flight that holds a lease.
    device: where non-host buffers live ("cpu", "cuda", "cuda:1", ...). Host buffers stay on CPU, pinned
            when ``device`` is CUDA.
    name:   label used in errors, ``repr`` and metrics.

    Buffers are zero-filled once at construction (never stale garbage from a previous allocation).
    """

    def __init__(
        self,
        specs: Iterable[BufferSpec],
        slots: int,
        device: str | torch.device,
        *,
        name: str = "pool",
    ) -> None:
        specs = tuple(specs)
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"MemBufferPool buffer names must be unique, got {names}")
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an int >= 1, got {slots!r}")
        self._name = name
        self._specs = specs
        self._device = as_device(device)
        self._cuda = is_cuda(self._device)
        self._slots = [self._make_slot(i) for i in range(slots)]
        self._free: collections.deque[int] = collections.deque(range(slots))
        self._cond = threading.Condition()
        self._closed = False
        self._waiting = 0
        self._acquires = 0
        self._waited = 0
        self._timeouts = 0
        self._total_wait_s = 0.0
        self._max_wait_s = 0.0
        logger.debug("pool %r: %d slots x %d bytes on %s", name, slots, self.slot_bytes, self._device)

    def _make_slot(self, index: int) -> _Slot:
        buffers: dict[str, torch.Tensor] = {}
        for spec in self._specs:
            if spec.host:
                buffers[spec.name] = torch.zeros(spec.shape, dtype=spec.dtype, pin_memory=self._cuda)
            else:
                buffers[spec.name] = torch.zeros(spec.shape, dtype=spec.dtype, device=self._device)
        free_event = torch.cuda.Event() if self._cuda else None
        return _Slot(index, buffers, free_event)

    # -- introspection -----------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._name

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def specs(self) -> tuple[BufferSpec, ...]:
        return self._specs

    @property
    def slots(self) -> int:
        return len(self._slots)

    @property
    def leased(self) -> int:
        """Number of leases currently out."""
        with self._cond:
            return len(self._slots) - len(self._free)

    @property
    def available(self) -> int:
        """Number of free slots."""
        with self._cond:
            return len(self._free)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot (device and host buffers together)."""
        return sum(s.nbytes for s in self._specs)

    @property
    def capacity_bytes(self) -> int:
        """Bytes preallocated by the whole pool (all slots, device and host)."""
        return self.slot_bytes * len(self._slots)

    def outstanding(self) -> dict[int, Hashable | None]:
        """Slot index -> owner label of every lease currently out."""
        with self._cond:
            free = set(self._free)
            return {s.index: s.owner for s in self._slots if s.index not in free}

    def stats(self) -> PoolStats:
        """A consistent snapshot of occupancy and acquire wait times."""
        with self._cond:
            return self._stats_locked()

    def wait_until(self, predicate: Callable[[PoolStats], bool], timeout: float | None = None) -> bool:
        """Wait on the pool's own condition (notified on every acquire/release/close) until
        ``predicate(self.stats())`` is true; returns False when ``timeout`` seconds pass first."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self._stats_locked()), timeout)

    def _stats_locked(self) -> PoolStats:
        return PoolStats(self._name, len(self._slots), len(self._slots) - len(self._free), len(self._free),
                         self._waiting, self._closed, self._acquires, self._waited, self._timeouts,
                         self._total_wait_s, self._max_wait_s)

    def __repr__(self) -> str:
        with self._cond:
            leased, waiting = len(self._slots) - len(self._free), self._waiting
        closed = " closed" if self._closed else ""
        return f"<MemBufferPool {self._name!r} {self._device} {leased}/{len(self._slots)} leased, {waiting} waiting{closed}>"

    # -- lending -----------------------------------------------------------------------------------------
    def acquire(self, timeout: float | None = None, *, owner: Hashable | None = None) -> Lease:
        """Lease a free slot, blocking while none is free.

        timeout: seconds to wait; ``None`` waits indefinitely, ``0`` fails at once when the pool is full.
        owner:   label recorded with the lease (e.g. a frame id) for ``outstanding()`` and error messages.

        Raises ``BusyError`` when the timeout passes, ``ClosedError`` if the pool is (or gets) closed.
        Waiters are not served in strict FIFO order.
        """
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 seconds or None, got {timeout}")
        start = time.monotonic()
        with self._cond:
            if self._closed:
                raise ClosedError(f"pool {self._name!r} is closed")
            waited = False
            if not self._free:
                waited = True
                deadline = None if timeout is None else start + timeout
                self._waiting += 1
                self._cond.notify_all()  # wait_until observers see the new waiter
                try:
                    while not self._free and not self._closed:
                        remaining = None if deadline is None else deadline - time.monotonic()
                        if remaining is not None and remaining <= 0:
                            self._timeouts += 1
                            raise BusyError(
                                f"pool {self._name!r}: all {len(self._slots)} slots leased; "
                                f"gave up after {timeout:g} s"
                            )
                        self._cond.wait(remaining)
                finally:
                    self._waiting -= 1
                    self._cond.notify_all()
                if self._closed:
                    raise ClosedError(f"pool {self._name!r} was closed while waiting for a slot")
            slot = self._slots[self._free.popleft()]
            slot.owner = owner
            wait_for = slot.free_event if slot.event_recorded else None
            waited_s = time.monotonic() - start if waited else 0.0
            self._acquires += 1
            self._waited += int(waited)
            self._total_wait_s += waited_s
            self._max_wait_s = max(self._max_wait_s, waited_s)
            lease = Lease(self, slot, wait_for, owner)
            self._cond.notify_all()
            return lease

    def _release(self, lease: Lease, stream: Stream | None) -> None:
        with self._cond:
            if lease._pool is not self:
                raise LeaseError(f"lease {lease!r} does not belong to pool {self._name!r}")
            slot = lease._slot
            if lease._released or slot.generation != lease._generation:
                raise LeaseError(
                    f"lease of pool {self._name!r} slot {slot.index} (generation {lease._generation}, "
                    f"owner {lease.owner!r}) released twice"
                )
            if slot.free_event is not None:
                if stream is None:
                    stream = torch.cuda.current_stream(self._device)
                # GPU-side: the new free event also follows the previous lessee's work (see the guarantees)
                wait_event(stream, lease._wait_event)
                slot.free_event.record(stream)
                slot.event_recorded = True
            lease._released = True
            slot.generation += 1
            slot.owner = None
            self._free.append(slot.index)
            self._cond.notify_all()

    def close(self) -> None:
        """Stop lending: blocked and future ``acquire`` calls raise ``ClosedError``. Idempotent.
        Leases already out stay valid until released."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            out = len(self._slots) - len(self._free)
            self._cond.notify_all()
        if out:
            logger.debug("pool %r closed with %d lease(s) still out", self._name, out)

    def __enter__(self) -> MemBufferPool:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

