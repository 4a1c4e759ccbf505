"""Reusable page-locked host blocks, handed out as NumPy arrays without a PyTorch call per use.

``torch.empty(..., pin_memory=True)`` reuses blocks too (its caching host allocator), but every call releases the
GIL and takes it back; with many busy Python threads each retake can wait a whole switch interval, and staging a
track request's images took two. :class:`PinnedBlocks` keeps freed blocks per exact size in a deque (append and pop
are atomic under the GIL: no lock), so a request after the first of its size stages its frame without any call that
lets the GIL go except the copies themselves. A block goes back to its free list when the last array viewing it is
gone (``weakref.finalize``), so callers never return blocks by hand and a dropped request cannot leak one.

Only blocks that were freed are reused: whoever still reads a block (an asynchronous copy to the GPU) must hold one
of its arrays until that copy is done, exactly as with PyTorch's pinned tensors.
"""

from __future__ import annotations

import collections
import warnings
import weakref
from collections.abc import Callable

import numpy as np
import torch

__all__ = ["PinnedCopies", "PinnedBlocks"]


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class PinnedBlocks:
    """Page-locked uint8 blocks by exact size. max_free_bytes: freed bytes kept for reuse (beyond it a freed block is
    released to PyTorch's allocator instead of kept). allocate: ``nbytes -> uint8 CPU tensor`` for a new block
    (default: PyTorch's pinned allocator)."""

    def __init__(self, max_free_bytes: int = 1 << 30, allocate: Callable[[int], torch.Tensor] = _pinned) -> None:
        if max_free_bytes < 0:
            raise ValueError(f"max_free_bytes must be >= 0, got {max_free_bytes}")
        self.max_free_bytes = max_free_bytes
        self._allocate = allocate
        self._free: dict[int, collections.deque[torch.Tensor]] = {}
        # bytes in the free lists: updated without a lock (a contended lock would let the GIL go on the hot path),
        # so concurrent updates may be off by a block; it only bounds what is kept
        self._free_bytes = 0
        self.allocated = 0  # blocks made so far (the rest of the takes reused one)

    def take(self, nbytes: int) -> np.ndarray:
        """A page-locked uint8 array of ``nbytes`` (its contents undefined), returned to the pool when it and every
        view of it are gone."""
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}")
        free = self._free.get(nbytes)
        try:
            block = free.pop() if free is not None else None
        except IndexError:
            block = None
        if block is None:
            block = self._allocate(nbytes)
            self.allocated += 1
        else:
            self._free_bytes -= nbytes
        array = block.numpy()
        weakref.finalize(array, self._give_back, block).atexit = False
        return array

    def free_bytes(self) -> int:
        """Bytes held in free lists now."""
        return self._free_bytes

    def _give_back(self, block: torch.Tensor) -> None:
        nbytes = block.numel()
        if self._free_bytes + nbytes > self.max_free_bytes:
            return  # dropped: PyTorch's caching host allocator gets it back
        self._free_bytes += nbytes
        self._free.setdefault(nbytes, collections.deque()).append(block)


_ALIGN = 64  # each copied image starts on a cache line


class PinnedCopies:
    """A frame's images (rgb, depth, optionally a mask) as host tensors the GPU copies from asynchronously
    (:meth:`of`).

    ``pinned`` (on CUDA): arrays already page-locked (:func:`deploy_core.memory.page_locking.is_page_locked_array`: an
    ingest ring, a :class:`~deploy_core.memory.frames.PageLockedFrames` slot, whose owner keeps them unchanged until
    the answer) are used as they are; anything else is copied into one reusable page-locked block of
    :class:`PinnedBlocks` (its images 64-byte aligned; ``blocks``: the blocks to use, default a new set). Not
    ``pinned`` (CPU): zero-copy tensor views. Keep the returned tensors until the copies from them are done: that
    also keeps the block from being reused.
    """

    def __init__(self, pinned: bool, blocks: PinnedBlocks | None = None) -> None:
        self.pinned = pinned
        self._blocks = (blocks or PinnedBlocks()) if pinned else None

    def of(self, *images: np.ndarray) -> tuple[torch.Tensor, ...]:
        """Host tensors of ``images`` (each C-contiguous afterwards, same dtype and shape)."""
        from deploy_core.memory.page_locking import is_page_locked_array

        if self._blocks is None:
            return tuple(_read_only_view(np.ascontiguousarray(a)) for a in images)
        if all(is_page_locked_array(a, a.dtype.type) for a in images):
            return tuple(torch.from_numpy(a) for a in images)
        offsets, total = [], 0
        for a in images:
            offsets.append(total)
            total += (a.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        block = self._blocks.take(total)
        staged = []
        for a, at in zip(images, offsets, strict=True):
            view = block[at:at + a.nbytes].view(a.dtype).reshape(a.shape)
            view[...] = a
            staged.append(torch.from_numpy(view))
        return tuple(staged)


def _read_only_view(array: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``array``'s memory, which may be read-only (a request's received bytes): its readers only
    read it, so PyTorch's warning about writes to a read-only array does not apply."""
    if array.flags.writeable:
        return torch.from_numpy(array)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
        return torch.from_numpy(array)
