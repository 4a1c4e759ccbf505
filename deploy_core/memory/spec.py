"""Value objects of the buffer pool: what one named buffer is, and a snapshot of the pool's state."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["BufferSpec", "PoolStats"]


@dataclass(frozen=True, slots=True)
class BufferSpec:
    """One named buffer of every pool slot, allocated once at its maximum shape.

    name:  key of the buffer in ``Lease.buffers`` / ``Lease.view(name, ...)``.
    shape: maximum (capacity) shape; every dim >= 1. Requests are views of up to ``numel`` elements.
    dtype: element type, fixed for the buffer's life.
    host:  True for a host (CPU) staging buffer; page-locked (pinned) when the pool's device is CUDA so that
           ``copy_(..., non_blocking=True)`` is truly asynchronous. False: lives on the pool's device.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    host: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"BufferSpec.name must be a non-empty str, got {self.name!r}")
        shape = tuple(self.shape)
        if not shape or any((not isinstance(d, int)) or isinstance(d, bool) or d < 1 for d in shape):
            raise ValueError(f"BufferSpec {self.name!r}: shape must be a non-empty tuple of ints >= 1, got {self.shape!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"BufferSpec {self.name!r}: dtype must be a torch.dtype, got {self.dtype!r}")
        object.__setattr__(self, "shape", shape)

    @property
    def numel(self) -> int:
        """Capacity in elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Capacity in bytes (elements x dtype size)."""
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class PoolStats:
    """A consistent snapshot of a :class:`MemBufferPool` (for metrics and ``repr``).

    acquires:     leases granted so far.
    waited:       of those, how many found no free slot and had to wait.
    timeouts:     acquires that gave up with ``BusyError``.
    total_wait_s: summed wait time of all granted acquires, seconds.
    max_wait_s:   longest single wait of a granted acquire, seconds.
    """

    name: str
    slots: int
    leased: int
    available: int
    waiting: int
    closed: bool
    acquires: int
    waited: int
    timeouts: int
    total_wait_s: float
    max_wait_s: float

    @property
    def mean_wait_s(self) -> float:
        """Mean wait per granted acquire, seconds (0 when none)."""
        return self.total_wait_s / self.acquires if self.acquires else 0.0
