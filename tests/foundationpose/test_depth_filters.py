"""Depth erosion / bilateral filter / back-projection against per-pixel transcriptions of spec §2.3."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from foundationpose.sampling import bilateral_filter_depth, depth_to_xyz, erode_depth

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    ),
]
F32 = np.float32


# ----------------------------------------------------------------------------------------------
# Naive references: one pixel at a time, NumPy float32 scalars, the spec's loop order
# (outer loop over columns u = w-r..w+r, inner over rows v = h-r..h+r, out-of-image skipped).
# ----------------------------------------------------------------------------------------------


def _window_positions(h: int, w: int, height: int, width: int, radius: int):
    for u in range(w - radius, w + radius + 1):
        if u < 0 or u >= width:
            continue
        for v in range(h - radius, h + radius + 1):
            if v < 0 or v >= height:
                continue
            yield u, v


def naive_erode(
    depth: np.ndarray, radius=2, depth_diff_thres=0.001, ratio_thres=0.8, zfar=100.0
) -> np.ndarray:
    """Mirrors foundationpose.sampling.erode_depth for one (H, W) float32 image."""
    height, width = depth.shape
    out = np.zeros_like(depth)
    for h in range(height):
        for w in range(width):
            z0 = depth[h, w]
            bad = 0
            total = 0
            for u, v in _window_positions(h, w, height, width, radius):
                z = depth[v, u]
                total += 1
                if z < F32(0.001) or z >= F32(zfar) or abs(z - z0) > F32(depth_diff_thres):
                    bad += 1
            out[h, w] = F32(0.0) if F32(bad) / F32(total) > F32(ratio_thres) else z0
    return out


def naive_bilateral(depth: np.ndarray, radius=2, sigma_d=2.0, sigma_r=100000.0, zfar=100.0) -> np.ndarray:
    """Mirrors foundationpose.sampling.bilateral_filter_depth for one (H, W) float32 image."""
    height, width = depth.shape
    out = np.zeros_like(depth)
    for h in range(height):
        for w in range(width):
            z_centre = depth[h, w]
            total = F32(0.0)
            count = 0
            for u, v in _window_positions(h, w, height, width, radius):
                z = depth[v, u]
                if F32(0.001) <= z < F32(zfar):
                    total = F32(total + z)
                    count += 1
            if count == 0:
                continue
            mean = F32(total / F32(count))
            sum_w = F32(0.0)
            sum_wz = F32(0.0)
            for u, v in _window_positions(h, w, height, width, radius):
                z = depth[v, u]
                if F32(0.001) <= z < F32(zfar) and abs(z - mean) < F32(0.01):
                    spatial = F32((u - w) ** 2 + (v - h) ** 2) / F32(2.0 * sigma_d * sigma_d)
                    diff = F32(z_centre - z)
                    arg = F32(-spatial - diff * diff / F32(2.0 * sigma_r * sigma_r))
                    # A correctly rounded expf (NumPy's float32 exp is up to 1 ulp off on these weights).
                    weight = F32(np.exp(np.float64(arg)))
                    sum_w = F32(sum_w + weight)
                    sum_wz = F32(sum_wz + F32(weight * z))
            if sum_w > F32(0.0):
                out[h, w] = F32(sum_wz / sum_w)
    return out


def random_depth(seed: int, height: int = 12, width: int = 15) -> np.ndarray:
    """Millimetre-quantised metres (k/1000 -> float32) with a slope, a step edge, noise and holes."""
    rng = np.random.default_rng(seed)
    rows, cols = np.mgrid[0:height, 0:width]
    mm = 800 + 3 * cols + 2 * rows + rng.integers(-2, 3, size=(height, width))  # smooth slope, 1-2 mm noise
    step = rng.integers(2, width - 2)
    mm[:, step:] += rng.choice([15, 150])  # a discontinuity
    mm[rng.random((height, width)) < 0.15] = 0  # holes
    if seed % 2:
        mm[rng.random((height, width)) < 0.03] = 150_000  # beyond zfar = 100 m
    return (mm.astype(np.float64) / 1000.0).astype(np.float32)


# ----------------------------------------------------------------------------------------------
# Erosion
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(6))
def test_erode_matches_naive_exactly(seed: int, device: str) -> None:
    depth = random_depth(seed)
    expected = naive_erode(depth)
    got = erode_depth(torch.from_numpy(depth).to(device)).cpu().numpy()
    assert got.dtype == np.float32 and got.shape == depth.shape
    np.testing.assert_array_equal(got, expected)
    assert (got == 0).sum() > (depth == 0).sum(), "test image should erode some pixels"


def test_erode_batch_equals_per_image() -> None:
    depths = np.stack([random_depth(s) for s in range(3)])
    batched = erode_depth(torch.from_numpy(depths))
    assert batched.shape == (3, 12, 15)
    for i in range(3):
        assert torch.equal(batched[i], erode_depth(torch.from_numpy(depths[i])))


def test_erode_ratio_boundary_20_of_25_is_not_above_0_8() -> None:
    depth = np.full((5, 5), 1.0, dtype=np.float32)
    far = np.float32(2.0)
    ring = [(r, c) for r in range(5) for c in range(5) if (r, c) != (2, 2)]
    for r, c in ring[:20]:  # 20 bad of 25 at the centre pixel: 0.8 is not > 0.8 -> kept
        depth[r, c] = far
    assert erode_depth(torch.from_numpy(depth))[2, 2].item() == 1.0
    depth[ring[20]] = far  # 21 bad -> eroded
    assert erode_depth(torch.from_numpy(depth))[2, 2].item() == 0.0


def test_erode_corner_window_skips_outside_pixels() -> None:
    # The corner window holds 9 in-image pixels. Two good ones (7/9 bad) keep it; one (8/9) erodes it.
    # Treating padding as 25-window zeros would erode both.
    depth = np.zeros((6, 7), dtype=np.float32)
    depth[0, 0] = depth[0, 1] = 1.0
    out = erode_depth(torch.from_numpy(depth)).numpy()
    assert out[0, 0] == 1.0  # 7/9 bad
    assert out[0, 1] == 0.0  # its window has 3 x 4 = 12 pixels: 10/12 bad
    depth[0, 1] = 0.0
    assert erode_depth(torch.from_numpy(depth))[0, 0].item() == 0.0
    # Edge pixel (not corner): window 3 rows x 5 cols = 15; 3 good -> 12/15 = 0.8 -> kept.
    depth = np.zeros((6, 7), dtype=np.float32)
    depth[0, 2:5] = 1.0
    assert erode_depth(torch.from_numpy(depth))[0, 3].item() == 1.0


def _one_mm_pairs() -> tuple[int, int]:
    """k (mm) such that float32((k+1)/1000) - float32(k/1000) is above / not above float32(0.001)."""
    above = below = None
    for k in range(200, 3000):
        a = F32(k / 1000.0)
        b = F32((k + 1) / 1000.0)
        if abs(b - a) > F32(0.001):
            above = above if above is not None else k
        else:
            below = below if below is not None else k
        if above is not None and below is not None:
            return above, below
    raise AssertionError("no pair found")


def test_erode_one_mm_threshold_is_decided_in_float32() -> None:
    k_above, k_below = _one_mm_pairs()
    for k, expect_eroded in ((k_above, True), (k_below, False)):
        # Centre k mm, the 24 neighbours k+1 mm: all 24 "bad" iff the float32 difference exceeds 1 mm.
        depth = np.full((5, 5), F32((k + 1) / 1000.0), dtype=np.float32)
        depth[2, 2] = F32(k / 1000.0)
        centre = erode_depth(torch.from_numpy(depth))[2, 2].item()
        assert centre == (0.0 if expect_eroded else depth[2, 2]), k
        assert centre == naive_erode(depth)[2, 2]
    # In exact (integer-mm) arithmetic neither pair is above 1 mm: a float64 filter would keep k_above.
    assert not (k_above + 1 - k_above) > 1


# ----------------------------------------------------------------------------------------------
# Bilateral
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(6))
def test_bilateral_matches_naive(seed: int, device: str) -> None:
    eroded = naive_erode(random_depth(seed))
    expected = naive_bilateral(eroded)
    got = bilateral_filter_depth(torch.from_numpy(eroded).to(device)).cpu().numpy()
    assert got.dtype == np.float32 and got.shape == eroded.shape
    assert np.isfinite(got).all()
    # Same summation order and float32 ops; the only freedom is the exp implementation. On CPU torch's
    # float32 exp rounded like the correctly rounded reference on every weight tried (40 images of 20x25:
    # bit-identical). CUDA's expf is within 2 ulp and may fuse w*z + sum into an FMA: 1e-6 m allows that.
    if device == "cpu":
        np.testing.assert_array_equal(got, expected)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(got == 0, expected == 0)


def test_bilateral_batch_equals_per_image() -> None:
    depths = np.stack([naive_erode(random_depth(s)) for s in range(3)])
    batched = bilateral_filter_depth(torch.from_numpy(depths))
    for i in range(3):
        assert torch.equal(batched[i], bilateral_filter_depth(torch.from_numpy(depths[i])))


def test_bilateral_fills_holes_and_keeps_a_plane() -> None:
    depth = np.full((9, 10), F32(0.75), dtype=np.float32)
    depth[4, 5] = 0.0  # a one-pixel hole
    depth[0, 0] = 0.0  # a corner hole
    out = bilateral_filter_depth(torch.from_numpy(depth)).numpy()
    # sum(w z) / sum(w) of equal z rounds to within a few ulp of z (measured 1.8e-7).
    np.testing.assert_allclose(out, 0.75, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(out, naive_bilateral(depth))


def test_bilateral_all_invalid_gives_zero_and_far_values_are_ignored() -> None:
    depth = np.zeros((6, 6), dtype=np.float32)
    assert not bilateral_filter_depth(torch.from_numpy(depth)).any()
    depth[:] = 150.0  # >= zfar: invalid
    assert not bilateral_filter_depth(torch.from_numpy(depth)).any()


def test_bilateral_gate_excludes_far_from_mean() -> None:
    # Window mean of a 2-level image is between the levels; values >= 1 cm away from it do not count.
    depth = np.full((5, 5), F32(1.0), dtype=np.float32)
    depth[:, 3:] = F32(1.2)  # 10 of 25 at 1.2: mean 1.08 -> neither level is within 1 cm -> 0
    assert bilateral_filter_depth(torch.from_numpy(depth))[2, 2].item() == 0.0
    assert naive_bilateral(depth)[2, 2] == 0.0


def test_filters_reject_non_float32() -> None:
    with pytest.raises(TypeError):
        erode_depth(torch.zeros(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError):
        bilateral_filter_depth(torch.zeros(1, 1, 4, 4))


# ----------------------------------------------------------------------------------------------
# Back-projection
# ----------------------------------------------------------------------------------------------

K64 = np.array([[615.3, 0.0, 323.7], [0.0, 612.9, 239.1], [0.0, 0.0, 1.0]])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("float64", [True, False])
def test_depth_to_xyz_matches_numpy_formula(float64: bool, device: str) -> None:
    depth = random_depth(3, 20, 30)
    depth[0, 0] = F32(0.0009)  # below min_depth
    dtype = np.float64 if float64 else np.float32
    K = K64.astype(dtype)
    v, u = np.mgrid[0:20, 0:30].astype(dtype)
    z = depth.astype(dtype)
    x = ((u - K[0, 2]) * z) / K[0, 0]
    y = ((v - K[1, 2]) * z) / K[1, 1]
    expected = np.stack([x, y, z], axis=-1).astype(np.float32)
    expected[depth < F32(0.001)] = 0.0

    got = depth_to_xyz(torch.from_numpy(depth).to(device), K64, float64=float64).cpu().numpy()
    assert got.dtype == np.float32 and got.shape == (20, 30, 3)
    if device == "cpu":
        np.testing.assert_array_equal(got, expected)
    else:  # one IEEE op each; CUDA division is IEEE too, but allow 1 ulp
        np.testing.assert_allclose(got, expected, rtol=2e-7, atol=0)
    assert not got[0, 0].any() and not got[depth == 0].any()


def test_depth_to_xyz_paths_differ_only_in_rounding() -> None:
    depth = torch.from_numpy(random_depth(4, 20, 30))
    xyz64 = depth_to_xyz(depth, K64, float64=True)
    xyz32 = depth_to_xyz(depth, torch.from_numpy(K64), float64=False)
    torch.testing.assert_close(xyz32, xyz64, rtol=1e-6, atol=1e-7)
    assert torch.equal(xyz64[..., 2], torch.where(depth >= 0.001, depth, 0.0))


def test_depth_to_xyz_batch() -> None:
    depths = torch.from_numpy(np.stack([random_depth(s, 8, 9) for s in range(2)]))
    batched = depth_to_xyz(depths, K64)
    assert batched.shape == (2, 8, 9, 3)
    for i in range(2):
        assert torch.equal(batched[i], depth_to_xyz(depths[i], K64))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("float64", [True, False])
def test_depth_to_xyz_per_image_k_equals_one_call_per_image(device: str, float64: bool) -> None:
    depths = torch.from_numpy(np.stack([random_depth(s, 8, 9) for s in range(3)])).to(device)
    Ks = np.stack([K64, K64 * [[0.5], [0.75], [1.0]], K64 + [[0, 0, 3.25], [0, 0, -1.5], [0, 0, 0]]])
    batched = depth_to_xyz(depths, Ks, float64=float64)
    assert batched.shape == (3, 8, 9, 3) and batched.dtype == torch.float32
    for i in range(3):
        assert torch.equal(batched[i], depth_to_xyz(depths[i], Ks[i], float64=float64))
    assert not torch.equal(batched[0], batched[1])  # the per-image K is really used


@pytest.mark.parametrize("float64", [True, False])
def test_owner_constants_change_no_value_and_hold_one_k_per_camera(float64: bool) -> None:
    """The estimator's memo (``constants=``): the same bits as uploading per call; one device K per camera and
    precision, shared by single frames and batches; the filters' float32 constants once per device."""
    from foundationpose.render._cache import GeometryConstants
    from foundationpose.sampling.depth_filters import filter_depth_and_backproject

    c = GeometryConstants(name="test")
    depths = torch.from_numpy(np.stack([random_depth(s, 8, 9) for s in range(3)]))
    K_b = K64 * [[0.5], [0.75], [1.0]]
    Ks = np.stack([K64, K_b, K64])
    for _ in range(2):  # the second round only reads the memo
        assert torch.equal(depth_to_xyz(depths, Ks, float64=float64, constants=c),
                           depth_to_xyz(depths, Ks, float64=float64))
        assert torch.equal(depth_to_xyz(depths[1], K_b, float64=float64, constants=c),
                           depth_to_xyz(depths[1], K_b, float64=float64))
        got = filter_depth_and_backproject(depths, K64, xyz_float64=float64, impl="torch", constants=c)
        want = filter_depth_and_backproject(depths, K64, xyz_float64=float64, impl="torch")
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert len(c.intrinsics) == 2  # K64 and K_b, in this precision
    shapes_after = len(c.shapes)
    assert shapes_after > 0
    erode_depth(depths, constants=c), bilateral_filter_depth(depths, constants=c)
    assert len(c.shapes) == shapes_after  # nothing new for the same filter parameters on the same device


def test_depth_to_xyz_rejects_k_that_does_not_match_the_batch() -> None:
    depths = torch.zeros(2, 4, 5)
    with pytest.raises(ValueError, match=r"^K must be \(3, 3\), or \(B, 3, 3\) with B = the depth batch; "
                       r"got K \(3, 3, 3\) for depth \(2, 4, 5\)$"):
        depth_to_xyz(depths, np.stack([K64] * 3))
    with pytest.raises(ValueError, match=r"^K must be"):
        depth_to_xyz(depths[0], np.stack([K64] * 2))  # per-image K needs a batch


@pytest.mark.parametrize("radius", [1, 3])
def test_other_radii_match_naive(radius: int) -> None:
    depth = random_depth(7)
    eroded = erode_depth(torch.from_numpy(depth), radius=radius).numpy()
    np.testing.assert_array_equal(eroded, naive_erode(depth, radius=radius))
    smoothed = bilateral_filter_depth(torch.from_numpy(eroded), radius=radius, sigma_d=1.5).numpy()
    np.testing.assert_array_equal(smoothed, naive_bilateral(eroded, radius=radius, sigma_d=1.5))
