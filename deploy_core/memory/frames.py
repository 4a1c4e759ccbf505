"""Frames a caller fills in page-locked host memory, so the GPU copies them from where they are.

A track request's images normally take a staging copy into pinned memory before their asynchronous copy to the GPU
(a fraction of a millisecond of a host core per 640x480 frame, most of a request's host time). A producer that
writes each frame anyway (a camera driver filling a caller's buffer, a depth conversion ``np.multiply(raw, scale,
out=depth)``, a decoder with ``dst=``) can write it into a :class:`PageLockedFrames` slot instead: such arrays are
recognised by :func:`deploy_core.memory.page_locking.is_page_locked_array` and used in place, with no staging copy. The
contract is that of the ingest rings: a slot must stay unchanged until the answer of the request that reads it.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from deploy_core.memory.page_locking import page_lock, page_unlock

__all__ = ["PageLockedFrames", "SharedFrames"]

log = logging.getLogger(__name__)

_ALIGN = 64  # every image starts on a cache line


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class PageLockedFrames:
    """``count`` slots of rgb (H, W, 3) uint8 + depth (H, W) float32 in one host block, page-locked for CUDA when
    ``lock`` (one ``cudaHostRegister`` for all; ordinary memory otherwise, e.g. on a CPU service).

    ``frames[i]`` is slot i's ``(rgb, depth)``: writeable C-contiguous NumPy views, the same arrays every time.
    :meth:`close` (or the ``with`` block's end) waits for the device and unlocks the block; the arrays stay valid
    as ordinary memory afterwards (requests then stage them by copy again)."""

    def __init__(self, count: int, hw: tuple[int, int], *, lock: bool) -> None:
        h, w = int(hw[0]), int(hw[1])
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        if h < 2 or w < 2:
            raise ValueError(f"hw must be at least (2, 2) (H, W), got {hw}")
        self.hw = (h, w)
        self._depth_at = _aligned(h * w * 3)
        self._slot = _aligned(self._depth_at + h * w * 4)
        self.nbytes = count * self._slot
        raw = np.empty(self.nbytes + _ALIGN, np.uint8)
        start = (-raw.__array_interface__["data"][0]) % _ALIGN
        self._block = raw[start:start + self.nbytes]
        self._frames = [self._views(i) for i in range(count)]
        self._address = int(self._block.__array_interface__["data"][0])
        self.locked = False
        if lock:
            error = page_lock(self._address, self.nbytes)
            if error != 0:
                raise RuntimeError(f"page-locking {self.nbytes / 2**20:.1f} MiB of frames failed (cudaError {error})")
            self.locked = True

    def _views(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        h, w = self.hw
        slot = self._block[i * self._slot:(i + 1) * self._slot]
        rgb = slot[: h * w * 3].reshape(h, w, 3)
        depth = slot[self._depth_at:self._depth_at + h * w * 4].view(np.float32).reshape(h, w)
        return rgb, depth

    def __len__(self) -> int:
        return len(self._frames)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self._frames[i]

    def close(self) -> None:
        """Unlock the block once no copy from it can be in flight (synchronises the device); idempotent."""
        if not self.locked:
            return
        import torch

        torch.cuda.synchronize()
        error = page_unlock(self._address)
        self.locked = False
        if error != 0:
            log.warning("page-locked frames: cudaHostUnregister failed (cudaError %d)", error)

    def __enter__(self) -> PageLockedFrames:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class SharedFrames:
    """Copies of frames that several requests read (the objects of one frame), in page-locked blocks.

    :meth:`share` copies a frame's images once into a block page-locked through
    :func:`~deploy_core.memory.page_locking.page_lock`; every request of that frame then uses the returned arrays in
    place (:func:`~deploy_core.memory.page_locking.is_page_locked_array`: no staging copy per request), and a batch
    whose rows read the same arrays copies them to the GPU once. A block is reused once every array viewing it is
    gone (:class:`~deploy_core.memory.pinned.PinnedBlocks`), so whoever submits from the arrays keeps them until the
    answers, unchanged. Blocks stay locked until :meth:`close`. ``lock`` False (a CPU service): :meth:`share`
    returns the images as C-contiguous arrays of their dtype, copying only what is not."""

    def __init__(self, *, lock: bool) -> None:
        from deploy_core.memory.pinned import PinnedBlocks

        self.lock = lock
        self._locked: list[tuple[int, np.ndarray]] = []  # (address, memory) of each block page-locked
        self._closed = False
        self._blocks = PinnedBlocks(max_free_bytes=1 << 62, allocate=self._allocate)  # freed blocks stay locked

    def _allocate(self, nbytes: int) -> Any:
        import torch

        if self._closed:
            raise RuntimeError("shared frames: closed")
        raw = np.empty(nbytes + _ALIGN, np.uint8)
        start = (-raw.__array_interface__["data"][0]) % _ALIGN
        block = raw[start:start + nbytes]
        address = int(block.__array_interface__["data"][0])
        error = page_lock(address, nbytes)
        if error != 0:
            raise RuntimeError(f"page-locking a shared frame of {nbytes / 2**20:.1f} MiB failed (cudaError {error})")
        self._locked.append((address, raw))
        return torch.from_numpy(block)

    @property
    def blocks(self) -> int:
        """Blocks page-locked so far (each holds one frame; reused once free)."""
        return len(self._locked)

    def share(self, rgb: np.ndarray, depth: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``rgb`` (H, W, 3) uint8 and ``depth`` (H, W) float32 as arrays every request of this frame reads in
        place: copied once into a page-locked block when locking, else returned as they are (C-contiguous)."""
        rgb = np.ascontiguousarray(rgb, dtype=np.uint8)
        depth = np.ascontiguousarray(depth, dtype=np.float32)
        if not self.lock:
            return rgb, depth
        depth_at = _aligned(rgb.nbytes)
        block = self._blocks.take(_aligned(depth_at + depth.nbytes))
        rgb_out = block[:rgb.nbytes].reshape(rgb.shape)
        depth_out = block[depth_at:depth_at + depth.nbytes].view(np.float32).reshape(depth.shape)
        np.copyto(rgb_out, rgb)
        np.copyto(depth_out, depth)
        return rgb_out, depth_out

    def close(self) -> None:
        """Unlock every block once no copy from one can be in flight (synchronises the device); idempotent. Arrays
        still held stay valid as ordinary memory."""
        if self._closed:
            return
        self._closed = True
        if not self._locked:
            return
        import torch

        torch.cuda.synchronize()
        for address, _ in self._locked:
            error = page_unlock(address)
            if error != 0:
                log.warning("shared frames: cudaHostUnregister failed (cudaError %d)", error)
        self._locked.clear()
