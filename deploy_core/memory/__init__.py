"""Host and device memory, in one home: leased buffer pools, page-locked staging, page-locked frames.

* :class:`MemBufferPool` (``pool``): preallocated buffer slots leased per package, with GPU-side "free" events;
  a pool without buffers bounds the packages in flight with the same lease rules.
* :class:`PinnedBlocks` and :class:`PinnedCopies` (``pinned``): reusable page-locked host blocks, and a frame's
  images copied into them for an asynchronous copy to the GPU (zero-copy views on the CPU).
* :func:`page_lock` and :func:`is_page_locked_array` (``page_locking``): page-locking memory this process mapped
  (``cudaHostRegister``) and recognising arrays that live in it, so they are copied to the GPU from where they are.
* :class:`PageLockedFrames` (``frames``): frame slots a producer fills in page-locked memory;
  :class:`SharedFrames`: one page-locked copy of a frame several requests read.
* :class:`~deploy_core.memory.ring.FrameRing` (``ring``): frame slots in a file mapping another process fills (the
  server's ingest workers), page-locked with :func:`~deploy_core.memory.ring.pin_ring`; ``leftovers`` removes the
  files of processes that died.

::

    pool = MemBufferPool([BufferSpec("crops", (252, 160, 160, 6), torch.float32),
                          BufferSpec("scores", (252, 1), torch.float32, host=True)],
                         slots=3, device="cuda")
    with pool.acquire(timeout=1.0, owner=frame_id) as lease:
        lease.wait(stream)                            # GPU-side wait for the previous lessee (no-op on CPU)
        crops = lease.view("crops", (n, 160, 160, 6)) # a view inside the fixed capacity
        ...
        lease.release(stream)                         # records the slot's "free" event on `stream`
"""

from deploy_core.memory.frames import PageLockedFrames, SharedFrames
from deploy_core.memory.page_locking import (
    is_page_locked,
    is_page_locked_array,
    page_lock,
    page_locked_ranges,
    page_unlock,
)
from deploy_core.memory.pinned import PinnedBlocks, PinnedCopies
from deploy_core.memory.pool import Lease, MemBufferPool
from deploy_core.memory.spec import BufferSpec, PoolStats

__all__ = [
    "BufferSpec",
    "Lease",
    "MemBufferPool",
    "PageLockedFrames",
    "PinnedBlocks",
    "PinnedCopies",
    "PoolStats",
    "SharedFrames",
    "is_page_locked",
    "is_page_locked_array",
    "page_lock",
    "page_locked_ranges",
    "page_unlock",
]
