"""deploy_core.memory.frames: slots a caller fills in page-locked memory, used in place by track requests."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deploy_core.memory import PageLockedFrames, PinnedCopies, SharedFrames, is_page_locked_array

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locking needs a CUDA device")


def test_slots_are_separate_aligned_writeable_views() -> None:
    with PageLockedFrames(3, (5, 7), lock=False) as frames:
        assert len(frames) == 3 and frames.hw == (5, 7) and not frames.locked
        for i in range(3):
            rgb, depth = frames[i]
            assert rgb.shape == (5, 7, 3) and rgb.dtype == np.uint8
            assert depth.shape == (5, 7) and depth.dtype == np.float32
            for arr in (rgb, depth):
                assert arr.flags.c_contiguous and arr.flags.writeable
                assert arr.__array_interface__["data"][0] % 64 == 0
            assert frames[i][0] is rgb  # the same arrays every time
            rgb[...] = i + 1
            depth[...] = 0.5 * (i + 1)
        for i in range(3):  # no slot overlaps another, nor its rgb its depth
            assert (frames[i][0] == i + 1).all() and (frames[i][1] == np.float32(0.5 * (i + 1))).all()
        assert not np.shares_memory(frames[0][1], frames[1][0])
        assert not is_page_locked_array(frames[0][1], np.float32)  # ordinary memory without lock
    frames.close()  # idempotent


@pytest.mark.parametrize(("count", "hw", "match"), [(0, (4, 4), "count"), (1, (1, 4), "hw"), (2, (4, 0), "hw")])
def test_bad_sizes_are_refused(count: int, hw: tuple[int, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PageLockedFrames(count, hw, lock=False)


@cuda
def test_locked_slots_are_staged_in_place_until_closed() -> None:
    copies = PinnedCopies(pinned=True)
    frames = PageLockedFrames(2, (4, 6), lock=True)
    rgb, depth = frames[1]
    rgb[...] = np.arange(72, dtype=np.uint8).reshape(4, 6, 3)
    depth[...] = np.linspace(0.1, 1.0, 24, dtype=np.float32).reshape(4, 6)
    assert frames.locked and is_page_locked_array(rgb, np.uint8) and is_page_locked_array(depth, np.float32)
    rgb_t, depth_t = copies.of(rgb, depth)
    assert np.shares_memory(rgb_t.numpy(), rgb) and np.shares_memory(depth_t.numpy(), depth)  # no staging copy
    on_gpu = depth_t.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(on_gpu.cpu().numpy(), depth)
    frames.close()
    assert not frames.locked and not is_page_locked_array(depth, np.float32)
    copied, _ = copies.of(rgb, depth)  # ordinary memory again: staged by copy
    assert not np.shares_memory(copied.numpy(), rgb)


def test_shared_frames_without_locking_hand_back_the_images_themselves() -> None:
    shared = SharedFrames(lock=False)
    rgb = np.arange(60, dtype=np.uint8).reshape(4, 5, 3)
    depth = np.full((4, 5), 0.75, np.float32)
    got_rgb, got_depth = shared.share(rgb, depth)
    assert got_rgb is rgb and got_depth is depth  # already C-contiguous of their dtype: no copy
    strided, _ = shared.share(np.asfortranarray(rgb), depth)
    assert strided.flags.c_contiguous and np.array_equal(strided, rgb)
    assert shared.blocks == 0
    shared.close()


@cuda
def test_shared_frames_copy_once_into_page_locked_blocks_reused_when_free() -> None:
    import gc

    shared = SharedFrames(lock=True)
    rgb = np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3)
    depth = np.linspace(0.2, 1.2, 24, dtype=np.float32).reshape(4, 6)
    got_rgb, got_depth = shared.share(rgb, depth)
    assert is_page_locked_array(got_rgb, np.uint8) and is_page_locked_array(got_depth, np.float32)
    np.testing.assert_array_equal(got_rgb, rgb)
    np.testing.assert_array_equal(got_depth, depth)
    assert not np.shares_memory(got_rgb, got_depth)
    rgb_t, depth_t = PinnedCopies(pinned=True).of(got_rgb, got_depth)  # a request's staging: none, used in place
    assert np.shares_memory(rgb_t.numpy(), got_rgb) and np.shares_memory(depth_t.numpy(), got_depth)
    other, _ = shared.share(rgb, depth)  # the first frame is still held: a second block
    assert shared.blocks == 2 and not np.shares_memory(other, got_rgb)
    del got_rgb, got_depth, rgb_t, depth_t, other
    gc.collect()
    shared.share(rgb, depth)
    assert shared.blocks == 2  # a freed block is reused
    shared.close()
    assert shared.blocks == 0
