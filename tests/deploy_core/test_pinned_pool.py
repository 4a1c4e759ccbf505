"""deploy_core.pinned_pool: blocks are reused by size once every view of them is gone, within the byte cap."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from deploy_core.pinned_pool import PinnedBlocks


def _plain(nbytes: int) -> torch.Tensor:  # CPU machines have no pinned allocator: the pool's logic on plain memory
    return torch.empty(nbytes, dtype=torch.uint8)


def test_a_block_is_reused_only_after_its_last_view_is_gone() -> None:
    pool = PinnedBlocks(allocate=_plain)
    a = pool.take(64)
    view = a[:16].view(np.float32)  # a derived view keeps the block taken
    address = a.__array_interface__["data"][0]
    del a
    gc.collect()
    b = pool.take(64)
    assert b.__array_interface__["data"][0] != address and pool.allocated == 2
    del view
    c = pool.take(64)  # the first block came back when its last view went
    assert c.__array_interface__["data"][0] == address and pool.allocated == 2
    assert pool.take(32).size == 32 and pool.allocated == 3  # another size: a block of its own
    del b, c


def test_freed_bytes_beyond_the_cap_are_not_kept() -> None:
    pool = PinnedBlocks(max_free_bytes=100, allocate=_plain)
    blocks = [pool.take(60) for _ in range(3)]
    del blocks
    assert pool.free_bytes() == 60  # one kept, two released
    again = pool.take(60)  # the kept one
    assert pool.free_bytes() == 0 and pool.allocated == 3 and again.size == 60


def test_sizes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="nbytes"):
        PinnedBlocks(allocate=_plain).take(0)
    with pytest.raises(ValueError, match="max_free_bytes"):
        PinnedBlocks(max_free_bytes=-1)
