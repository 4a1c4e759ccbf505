"""Frame memory shared between two processes: a file-backed mapping of fixed slots, each one decoded frame.

The server's ingest workers use it (one ring per worker). A slot holds rgb (H, W, 3) uint8, depth (H, W) float32
metres and a mask (H, W) uint8 (a stream's register), up to the server's largest image. The worker creates the file, writes a decoded frame into a free slot and names the slot in its message to the GPU process;
the GPU process maps the same file and reads the frame in place (no copy between the processes). Slots are the
worker's to hand out (:meth:`FrameRing.acquire` / :meth:`release`): a slot is busy from the worker's write until
the GPU process's answer to that request arrives, so the two never touch one slot at once. The GPU process
unlinks the file once it has mapped it: the memory goes away with the last mapping, also when a worker dies.
A worker killed before the GPU process mapped its ring leaves the file behind: it is named after the worker's pid
(``fp-ingest-<pid>-*.ring``, :mod:`deploy_core.memory.leftovers`), so the supervisor removes it when that worker exits
(:func:`remove_rings_of`) and those of processes that no longer exist when it starts (:func:`remove_stale_rings`).
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from deploy_core.memory import leftovers
from deploy_core.memory.page_locking import page_lock, page_unlock

__all__ = ["FrameRing", "check_room", "default_ring_dir", "pin_ring", "remove_rings_of", "remove_stale_rings", "slot_bytes",
           "unpin_ring"]

log = logging.getLogger(__name__)

_PREFIX = "fp-ingest-"
_SUFFIX = ".ring"

_ALIGN = 64  # each slot and its depth part start on a cache line


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def slot_bytes(max_hw: tuple[int, int]) -> int:
    """Bytes of one slot for frames up to ``max_hw`` (H, W)."""
    h, w = max_hw
    return _aligned(h * w * 3) + _aligned(h * w * 4) + _aligned(h * w)


def check_room(rings: int, slots: int, max_hw: tuple[int, int], directory: Path | None = None) -> None:
    """OSError naming the shortfall when ``rings`` rings of ``slots`` slots do not fit in ``directory``'s free space
    (checked before the workers start: a worker that cannot create its ring would otherwise fail in a loop)."""
    directory = _ring_dir(directory)
    need = rings * slots * slot_bytes(max_hw)
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise OSError(f"ingest frame rings: {need / 2**20:.0f} MiB needed in {directory} ({rings} workers x {slots} "
                      f"slots of {max_hw[1]}x{max_hw[0]}), {free / 2**20:.0f} MiB free: fewer ingest_slots (--config "
                      "file) or --ingest-workers, a smaller --max-image, or a larger /dev/shm (docker run --shm-size)")


def default_ring_dir() -> Path:
    """/dev/shm where it exists (memory-backed), else the temporary directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _ring_dir(directory: Path | None) -> Path:
    return Path(directory) if directory is not None else default_ring_dir()


def _ring_files(directory: Path | None) -> list[tuple[int, Path]]:
    """(creator pid, path) of every ring file in ``directory`` (default :func:`default_ring_dir`)."""
    return leftovers.owners(_ring_dir(directory), _PREFIX, _SUFFIX)


def remove_rings_of(pid: int, directory: Path | None = None) -> int:
    """Remove the ring files process ``pid`` created and nobody unlinked (it exited before the GPU process mapped
    them); returns how many."""
    return sum(leftovers.remove(path) for owner, path in _ring_files(directory) if owner == pid)


def remove_stale_rings(directory: Path | None = None) -> int:
    """Remove the ring files of processes that no longer exist (workers of a server that was killed); returns how
    many. Files of live processes, and of other users' live ones, stay."""
    return leftovers.remove_stale(_ring_dir(directory), _PREFIX, _SUFFIX)


class FrameRing:
    """``slots`` frame slots of up to ``max_hw`` in the file at ``path`` (created with :meth:`create`, mapped by
    :meth:`open`)."""

    def __init__(self, path: Path, slots: int, max_hw: tuple[int, int], mapping: mmap.mmap) -> None:
        self.path = Path(path)
        self.slots = int(slots)
        self.max_hw = (int(max_hw[0]), int(max_hw[1]))
        self.slot_bytes = slot_bytes(self.max_hw)
        self._map = mapping
        self._free = list(range(self.slots - 1, -1, -1))

    @classmethod
    def create(cls, slots: int, max_hw: tuple[int, int], directory: Path | None = None) -> FrameRing:
        """A new ring file in ``directory`` (default :func:`default_ring_dir`); OSError naming the shortfall."""
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots!r}")
        size = slots * slot_bytes(max_hw)
        directory = _ring_dir(directory)
        check_room(1, slots, max_hw, directory)
        fd, name = tempfile.mkstemp(prefix=leftovers.owned_prefix(_PREFIX), suffix=_SUFFIX, dir=directory)
        try:
            os.posix_fallocate(fd, 0, size)  # reserved now: a full /dev/shm later is an error here, not a SIGBUS then
            mapping = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(name)
            raise
        os.close(fd)
        return cls(Path(name), slots, max_hw, mapping)

    @classmethod
    def open(cls, path: Path, slots: int, max_hw: tuple[int, int]) -> FrameRing:
        """Map an existing ring file (ValueError when its size is not ``slots`` slots of ``max_hw``)."""
        size = slots * slot_bytes(max_hw)
        with open(path, "r+b") as f:
            actual = os.fstat(f.fileno()).st_size
            if actual != size:
                raise ValueError(f"ingest frame ring {path}: {actual} bytes, expected {size} ({slots} slots of {max_hw})")
            mapping = mmap.mmap(f.fileno(), size)
        return cls(Path(path), slots, max_hw, mapping)

    @property
    def size(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def address(self) -> int:
        """The mapping's first byte in this process (for page-locking it, :mod:`server.ingest.hub`)."""
        view = np.frombuffer(self._map, np.uint8, 1)
        try:
            return int(view.ctypes.data)
        finally:
            del view

    # -- the worker's side -------------------------------------------------------------------------------------------
    def acquire(self) -> int | None:
        """A free slot, or None when all are busy."""
        return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.slots or slot in self._free:
            raise ValueError(f"slot {slot} is not a busy slot of this ring")
        self._free.append(slot)

    def release_after(self, slot: int, answered: Any) -> None:
        """Free ``slot`` now when its request never reached the GPU process (``answered`` None) or was answered;
        else once ``answered`` (the request's future) completes: a request cut short may still be read there."""
        if answered is None or answered.done():
            self.release(slot)
        else:
            answered.add_done_callback(lambda _f: self.release(slot))

    @property
    def busy(self) -> int:
        return self.slots - len(self._free)

    def write(self, slot: int, rgb: np.ndarray, depth: np.ndarray, mask: np.ndarray | None = None) -> None:
        """Copy a decoded frame (rgb (H, W, 3) uint8, depth (H, W) float32, optional mask (H, W) uint8) into ``slot``."""
        h, w = depth.shape
        self.rgb(slot, (h, w))[...] = rgb
        self.depth(slot, (h, w))[...] = depth
        if mask is not None:
            self.mask(slot, (h, w))[...] = mask

    # -- both sides ----------------------------------------------------------------------------------------------------
    def rgb(self, slot: int, hw: tuple[int, int]) -> np.ndarray:
        """The (H, W, 3) uint8 view of ``slot``'s rgb."""
        h, w = self._check(slot, hw)
        return np.frombuffer(self._map, np.uint8, h * w * 3, slot * self.slot_bytes).reshape(h, w, 3)

    def depth(self, slot: int, hw: tuple[int, int]) -> np.ndarray:
        """The (H, W) float32 view of ``slot``'s depth."""
        h, w = self._check(slot, hw)
        offset = slot * self.slot_bytes + _aligned(self.max_hw[0] * self.max_hw[1] * 3)
        return np.frombuffer(self._map, np.float32, h * w, offset).reshape(h, w)

    def mask(self, slot: int, hw: tuple[int, int]) -> np.ndarray:
        """The (H, W) uint8 view of ``slot``'s mask."""
        h, w = self._check(slot, hw)
        mh, mw = self.max_hw
        offset = slot * self.slot_bytes + _aligned(mh * mw * 3) + _aligned(mh * mw * 4)
        return np.frombuffer(self._map, np.uint8, h * w, offset).reshape(h, w)

    def _check(self, slot: int, hw: tuple[int, int]) -> tuple[int, int]:
        h, w = int(hw[0]), int(hw[1])
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} out of range 0..{self.slots - 1}")
        if not (0 < h <= self.max_hw[0] and 0 < w <= self.max_hw[1]):
            raise ValueError(f"frame {w}x{h} does not fit the ring's {self.max_hw[1]}x{self.max_hw[0]} slots")
        return h, w

    def unlink(self) -> None:
        """Remove the file (the mappings stay valid); a missing file is fine."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unmap (views still alive keep the mapping: NumPy holds a buffer export, so closing then fails; it goes
        with the last view instead)."""
        try:
            self._map.close()
        except BufferError:
            pass


def pin_ring(ring: FrameRing, device: Any) -> bool:
    """Page-lock ``ring``'s mapping for CUDA (:func:`~deploy_core.memory.page_locking.page_lock`) when ``device`` is a CUDA
    device: its frames then go to the GPU straight from the shared memory, asynchronously, and the track lane's
    per-request staging copy into pinned memory is skipped (:func:`foundationpose.track_graph.stage_images` sees
    page-locked arrays). False (frames are staged as before) on the CPU or when the driver refuses (logged)."""
    if getattr(device, "type", None) != "cuda":
        return False
    error = page_lock(ring.address, ring.size)
    if error != 0:
        log.warning("frame ring of %d MiB could not be page-locked (cudaError %d); its frames are staged by copy",
                    ring.size >> 20, error)
        return False
    return True


def unpin_ring(ring: FrameRing) -> None:
    """Undo :func:`pin_ring` once no copy from the ring can be in flight (the caller synchronised the device)."""
    error = page_unlock(ring.address)
    if error != 0:
        log.warning("frame ring: cudaHostUnregister failed (cudaError %d)", error)
