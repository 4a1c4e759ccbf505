"""Page-locking existing host memory for CUDA (``cudaHostRegister``), and knowing which arrays live in it.

A frame in page-locked memory is copied to the GPU asynchronously straight from where it is; anything else needs
a staging copy into pinned memory first. Asking the driver per array (``Tensor.is_pinned``:
``cudaPointerGetAttributes``) costs tens of microseconds under the GIL on a loaded process, twice per frame, so this
module remembers the ranges it registered and answers :func:`is_page_locked` with a lookup. Memory page-locked by
others (torch's pinned allocator) is not in the table: callers treat it as ordinary memory (a correct extra copy).

The table is process-wide because page-locking is: the driver's registration belongs to the process, not to an
object. Registration and release go through :func:`page_lock` / :func:`page_unlock`, under a lock; lookups read an
immutable snapshot.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

log = logging.getLogger(__name__)

__all__ = ["is_page_locked", "is_page_locked_array", "page_lock", "page_unlock", "page_locked_ranges"]

_lock = threading.Lock()
_ranges: tuple[tuple[int, int], ...] = ()  # (first byte, one past the last) of each registered range


def page_lock(address: int, size: int) -> int:
    """Page-lock ``size`` bytes at ``address`` (host memory this process mapped); 0 on success, else the CUDA
    error code (nothing recorded). Call once per range; undo with :func:`page_unlock`."""
    global _ranges
    import torch

    if size <= 0:
        raise ValueError(f"size must be > 0, got {size}")
    error = int(torch.cuda.cudart().cudaHostRegister(address, size, 0))
    if error == 0:
        with _lock:
            _ranges = (*_ranges, (address, address + size))
    return error


def page_unlock(address: int) -> int:
    """Undo :func:`page_lock` of the range starting at ``address`` once no copy from it can be in flight; 0 on
    success, else the CUDA error code. The range leaves the table either way."""
    global _ranges
    import torch

    with _lock:
        _ranges = tuple(r for r in _ranges if r[0] != address)
    return int(torch.cuda.cudart().cudaHostUnregister(address))


def page_locked_ranges() -> tuple[tuple[int, int], ...]:
    """The ranges page-locked through this module now: ((first byte, one past the last), ...)."""
    return _ranges


def is_page_locked_array(arr: np.ndarray, dtype: type) -> bool:
    """A writeable C-contiguous array of ``dtype`` in memory page-locked through :func:`page_lock` (a table lookup,
    not a driver call per frame): one the GPU may copy from where it is while its owner keeps it unchanged."""
    return arr.dtype == dtype and arr.flags.c_contiguous and arr.flags.writeable and is_page_locked(arr)


def is_page_locked(arr: np.ndarray) -> bool:
    """Whether every byte of ``arr`` (C-contiguous: its bytes are one span) lies in one range page-locked through
    :func:`page_lock`."""
    start = int(arr.__array_interface__["data"][0])
    end = start + int(arr.nbytes)
    return any(lo <= start and end <= hi for lo, hi in _ranges)
