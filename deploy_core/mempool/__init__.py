"""Preallocated, leased buffer pools: no allocation on the hot path, bounded work in flight.

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

from deploy_core.mempool._pool import Lease, MemBufferPool
from deploy_core.mempool._spec import BufferSpec, PoolStats

__all__ = ["BufferSpec", "Lease", "MemBufferPool", "PoolStats"]
