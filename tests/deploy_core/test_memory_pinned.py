"""deploy_core.memory.pinned: blocks are reused by size once every view of them is gone, within the byte cap."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from deploy_core.memory.pinned import PinnedBlocks, PinnedCopies


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


def test_frame_staging_copies_into_one_aligned_block_per_frame() -> None:
    blocks = PinnedBlocks(allocate=_plain)
    copies = PinnedCopies(pinned=True, blocks=blocks)
    rgb = np.arange(5 * 7 * 3, dtype=np.uint8).reshape(5, 7, 3)
    depth = np.linspace(0.2, 1.5, 35, dtype=np.float32).reshape(5, 7)
    mask = depth > 0.8
    staged = copies.of(rgb, depth, mask)
    for got, want in zip(staged, (rgb, depth, mask), strict=True):
        assert got.dtype == torch.from_numpy(want).dtype and tuple(got.shape) == want.shape
        np.testing.assert_array_equal(got.numpy(), want)
        assert not np.shares_memory(got.numpy(), want)  # a copy, not the caller's memory
        assert got.data_ptr() % 64 == 0  # each image on a cache line
    assert blocks.allocated == 1  # the three images share one block
    del staged, got  # every view of the block
    gc.collect()
    copies.of(rgb, depth, mask)
    assert blocks.allocated == 1  # the block came back and was reused


def test_frame_staging_without_pinning_gives_zero_copy_views() -> None:
    rgb = np.zeros((4, 4, 3), np.uint8)
    depth = np.ones((4, 4), np.float32)
    rgb_t, depth_t = PinnedCopies(pinned=False).of(rgb, depth)
    assert np.shares_memory(rgb_t.numpy(), rgb) and np.shares_memory(depth_t.numpy(), depth)
