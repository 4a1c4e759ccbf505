"""Projection matrix, crop bounds and crop clip transform of the renderer (spec §3.2, §3.3)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from foundationpose.render._reference import crop_clip_coefficients_reference
from foundationpose.render.base import RenderConfig
from foundationpose.render.projection import (
    GL_FROM_CAM,
    apply_crop_to_clip,
    clip_from_centred,
    crop_bounds,
    crop_clip_coefficients,
    full_frame_exact_bounds,
    ndc_pixel_centres,
    projection_from_K,
    vertices_to_clip,
)

# Demo intrinsics (spec §7.1), 640 x 480, non-square pixels.
FX, FY, CX, CY = 319.5820007324219, 417.1186828613281, 320.2149847676956, 244.3486680871047
K_DEMO = np.array([[FX, 0.0, CX], [0.0, FY, CY], [0.0, 0.0, 1.0]])
H, W = 480, 640


def crop_from_edges(left: float, top: float, right: float, bottom: float, s: int = 160) -> torch.Tensor:
    """F of spec §2.5 assembled in float32 from window edges: (1, 3, 3)."""
    sx = np.float32(s / (right - left))
    sy = np.float32(s / (bottom - top))
    f = np.array([[sx, 0, sx * np.float32(-left)], [0, sy, sy * np.float32(-top)], [0, 0, 1]], dtype=np.float32)
    return torch.from_numpy(f)[None]


def test_projection_entries_are_float64_values_rounded_to_float32() -> None:
    p = projection_from_K(K_DEMO, (H, W)).numpy()
    n, f = 0.001, 100.0
    expected = np.array(
        [
            [2 * FX / W, 0.0, (W - 2 * CX) / W, 0.0],
            [0.0, 2 * FY / H, (2 * CY - H) / H, 0.0],
            [0.0, 0.0, -(f + n) / (f - n), -2 * f * n / (f - n)],
            [0.0, 0.0, -1.0, 0.0],
        ]
    ).astype(np.float32)
    assert p.dtype == np.float32
    np.testing.assert_array_equal(p, expected)


@pytest.mark.parametrize("point_cam", [(0.05, -0.03, 0.6), (-0.21, 0.12, 1.7), (0.0, 0.0, 0.3)])
def test_projected_point_lands_at_opencv_pixel_in_ndc(point_cam: tuple[float, float, float]) -> None:
    x, y, z = point_cam
    u, v = FX * x / z + CX, FY * y / z + CY
    pose = torch.eye(4)[None]
    pose[0, :3, 3] = torch.tensor(point_cam)
    clip = vertices_to_clip(torch.zeros(1, 3), clip_from_centred(projection_from_K(K_DEMO, (H, W)), pose))[0, 0]
    ndc = (clip[:3] / clip[3]).double().numpy()
    np.testing.assert_allclose(ndc[:2], [2 * u / W - 1, 1 - 2 * v / H], atol=2e-6)
    assert clip[3].item() == pytest.approx(z, rel=1e-6)  # w = depth (OpenCV z)


def test_depth_range_maps_near_and_far_planes_to_ndc_limits() -> None:
    proj = projection_from_K(K_DEMO, (H, W)).double()
    gl = torch.tensor(GL_FROM_CAM, dtype=torch.float64)
    for depth, ndc_z in ((0.001, -1.0), (100.0, 1.0)):
        clip = proj @ gl @ torch.tensor([0.0, 0.0, depth, 1.0], dtype=torch.float64)
        assert (clip[2] / clip[3]).item() == pytest.approx(ndc_z, abs=1e-6)


def test_crop_bounds_are_first_and_last_crop_pixel_centres() -> None:
    left, top, right, bottom = 100.0, 50.0, 260.0, 212.0  # x and y scales differ (rounded edges, spec §2.5)
    bounds = crop_bounds(crop_from_edges(left, top, right, bottom), 160)[0].double().numpy()
    expected = [left, top, left + 159 * (right - left) / 160, top + 159 * (bottom - top) / 160]
    np.testing.assert_allclose(bounds, expected, atol=1e-4)


def test_crop_transform_maps_bounds_to_ndc_edges_and_sample_positions() -> None:
    s = 160
    f = crop_from_edges(201.0, 117.0, 355.0, 271.0, s)
    bounds = crop_bounds(f, s)
    x0, y0, x1, y1 = bounds[0].double().tolist()
    coeffs = crop_clip_coefficients(bounds, (H, W))
    # Points given by their OpenCV pixel (u, v) at w = 1: NDC x = 2u/W - 1, y = 1 - 2v/H.
    us = torch.tensor([x0, x1, x0 + 37.5 * (x1 - x0) / s], dtype=torch.float64)
    vs = torch.tensor([y0, y1, y0 + 100.5 * (y1 - y0) / s], dtype=torch.float64)
    clip = torch.stack([2 * us / W - 1, 1 - 2 * vs / H, torch.zeros(3, dtype=torch.float64), torch.ones(3)], -1)
    out = apply_crop_to_clip(clip[None].float(), coeffs)[0].double()
    np.testing.assert_allclose(out[:2, 0].numpy(), [-1.0, 1.0], atol=1e-5)
    np.testing.assert_allclose(out[:2, 1].numpy(), [1.0, -1.0], atol=1e-5)
    # Raster column 37 / raster row (159 - 100) = output row 100 after the flip, at pixel centres.
    centres = ndc_pixel_centres(s).double()
    assert out[2, 0].item() == pytest.approx(centres[37].item(), abs=1e-5)
    assert out[2, 1].item() == pytest.approx(centres[s - 1 - 100].item(), abs=1e-5)


def test_exact_full_frame_bounds_put_pixel_centres_on_integers() -> None:
    bounds = full_frame_exact_bounds(2, (H, W), "cpu")
    coeffs = crop_clip_coefficients(bounds, (H, W))
    u = torch.tensor([0.0, 17.0, W - 1.0], dtype=torch.float64)
    clip = torch.stack([2 * u / W - 1, torch.zeros(3, dtype=torch.float64), torch.zeros(3), torch.ones(3)], -1)
    out = apply_crop_to_clip(clip[None].float().expand(2, 3, 4), coeffs)
    centres = ndc_pixel_centres(W)
    torch.testing.assert_close(out[0, :, 0], centres[[0, 17, W - 1]], atol=1e-6, rtol=0)


def test_ndc_pixel_centres_follow_nvdiffrast() -> None:
    c = ndc_pixel_centres(160).double()
    np.testing.assert_allclose(c.numpy(), (2 * np.arange(160) + 1) / 160 - 1, atol=1e-6)


def test_render_config_validates() -> None:
    assert RenderConfig().crop_size_px == 160
    with pytest.raises(ValueError, match=r"^crop_size_px must be >= 1"):
        RenderConfig(crop_size_px=0)
    with pytest.raises(ValueError, match=r"^need 0 < z_near_m < z_far_m"):
        RenderConfig(z_near_m=1.0, z_far_m=0.5)


def test_public_names_are_exported() -> None:
    import foundationpose.render as render

    assert sorted(render.__all__) == render.__all__
    for name in render.__all__:
        assert getattr(render, name) is not None


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def test_crop_transform_is_bit_identical_to_the_element_wise_reference() -> None:
    g = torch.Generator().manual_seed(0)
    bounds = torch.randn(200, 4, generator=g) * 400
    bounds[:4] = 0.0  # degenerate windows: inf / nan coefficients must match too
    bounds[4:8, 2] = bounds[4:8, 0]
    for hw in ((H, W), (37, 53)):
        assert torch.equal(_bits(crop_clip_coefficients(bounds, hw)), _bits(crop_clip_coefficients_reference(bounds, hw)))
    coeffs = crop_clip_coefficients_reference(bounds[8:], (H, W))
    clip = torch.randn(192, 7, 4, generator=g)
    c = coeffs[:, None, :]
    x = clip[..., 0] * c[..., 0] + clip[..., 3] * c[..., 1]
    y = clip[..., 1] * c[..., 2] + clip[..., 3] * c[..., 3]
    want = torch.stack([x, y, clip[..., 2], clip[..., 3]], dim=-1)
    got = apply_crop_to_clip(clip, coeffs)
    assert torch.equal(_bits(got), _bits(want)) and got.is_contiguous()
    assert not torch.equal(clip, got)  # the input is left alone
    # crop_bounds: the previous stack of the four corner coordinates
    f = torch.cat([crop_from_edges(10.0 * i, 5.0 * i, 200.0 + 13 * i, 190.0 + 11 * i) for i in range(9)])
    img_from_crop = torch.linalg.inv(f)
    pts = img_from_crop[:, :2, :2] @ torch.tensor([[0.0, 159.0], [0.0, 159.0]]) + img_from_crop[:, :2, 2:]
    want_bounds = torch.stack([pts[:, 0, 0], pts[:, 1, 0], pts[:, 0, 1], pts[:, 1, 1]], dim=1)
    assert torch.equal(_bits(crop_bounds(f, 160)), _bits(want_bounds))


def test_projection_on_device_is_cached_per_host_K() -> None:
    from foundationpose.render._cache import GeometryConstants
    from foundationpose.render.projection import projection_on_device

    cpu, constants = torch.device("cpu"), GeometryConstants()
    a = projection_on_device(K_DEMO, (H, W), 0.001, 100.0, cpu, constants=constants)
    assert torch.equal(a, projection_from_K(K_DEMO, (H, W)))
    assert projection_on_device(K_DEMO.copy(), (H, W), 0.001, 100.0, cpu, constants=constants) is a  # by value
    other = K_DEMO.copy()
    other[0, 2] += 1.0
    assert not torch.equal(projection_on_device(other, (H, W), 0.001, 100.0, cpu, constants=constants), a)
    assert projection_on_device(K_DEMO, (240, 320), 0.001, 100.0, cpu, constants=constants) is not a
    assert len(constants.intrinsics) == 3
    uncached = projection_on_device(K_DEMO, (H, W), 0.001, 100.0, cpu)  # no owner's memo: built per call
    assert uncached is not a and torch.equal(uncached, a)
