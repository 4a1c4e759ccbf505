"""Crop windows (spec §2.5) and the kornia-0.7.2-equivalent warps into them (spec §2.6)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from foundationpose._reference import (
    crop_windows_reference,
    scorer_real_xyz_reference,
    warp_to_crops_reference,
)
from foundationpose.crop import (
    crop_sampling_grid,
    crop_windows,
    scorer_real_xyz,
    warp_to_crops,
)
from foundationpose.render._cache import ConstantCache, GeometryConstants
from foundationpose.sampling import depth_to_xyz

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    ),
]
FX, FY = 319.5820007324219, 417.1186828613281
CX, CY = 320.2149847676956, 244.3486680871047
K_DEMO = np.array([[FX, 0.0, CX], [0.0, FY, CY], [0.0, 0.0, 1.0]])
H, W = 480, 640


def pose_at(t: tuple[float, float, float]) -> torch.Tensor:
    pose = torch.eye(4, dtype=torch.float32)
    pose[:3, 3] = torch.tensor(t, dtype=torch.float32)
    return pose


def random_poses(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    poses = torch.eye(4).repeat(n, 1, 1)
    poses[:, 0, 3] = torch.rand(n, generator=g) * 0.4 - 0.2
    poses[:, 1, 3] = torch.rand(n, generator=g) * 0.3 - 0.15
    poses[:, 2, 3] = torch.rand(n, generator=g) * 0.8 + 0.3
    return poses


def sample_positions(
    crop_from_img: np.ndarray, size: int, src_h: int, src_w: int
) -> tuple[np.ndarray, np.ndarray]:
    """Spec §2.6.1 in float64: crop pixel (j, i) samples x_s * W / (W - 1) - 0.5 (likewise y)."""
    jj, ii = np.meshgrid(np.arange(size, dtype=np.float64), np.arange(size, dtype=np.float64))
    pts = np.linalg.inv(crop_from_img.astype(np.float64)) @ np.stack(
        [jj.ravel(), ii.ravel(), np.ones(jj.size)]
    )
    xs, ys = pts[0] / pts[2], pts[1] / pts[2]
    x = xs * src_w / (src_w - 1) - 0.5
    y = ys * src_h / (src_h - 1) - 0.5
    return x.reshape(size, size), y.reshape(size, size)


# ----------------------------------------------------------------------------------------------- windows


def test_crop_window_demo_numbers_by_hand() -> None:
    t = (0.02, -0.01, 0.6)
    crop_from_img = crop_windows(pose_at(t)[None], K_DEMO, 0.2, 1.2)
    assert crop_from_img.dtype == torch.float32 and crop_from_img.shape == (1, 3, 3)
    tx, ty, tz = (float(np.float32(v)) for v in t)  # the pose is float32, promoted to float64
    r = 0.2 * 1.2 / 2
    pts = [(tx, ty, tz), (tx + r, ty, tz), (tx - r, ty, tz), (tx, ty + r, tz), (tx, ty - r, tz)]
    uv = [((FX * x + CX * z) / z, (FY * y + CY * z) / z) for x, y, z in pts]
    cu, cv = uv[0]
    radius = max(max(abs(u - cu), abs(v - cv)) for u, v in uv)
    assert radius == pytest.approx(r * max(FX, FY) / tz, rel=1e-12)
    left, right, top, bottom = (
        round(cu - radius),
        round(cu + radius),
        round(cv - radius),
        round(cv + radius),
    )
    assert (left, right, top, bottom) == (247, 414, 154, 321)  # hand-checked: none near a .5 tie
    sx, sy = np.float32(160 / (right - left)), np.float32(160 / (bottom - top))
    expected = np.array(
        [[sx, 0, np.float32(sx * np.float32(-left))], [0, sy, np.float32(sy * np.float32(-top))], [0, 0, 1]],
        dtype=np.float32,
    )
    np.testing.assert_array_equal(crop_from_img[0].numpy(), expected)
    # the projected object centre lands in the middle of the crop
    centre_crop = crop_from_img[0].double().numpy() @ np.array([cu, cv, 1.0])
    assert np.all(np.abs(centre_crop[:2] - 80.0) <= 1.0)


def test_crop_window_rounds_half_to_even() -> None:
    # u = 200.5 +- 50 exactly: edges 150.5 -> 150, 250.5 -> 250; v = 150.5 +- 50: 100.5 -> 100, 200.5 -> 200
    # then cx = 201.5, cy = 151.5: 151.5 -> 152, 251.5 -> 252 and 101.5 -> 102, 201.5 -> 202
    pose = pose_at((0.0, 0.0, 1.0))[None]
    K = np.array([[100.0, 0.0, 200.5], [0.0, 100.0, 150.5], [0.0, 0.0, 1.0]])
    crop_from_img = crop_windows(pose, K, 1.0, 1.0, S=100)[0].numpy()
    assert crop_from_img[0, 0] == np.float32(1.0) and crop_from_img[0, 2] == np.float32(-150.0)
    assert crop_from_img[1, 1] == np.float32(1.0) and crop_from_img[1, 2] == np.float32(-100.0)
    K[0, 2], K[1, 2] = 201.5, 151.5
    crop_from_img = crop_windows(pose, K, 1.0, 1.0, S=100)[0].numpy()
    assert crop_from_img[0, 2] == np.float32(-152.0) and crop_from_img[1, 2] == np.float32(-102.0)
    assert crop_from_img[0, 0] == np.float32(1.0) and crop_from_img[1, 1] == np.float32(1.0)


def test_crop_window_sides_can_differ_after_rounding() -> None:
    # R = 25.2 px; x: 125.4 -+ R = 100.2 -> 100, 150.6 -> 151 (51 px); y: 125.0 -+ R = 99.8 -> 100, 150.2 -> 150 (50 px)
    K = np.array([[100.0, 0.0, 125.4], [0.0, 100.0, 125.0], [0.0, 0.0, 1.0]])
    crop_from_img = crop_windows(pose_at((0.0, 0.0, 1.0))[None], K, 0.252, 2.0, S=160)[0].numpy()
    sx, sy = np.float32(160 / 51), np.float32(160 / 50)
    assert crop_from_img[0, 0] == sx and crop_from_img[1, 1] == sy and sx != sy
    assert crop_from_img[0, 2] == np.float32(sx * np.float32(-100.0))
    assert crop_from_img[1, 2] == np.float32(sy * np.float32(-100.0))


@pytest.mark.parametrize("device", DEVICES)
def test_crop_windows_batch_equals_single(device: str) -> None:
    poses = random_poses(9).to(device)
    batch = crop_windows(poses, K_DEMO, 0.15, 1.1)
    assert batch.device.type == torch.device(device).type
    for i in range(len(poses)):
        torch.testing.assert_close(
            batch[i : i + 1], crop_windows(poses[i : i + 1], K_DEMO, 0.15, 1.1), rtol=0, atol=0
        )


# ----------------------------------------------------------------------------------------------- warps


def test_bilinear_samples_at_kornia_positions() -> None:
    """A linear ramp image returns its own sample position: x_s * W / (W - 1) - 0.5 (spec §2.6.1)."""
    src_h, src_w, size = 48, 64, 16
    ys, xs = torch.meshgrid(
        torch.arange(src_h, dtype=torch.float32), torch.arange(src_w, dtype=torch.float32), indexing="ij"
    )
    image = torch.stack([xs, ys], dim=-1)  # (H, W, 2): value = pixel coordinate
    crop_from_img = torch.tensor([[[2.0, 0.0, -30.0], [0.0, 2.0, -20.0], [0.0, 0.0, 1.0]]])
    out = warp_to_crops(image, crop_from_img, S=size)
    x, y = sample_positions(crop_from_img[0].numpy(), size, src_h, src_w)
    assert (x.min() > 0) and (x.max() < src_w - 1) and (y.min() > 0) and (y.max() < src_h - 1)  # interior
    # float32 grid arithmetic: the spec's review measured 6e-5 px against kornia; allow 1e-4 px
    np.testing.assert_allclose(out[0, ..., 0].numpy(), x, rtol=0, atol=1e-4)
    np.testing.assert_allclose(out[0, ..., 1].numpy(), y, rtol=0, atol=1e-4)
    # a plain OpenCV-style warp would sample at x_s; at x_s = 15 the kornia stretch moves it by -0.26 px
    assert abs(x[0, 0] - 15.0) > 0.2


def test_bilinear_fades_to_zero_outside_the_image() -> None:
    src_h, src_w, size = 10, 10, 40
    image = torch.ones((src_h, src_w, 1))
    crop_from_img = torch.tensor([[[2.0, 0.0, 8.0], [0.0, 2.0, 8.0], [0.0, 0.0, 1.0]]])  # shows a border band
    out = warp_to_crops(image, crop_from_img, S=size)[0, ..., 0].numpy()
    x, y = sample_positions(crop_from_img[0].numpy(), size, src_h, src_w)

    def coverage(p: np.ndarray, n: int) -> np.ndarray:  # weight that lands on pixels 0..n-1 (1-D)
        return np.clip(1.0 - np.maximum(0.0, -p) - np.maximum(0.0, p - (n - 1)), 0.0, 1.0)

    expected = coverage(x, src_w) * coverage(y, src_h)
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-5)
    assert out[0, 0] == 0.0 and out[20, 20] == 1.0 and 0.0 < out[8, 20] < 1.0


def test_nearest_picks_round_half_even_and_zero_outside() -> None:
    src_h, src_w, size = 12, 16, 24
    ys, xs = torch.meshgrid(
        torch.arange(src_h, dtype=torch.float32), torch.arange(src_w, dtype=torch.float32), indexing="ij"
    )
    image = (1.0 + xs + 100.0 * ys)[..., None]  # unique value per pixel, never 0
    crop_from_img = torch.tensor([[[1.3, 0.0, 3.7], [0.0, 1.7, 2.9], [0.0, 0.0, 1.0]]])
    out = warp_to_crops(image, crop_from_img, S=size, mode="nearest")[0, ..., 0].numpy()
    x, y = sample_positions(crop_from_img[0].numpy(), size, src_h, src_w)
    u, v = np.rint(x), np.rint(y)  # numpy rint: half to even
    inside = (u >= 0) & (u <= src_w - 1) & (v >= 0) & (v <= src_h - 1)
    expected = np.where(inside, 1.0 + u + 100.0 * v, 0.0)
    unambiguous = (np.abs(np.abs(x - np.floor(x)) - 0.5) > 1e-4) & (
        np.abs(np.abs(y - np.floor(y)) - 0.5) > 1e-4
    )
    assert unambiguous.mean() > 0.9 and (~inside).any() and inside.any()
    np.testing.assert_array_equal(out[unambiguous], expected[unambiguous])


def test_grid_sample_nearest_rounds_half_to_even() -> None:
    """The property warp_to_crops relies on (spec §2.6.1): torch's nearest mode rounds ties to even."""
    src = torch.arange(1.0, 9.0).reshape(1, 1, 1, 8)
    # align_corners=False: x = ((g + 1) * 8 - 1) / 2, so g = -0.25, 0, -0.5, 0.25 give x = 2.5, 3.5, 1.5, 4.5
    g = torch.tensor([-0.25, 0.0, -0.5, 0.25] * 4)
    grid = torch.stack([g, torch.zeros_like(g)], dim=-1)[None, None]
    out = torch.nn.functional.grid_sample(src, grid, mode="nearest", align_corners=False).flatten()
    np.testing.assert_array_equal(out.numpy(), np.array([3.0, 5.0, 3.0, 5.0] * 4))  # 2, 4, 2, 4 (+1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
def test_warp_batch_equals_per_hypothesis(device: str, mode: str) -> None:
    g = torch.Generator().manual_seed(1)
    image = (torch.rand(H, W, 3, generator=g) * 255).to(device)
    crop_from_img = crop_windows(random_poses(5).to(device), K_DEMO, 0.2, 1.2)
    batch = warp_to_crops(image, crop_from_img, mode=mode)
    assert batch.shape == (5, 160, 160, 3) and batch.dtype == torch.float32 and batch.is_contiguous()
    for i in range(5):
        single = warp_to_crops(image, crop_from_img[i : i + 1], mode=mode)
        torch.testing.assert_close(batch[i : i + 1], single, rtol=0, atol=0)


def test_warp_writes_into_out_buffer() -> None:
    image = torch.rand(H, W, 3)
    crop_from_img = crop_windows(random_poses(3), K_DEMO, 0.2, 1.2)
    buffer = torch.full((4, 160, 160, 3), -1.0)
    out = warp_to_crops(image, crop_from_img, out=buffer[:3])
    assert out.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(buffer[:3], warp_to_crops(image, crop_from_img), rtol=0, atol=0)
    assert bool((buffer[3] == -1.0).all())


@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
def test_warp_without_the_copy_is_a_channels_first_view_of_the_same_values(mode: str) -> None:
    image = torch.rand(H, W, 3) * 255
    crop_from_img = crop_windows(random_poses(3), K_DEMO, 0.2, 1.2)
    view = warp_to_crops(image, crop_from_img, mode=mode, contiguous=False)
    assert view.shape == (3, 160, 160, 3) and not view.is_contiguous() and view.stride()[-1] == 160 * 160
    assert bits_equal(view, warp_to_crops(image, crop_from_img, mode=mode))
    depth = torch.rand(H, W) + 0.5
    xyz = scorer_real_xyz(depth, crop_from_img, K_DEMO)
    assert xyz.shape == (3, 160, 160, 3) and xyz.stride()[-1] == 160 * 160  # channels-first storage
    grid = crop_sampling_grid(crop_from_img, (H, W))  # the scorer shares it with its RGB warp
    assert bits_equal(scorer_real_xyz(depth, crop_from_img, K_DEMO, grid=grid), xyz)


def test_object_centre_is_at_the_crop_centre() -> None:
    t = (0.02, -0.01, 0.6)
    cu, cv = FX * t[0] / t[2] + CX, FY * t[1] / t[2] + CY
    ys, xs = np.mgrid[0:H, 0:W].astype(np.float64)
    blob = np.exp(-((xs - cu) ** 2 + (ys - cv) ** 2) / (2 * 2.0**2)).astype(np.float32)
    crop = warp_to_crops(torch.from_numpy(blob)[..., None], crop_windows(pose_at(t)[None], K_DEMO, 0.2, 1.2))
    row, col = np.unravel_index(int(torch.argmax(crop[0, ..., 0])), (160, 160))
    assert 79 <= row <= 81 and 79 <= col <= 81


# ----------------------------------------------------------------------------------------------- scorer


def synthetic_depth(seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    depth = 0.4 + 0.6 * torch.rand(H, W, generator=g)
    depth[torch.rand(H, W, generator=g) < 0.2] = 0.0  # holes
    return depth


def test_depth_to_xyz_one_k_batch_formula_and_invalid() -> None:
    depth = torch.tensor([[[0.5, 0.0005], [1.0, 2.0]]])
    xyz = depth_to_xyz(depth, K_DEMO)
    K32 = K_DEMO.astype(np.float32)
    u, v, z = np.float32(1.0), np.float32(1.0), np.float32(2.0)
    assert xyz[0, 1, 1, 0].item() == np.float32(np.float32((u - K32[0, 2]) * z) / K32[0, 0])
    assert xyz[0, 1, 1, 1].item() == np.float32(np.float32((v - K32[1, 2]) * z) / K32[1, 1])
    assert xyz[0, 0, 1].tolist() == [0.0, 0.0, 0.0]  # z < 0.001 -> all zero


def test_scorer_real_xyz_constant_plane() -> None:
    z0 = 0.7
    depth = torch.full((H, W), z0)
    crop_from_img = crop_windows(random_poses(3, seed=4), K_DEMO, 0.2, 1.1)
    xyz = scorer_real_xyz(depth, crop_from_img, K_DEMO)
    assert xyz.shape == (3, 160, 160, 3) and xyz.dtype == torch.float32
    valid = xyz[..., 2] > 0
    assert valid.float().mean() > 0.5
    assert bool(torch.all(xyz[..., 2][valid] == np.float32(z0)))
    # x, y are back-projections of integer full-resolution pixels
    u = xyz[..., 0][valid].double() * FX / z0 + CX
    v = xyz[..., 1][valid].double() * FY / z0 + CY
    assert float((u - u.round()).abs().max()) < 1e-3 and float((v - v.round()).abs().max()) < 1e-3


@pytest.mark.slow
def test_scorer_real_xyz_chunking_and_out_buffer_do_not_change_values() -> None:
    depth = synthetic_depth()
    crop_from_img = crop_windows(random_poses(5, seed=3), K_DEMO, 0.2, 1.1)
    whole = scorer_real_xyz_reference(depth, crop_from_img, K_DEMO, max_pixels_per_chunk=None)
    chunked = scorer_real_xyz_reference(depth, crop_from_img, K_DEMO, max_pixels_per_chunk=2 * H * W)
    torch.testing.assert_close(whole, chunked, rtol=0, atol=0)
    buffer = torch.empty((5, 160, 160, 3))
    into_buffer = scorer_real_xyz(depth, crop_from_img, K_DEMO, out=buffer)
    assert into_buffer.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(into_buffer, whole, rtol=0, atol=0)
    assert bool(((whole[..., 2] == 0) | (whole[..., 2] >= 0.4)).all())


# ----------------------------------------------------------------------------------------------- kornia


@pytest.fixture(scope="module")
def kornia_warp():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kornia = pytest.importorskip("kornia", reason="kornia (test-only cross-check) is not installed")
    return kornia.geometry.transform.warp_perspective


@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
def test_warp_matches_kornia_bit_for_bit(kornia_warp, mode: str) -> None:
    g = torch.Generator().manual_seed(5)
    image = torch.rand(H, W, 3, generator=g) * 255
    crop_from_img = crop_windows(random_poses(7, seed=5), K_DEMO, 0.2, 1.2)
    ours = warp_to_crops(image, crop_from_img, mode=mode)
    src = image.permute(2, 0, 1)[None].expand(7, -1, -1, -1)
    ref = kornia_warp(src, crop_from_img, dsize=(160, 160), mode=mode, align_corners=False).permute(
        0, 2, 3, 1
    )
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)


def test_scorer_double_warp_matches_kornia_bit_for_bit(kornia_warp) -> None:
    depth = synthetic_depth(6)
    n = 4
    crop_from_img = crop_windows(random_poses(n, seed=6), K_DEMO, 0.2, 1.1)
    depth_crop = kornia_warp(
        depth[None, None].expand(n, -1, -1, -1),
        crop_from_img,
        dsize=(160, 160),
        mode="nearest",
        align_corners=False,
    )
    back = kornia_warp(
        depth_crop, crop_from_img.inverse(), dsize=(H, W), mode="nearest", align_corners=False
    )[:, 0]
    xyz_full = depth_to_xyz(back, K_DEMO)
    ref = kornia_warp(
        xyz_full.permute(0, 3, 1, 2), crop_from_img, dsize=(160, 160), mode="nearest", align_corners=False
    ).permute(0, 2, 3, 1)
    ours = scorer_real_xyz(depth, crop_from_img, K_DEMO)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bit pattern (distinguishes -0.0 from 0.0 and compares NaN payloads)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.int32), b.contiguous().view(torch.int32)
    )


def stress_case(seed: int, n: int, device: str) -> tuple[torch.Tensor, np.ndarray]:
    """Poses spread so that some windows are partly or fully outside the 640 x 480 image; K with skew for odd seeds."""
    g = torch.Generator().manual_seed(seed)
    poses = torch.eye(4).repeat(n, 1, 1)
    poses[:, 0, 3] = torch.rand(n, generator=g) * 0.9 - 0.45
    poses[:, 1, 3] = torch.rand(n, generator=g) * 0.7 - 0.35
    poses[:, 2, 3] = torch.rand(n, generator=g) * 1.0 + 0.2
    K = K_DEMO.copy()
    if seed % 2:
        K[0, 1] = 1.25
    return poses.to(device), K


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_crop_windows_bit_identical_to_the_reference(device: str, seed: int) -> None:
    poses, K = stress_case(seed, 40, device)
    for diameter, ratio, size in [(0.2, 1.2, 160), (0.137, 1.1, 160), (0.31, 1.0, 100)]:
        ours = crop_windows(poses, K, diameter, ratio, S=size)
        assert bits_equal(ours, crop_windows_reference(poses, K, diameter, ratio, S=size))
    assert crop_windows(poses[:0], K, 0.2, 1.2).shape == (0, 3, 3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
def test_warp_bit_identical_to_the_reference(device: str, mode: str) -> None:
    g = torch.Generator().manual_seed(11)
    image = (torch.rand(H, W, 3, generator=g) * 255).to(device)
    small = torch.rand(37, 53, 2, generator=g).to(device)
    for n, seed in [(1, 3), (7, 4)]:
        poses, K = stress_case(seed, n, device)
        crop_from_img = crop_windows(poses, K, 0.2, 1.2)
        assert bits_equal(warp_to_crops(image, crop_from_img, mode=mode), warp_to_crops_reference(image, crop_from_img, mode=mode))
        assert bits_equal(
            warp_to_crops(small, crop_from_img, S=24, mode=mode), warp_to_crops_reference(small, crop_from_img, S=24, mode=mode)
        )


@pytest.mark.parametrize("device", DEVICES)
def test_shared_sampling_grid_gives_identical_warps(device: str) -> None:
    g = torch.Generator().manual_seed(12)
    rgb = (torch.rand(H, W, 3, generator=g) * 255).to(device)
    xyz = torch.rand(H, W, 3, generator=g).to(device)
    poses, K = stress_case(5, 6, device)
    crop_from_img = crop_windows(poses, K, 0.2, 1.2)
    grid = crop_sampling_grid(crop_from_img, (H, W))
    assert grid.shape == (6, 160, 160, 2)
    for image, mode in [(rgb, "bilinear"), (xyz, "nearest")]:
        assert bits_equal(warp_to_crops(image, crop_from_img, mode=mode, grid=grid), warp_to_crops(image, crop_from_img, mode=mode))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,seed", [(1, 20), (2, 21), (5, 22), pytest.param(16, 23, marks=pytest.mark.slow)])
def test_scorer_gather_bit_identical_to_full_resolution_double_warp(device: str, n: int, seed: int) -> None:
    """The crop-pixel gather equals the literal double warp (foundationpose._reference), incl.
    windows partly outside the image, holes and depths below the 1 mm threshold."""
    depth = synthetic_depth(seed).to(device)
    depth[torch.rand(H, W, generator=torch.Generator().manual_seed(seed)).to(device) < 0.05] = 0.0005
    poses, K = stress_case(seed, n, device)
    crop_from_img = crop_windows(poses, K, 0.2, 1.1)
    ours = scorer_real_xyz(depth, crop_from_img, K)
    reference = scorer_real_xyz_reference(depth, crop_from_img, K)
    assert bits_equal(ours, reference)
    outside = (ours == 0).all(-1).float().mean()
    assert 0.0 < float(outside) < 1.0  # both valid points and zeros are exercised
    buffer = torch.full((n, 160, 160, 3), float("nan"), device=device)
    assert scorer_real_xyz(depth, crop_from_img, torch.as_tensor(K), out=buffer) is buffer
    assert bits_equal(buffer, reference)


def test_scorer_gather_other_sizes_and_empty_batch() -> None:
    g = torch.Generator().manual_seed(30)
    depth = 0.3 + torch.rand(37, 53, generator=g)
    depth[torch.rand(37, 53, generator=g) < 0.3] = 0.0
    crop_from_img = torch.tensor([[[2.1, 0.0, -12.3], [0.0, 1.7, 4.4], [0.0, 0.0, 1.0]],
                                  [[0.6, 0.0, 3.0], [0.0, 0.6, -2.0], [0.0, 0.0, 1.0]]])
    K = np.array([[40.0, 0.0, 26.3], [0.0, 41.0, 18.1], [0.0, 0.0, 1.0]])
    for size in (24, 160):
        ours = scorer_real_xyz(depth, crop_from_img, K, S=size, min_depth=0.5)
        assert bits_equal(ours, scorer_real_xyz_reference(depth, crop_from_img, K, S=size, min_depth=0.5))
    assert scorer_real_xyz(depth, crop_from_img[:0], K).shape == (0, 160, 160, 3)


@pytest.mark.slow
def test_steady_state_calls_have_no_host_sync_and_no_per_hypothesis_ops() -> None:
    """After a warm-up call (which fills the constant caches) nothing forces a host sync on a GPU: no .item(),
    no linalg error check, no nonzero, no tensor literal (a blocking host-to-device copy on CUDA); and the op
    count does not grow with N (no Python loop over hypotheses)."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: Counter[str] = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            self.names[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    depth = synthetic_depth(7)
    rgb = torch.rand(H, W, 3)
    forbidden = {"_local_scalar_dense", "_linalg_check_errors", "nonzero", "lift_fresh", "masked_select"}
    constants = GeometryConstants()  # what the estimator owns and passes in
    totals = {}
    for n in (1, 3, 16):
        poses = random_poses(n, seed=8)
        crop_from_img = crop_windows(poses, K_DEMO, 0.2, 1.1)
        calls = {
            "crop_windows": lambda p=poses: crop_windows(p, K_DEMO, 0.2, 1.1, constants=constants),
            "warp": lambda f=crop_from_img: warp_to_crops(rgb, f, constants=constants),
            "scorer": lambda f=crop_from_img: scorer_real_xyz(depth, f, K_DEMO, constants=constants),
        }
        for name, call in calls.items():
            call()  # warm-up
            with Ops() as ops:
                call()
            assert not forbidden & set(ops.names), (name, ops.names)
            totals[name, n] = sum(ops.names.values())
    for name in ("crop_windows", "warp", "scorer"):
        assert totals[name, 3] == totals[name, 16], totals  # (N = 1 differs by a few views)


def _per_hypothesis_k(n: int) -> np.ndarray:
    scales = np.linspace(0.7, 1.4, n)
    Ks = np.repeat(K_DEMO[None], n, axis=0)
    Ks[:, 0, 0] *= scales
    Ks[:, 1, 1] *= scales[::-1]
    Ks[:, 0, 2] += 7.3 * scales
    Ks[:, 0, 1] = 0.25 * (scales - 1.0)  # some skew: the window uses the full K
    return Ks


@pytest.mark.parametrize("device", DEVICES)
def test_crop_windows_with_per_hypothesis_k_equal_the_single_k_calls(device: str) -> None:
    poses = random_poses(40, seed=3).to(device)
    Ks = _per_hypothesis_k(40)
    batched = crop_windows(poses, Ks, 0.2, 1.2)
    single = torch.cat([crop_windows(poses[i : i + 1], Ks[i], 0.2, 1.2) for i in range(40)])
    torch.testing.assert_close(batched, single, rtol=0, atol=0)
    same = crop_windows(poses, np.repeat(K_DEMO[None], 40, axis=0), 0.2, 1.2)  # equal stack = the (3, 3) path
    torch.testing.assert_close(same, crop_windows(poses, K_DEMO, 0.2, 1.2), rtol=0, atol=0)
    on_device = crop_windows(poses, torch.as_tensor(Ks, device=device), 0.2, 1.2)
    torch.testing.assert_close(on_device, single, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"K: expected \(3, 3\) or \(40, 3, 3\)"):
        crop_windows(poses, Ks[:3], 0.2, 1.2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
def test_warp_with_one_image_per_crop_equals_separate_warps(device: str, mode: str) -> None:
    g = torch.Generator().manual_seed(5)
    n = 6
    images = (torch.rand(n, 60, 80, 3, generator=g) * 255).to(device)
    crops = crop_windows(random_poses(n, seed=4), K_DEMO * np.array([[0.15], [0.15], [1.0]]), 0.2, 1.2).to(device)
    batched = warp_to_crops(images, crops, mode=mode)
    grid = crop_sampling_grid(crops, (60, 80))
    with_grid = warp_to_crops(images, crops, mode=mode, grid=grid)
    single = torch.cat([warp_to_crops(images[i], crops[i : i + 1], mode=mode) for i in range(n)])
    torch.testing.assert_close(batched, single, rtol=0, atol=0)
    torch.testing.assert_close(with_grid, single, rtol=0, atol=0)
    assert bool((single != 0).any())


def test_constants_are_owned_by_the_caller_and_bounded_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    """No module-global memo: a call without ``constants`` caches nothing; a full memo keeps answering
    (computing new keys per call, same values) and says so once."""
    poses = random_poses(3, seed=9)
    constants = GeometryConstants(max_intrinsics_entries=2)
    assert (len(constants.shapes), len(constants.intrinsics)) == (0, 0)
    want = crop_windows(poses, K_DEMO, 0.2, 1.2)  # no memo: nothing is kept anywhere
    assert bits_equal(crop_windows(poses, K_DEMO, 0.2, 1.2, constants=constants), want)
    assert (len(constants.shapes), len(constants.intrinsics)) == (1, 1)  # window constants, K64
    with caplog.at_level("WARNING", logger="foundationpose.render._cache"):
        for i in range(4):  # 4 more cameras: only one fits
            K = K_DEMO.copy()
            K[0, 2] += i + 1
            got = crop_windows(poses, K, 0.2, 1.2, constants=constants)
            assert bits_equal(got, crop_windows(poses, K, 0.2, 1.2))
    assert len(constants.intrinsics) == 2
    full = [r for r in caplog.records if "is full" in r.getMessage()]
    assert len(full) == 1 and "'geometry.intrinsics' is full (2 entries)" in full[0].getMessage()
    with pytest.raises(ValueError, match=r"^max_entries must be >= 0, got -1$"):
        ConstantCache(-1)
    off = GeometryConstants(max_intrinsics_entries=0)  # memo off: computes every call, keeps nothing, no warning
    caplog.clear()
    with caplog.at_level("WARNING", logger="foundationpose.render._cache"):
        assert bits_equal(crop_windows(poses, K_DEMO, 0.2, 1.2, constants=off), want)
        assert bits_equal(crop_windows(poses, K_DEMO, 0.2, 1.2, constants=off), want)
    assert len(off.intrinsics) == 0 and not caplog.records


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src_hw", [(480, 640), (120, 160), (1, 7)])
def test_closed_form_window_inverse_gives_the_lu_grid(device: str, src_hw: tuple[int, int]) -> None:
    """The capturable closed-form inverse of the normalised windows is the exactly rounded one, within an ulp of the
    LU inverse (linalg.inv_ex): bit for bit where LAPACK's LU divides (MKL on the CPUs CI ran on before 2026-12),
    an ulp apart where it multiplies by the reciprocal (MKL on an AVX-512 AMD EPYC) and on CUDA."""
    from foundationpose.crop import _normalisation_pair, _normalised_inverse

    windows = crop_windows(random_poses(3000, seed=3), K_DEMO, 0.2, 1.2).to(device)
    lu = _normalised_inverse(windows, src_hw, (160, 160))
    closed = _normalised_inverse(windows, src_hw, (160, 160), affine=True)
    # the closed form is the exactly rounded one; an LU may round its shifts an ulp off
    torch.testing.assert_close(closed, lu, rtol=2e-7, atol=0.0)
    # the grids follow from the matrices compared above over all 3000 windows: 300 of them (160x160 points each)
    # check that each grid is built from its inverse, at a tenth of the cost
    grid_lu = crop_sampling_grid(windows[:300], src_hw, 160)
    grid_closed = crop_sampling_grid(windows[:300], src_hw, 160, affine_inverse=True)
    if min(src_hw) > 1:  # a 1-pixel axis normalises by kornia's 1e-14: an ulp of the inverse moves its grid by ~2^31
        torch.testing.assert_close(grid_closed, grid_lu, rtol=1e-6, atol=1e-6)
    src_from_src_norm, dst_norm_from_dst = _normalisation_pair(src_hw, (160, 160), windows.device, None)
    m = (dst_norm_from_dst @ (windows @ src_from_src_norm)).double()  # the float32 matrices being inverted
    a, b, c, d = m[:, 0, 0], m[:, 1, 1], m[:, 0, 2], m[:, 1, 2]
    assert torch.equal(closed[:, 0, 0], a.reciprocal().float()) and torch.equal(closed[:, 1, 1], b.reciprocal().float())
    assert torch.equal(closed[:, 0, 2], (-(c / a)).float()) and torch.equal(closed[:, 1, 2], (-(d / b)).float())


def test_memo_of_a_host_k_never_aliases_the_k_it_was_built_from() -> None:
    """A captured step's static K buffer (a float64 host tensor on the CPU) is rewritten per request: the memo keyed
    by the old values must keep the old matrix, not a view that now holds the new one (it did: as_tensor shares)."""
    constants = GeometryConstants()
    poses = torch.eye(4).repeat(2, 1, 1)
    poses[:, 2, 3] = 0.5
    K = torch.tensor([[150.0, 0.0, 79.5], [0.0, 150.0, 59.5], [0.0, 0.0, 1.0]], dtype=torch.float64)
    first = crop_windows(poses, K, 0.1, 1.2, S=32, constants=constants)
    depth = torch.full((4, 5), 0.5)
    xyz_first = depth_to_xyz(depth, K.numpy(), constants=constants)
    original = K.clone()
    K.copy_(torch.tensor([[200.0, 0.0, 60.0], [0.0, 201.0, 40.0], [0.0, 0.0, 1.0]], dtype=torch.float64))
    moved = crop_windows(poses, K, 0.1, 1.2, S=32, constants=constants)
    assert not torch.equal(moved, first)
    torch.testing.assert_close(crop_windows(poses, original, 0.1, 1.2, S=32, constants=constants), first, rtol=0,
                               atol=0)
    torch.testing.assert_close(depth_to_xyz(depth, original.numpy(), constants=constants), xyz_first, rtol=0, atol=0)
