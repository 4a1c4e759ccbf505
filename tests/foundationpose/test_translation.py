"""Translation guess from depth + mask (spec §2.2) and the valid-pixel count (§1.2 step 3)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from foundationpose.sampling import count_valid_masked_depth, guess_translation

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    ),
]
K64 = np.array([[600.0, 0.0, 31.5], [0.0, 590.0, 22.25], [0.0, 0.0, 1.0]])


def reference_guess(depth: np.ndarray, mask: np.ndarray, K: np.ndarray) -> np.ndarray:
    """NumPy transcription of spec §2.2 (float64 except the float32 median)."""
    rows, cols = np.nonzero(mask > 0)
    if len(rows) == 0:
        return np.zeros(3, dtype=np.float32)
    u_c = (cols.min() + cols.max()) / 2.0
    v_c = (rows.min() + rows.max()) / 2.0
    valid = (mask > 0) & (depth >= np.float32(0.001))
    if not valid.any():
        return np.zeros(3, dtype=np.float32)
    z_c = np.median(depth[valid])  # float32, mean of the middle two for an even count
    return ((np.linalg.inv(K) @ np.array([u_c, v_c, 1.0])) * z_c).astype(np.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_plane_known_answer(device: str) -> None:
    depth = np.full((48, 64), np.float32(0.85), dtype=np.float32)
    mask = np.zeros((48, 64), dtype=bool)
    mask[5:15, 10:21] = True  # rows 5..14 -> v_c = 9.5; cols 10..20 -> u_c = 15
    depth[6, 12] = 0.0  # a hole inside the mask is ignored
    t = guess_translation(torch.from_numpy(depth).to(device), torch.from_numpy(mask).to(device), K64)
    assert t.dtype == torch.float32 and t.shape == (3,) and t.device.type == device
    z = 0.85
    expected = np.array([(15.0 - 31.5) / 600.0 * z, (9.5 - 22.25) / 590.0 * z, z])
    np.testing.assert_allclose(t.cpu().numpy(), expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(t.cpu().numpy(), reference_guess(depth, mask, K64))


@pytest.mark.parametrize("device", DEVICES)
def test_even_count_median_is_mean_of_middle_two(device: str) -> None:
    depth = np.zeros((10, 12), dtype=np.float32)
    mask = np.zeros((10, 12), dtype=bool)
    values = np.array([1.010, 1.001, 0.998, 1.003], dtype=np.float32)
    for (r, c), z in zip([(2, 3), (4, 7), (6, 5), (7, 8)], values, strict=True):
        depth[r, c] = z
        mask[r, c] = True
    mask[3, 3] = True  # masked but no depth: not counted
    depth[0, 0] = 5.0  # depth outside the mask: not counted
    t = guess_translation(torch.from_numpy(depth).to(device), torch.from_numpy(mask).to(device), K64)
    z_c = (np.float32(1.001) + np.float32(1.003)) / np.float32(2)
    assert t[2].item() == np.float32(z_c)
    # torch.median would return the lower middle value; the guess must not.
    assert torch.from_numpy(values).median().item() == np.float32(1.001)
    np.testing.assert_array_equal(t.cpu().numpy(), reference_guess(depth, mask, K64))


@pytest.mark.parametrize("seed", range(5))
def test_random_masks_match_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    depth = (rng.integers(0, 1500, size=(30, 40)) / 1000.0).astype(np.float32)  # includes zeros
    mask = rng.random((30, 40)) < 0.3
    got = guess_translation(torch.from_numpy(depth), torch.from_numpy(mask), torch.from_numpy(K64))
    np.testing.assert_array_equal(got.numpy(), reference_guess(depth, mask, K64))


def test_numeric_mask_and_float32_K() -> None:
    depth = torch.full((8, 9), 2.0)
    mask = torch.zeros((8, 9), dtype=torch.uint8)
    mask[2:4, 3:6] = 255
    t = guess_translation(depth, mask, torch.tensor(K64, dtype=torch.float32))
    torch.testing.assert_close(t, torch.tensor([(4.0 - 31.5) / 600 * 2, (2.5 - 22.25) / 590 * 2, 2.0]))


def test_empty_mask_or_no_valid_depth_gives_zero() -> None:
    depth = torch.full((8, 9), 1.0)
    empty = torch.zeros((8, 9), dtype=torch.bool)
    assert not guess_translation(depth, empty, K64).any()
    mask = empty.clone()
    mask[2:5, 2:5] = True
    holes = depth.clone()
    holes[mask] = 0.0005  # below 0.001: not valid
    t = guess_translation(holes, mask, K64)
    assert torch.isfinite(t).all() and not t.any()
    assert count_valid_masked_depth(holes, mask) == 0


def test_count_valid_masked_depth_uses_float32_threshold() -> None:
    depth = torch.tensor([[0.001, 0.0009, 0.0, 2.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float32)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    assert count_valid_masked_depth(depth, mask) == 3  # float32(0.001) itself is valid
    assert isinstance(count_valid_masked_depth(depth, mask), int)
