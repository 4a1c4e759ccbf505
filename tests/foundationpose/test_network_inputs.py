"""xyz normalisation and the 6-channel network input (spec §1.4 steps 4-5, §1.5)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from foundationpose.network_inputs import (
    REFINE_CROP_RATIO,
    REFINE_INVALID_Z,
    SCORE_CROP_RATIO,
    SCORE_INVALID_Z,
    make_network_input,
    normalize_xyz,
    rgb_to_unit,
)

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    ),
]


def test_constants_match_the_spec() -> None:
    assert (REFINE_CROP_RATIO, SCORE_CROP_RATIO) == (1.2, 1.1)
    assert (REFINE_INVALID_Z, SCORE_INVALID_Z) == (0.001, 0.1)


def reference_normalize(xyz: np.ndarray, t: np.ndarray, diameter: float, invalid_z: float) -> np.ndarray:
    """Spec §1.4.4 in NumPy float32: (xyz - t) * float32(1 / rho32), rho32 = float32(d) / 2."""
    rho32 = np.float32(diameter) / np.float32(2)
    r = np.float32(np.float32(1) / rho32)
    invalid = xyz[..., 2:3] < np.float32(invalid_z)
    out = (xyz - t[:, None, None, :]).astype(np.float32) * r
    out[np.broadcast_to(invalid, out.shape) | (np.abs(out) >= 2)] = 0.0
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("invalid_z", [REFINE_INVALID_Z, SCORE_INVALID_Z])
def test_normalize_matches_float32_reference(device: str, invalid_z: float) -> None:
    rng = np.random.default_rng(0)
    n, s = 3, 8
    t = rng.uniform([-0.1, -0.1, 0.4], [0.1, 0.1, 0.8], size=(n, 3)).astype(np.float32)
    xyz = (t[:, None, None, :] + rng.normal(scale=0.12, size=(n, s, s, 3))).astype(np.float32)
    xyz[0, :2] = 0.0  # background
    xyz[1, 0, 0, 2] = np.float32(invalid_z)  # exactly at the threshold: valid
    diameter = 0.1523
    got = normalize_xyz(torch.from_numpy(xyz).to(device), torch.from_numpy(t).to(device), diameter, invalid_z)
    expected = reference_normalize(xyz, t, diameter, invalid_z)
    np.testing.assert_array_equal(got.cpu().numpy(), expected)
    assert (expected == 0).any() and (np.abs(expected) > 1).any()


def test_invalid_is_decided_before_shifting_and_zeroes_all_components() -> None:
    t = torch.tensor([[0.0, 0.0, 0.05]])
    xyz = torch.zeros((1, 1, 3, 3))
    xyz[0, 0, 0] = torch.tensor([0.01, 0.02, 0.05])  # z = 0.05 < 0.1: invalid for the scorer only
    xyz[0, 0, 1] = torch.tensor([0.01, 0.02, 0.0009])  # invalid for both
    xyz[0, 0, 2] = torch.tensor([0.01, 0.02, 0.12])  # valid for both
    score = normalize_xyz(xyz, t, 0.1, SCORE_INVALID_Z)
    refine = normalize_xyz(xyz, t, 0.1, REFINE_INVALID_Z)
    assert score[0, 0, 0].tolist() == [0.0, 0.0, 0.0] and score[0, 0, 1].tolist() == [0.0, 0.0, 0.0]
    assert refine[0, 0, 1].tolist() == [0.0, 0.0, 0.0]
    assert refine[0, 0, 0].tolist() == pytest.approx([0.2, 0.4, 0.0], abs=1e-6)
    assert score[0, 0, 2].tolist() == pytest.approx([0.2, 0.4, 1.4], abs=1e-6)


def test_components_at_or_beyond_two_radii_are_zeroed_one_by_one() -> None:
    d = 0.5  # rho = 0.25, r = 4 exactly
    t = torch.tensor([[0.0, 0.0, 1.0]])
    xyz = torch.tensor([[[[0.5, 0.4999, 1.2], [-0.5, 0.1, 1.6], [0.7, -0.6, 0.49]]]])
    got = normalize_xyz(xyz, t, d, REFINE_INVALID_Z)[0, 0]
    assert got[0].tolist() == pytest.approx([0.0, 1.9996, 0.8], abs=1e-5)  # |x'| = 2 exactly -> 0
    assert got[1].tolist() == pytest.approx([0.0, 0.4, 0.0], abs=1e-5)  # -2 and 2.4 -> 0
    assert got[2].tolist() == pytest.approx([0.0, 0.0, 0.0], abs=1e-6)  # 2.8, -2.4, -2.04


def test_normalize_in_place_and_into_a_channel_slice() -> None:
    g = torch.Generator().manual_seed(1)
    xyz = torch.rand((2, 4, 4, 3), generator=g)
    t = torch.rand((2, 3), generator=g)
    expected = normalize_xyz(xyz, t, 0.3, REFINE_INVALID_Z)
    net_in = torch.full((2, 4, 4, 6), -7.0)
    out = normalize_xyz(xyz, t, 0.3, REFINE_INVALID_Z, out=net_in[..., 3:])
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(net_in[..., 3:], expected, rtol=0, atol=0)
    assert bool((net_in[..., :3] == -7.0).all())
    in_place = xyz.clone()
    normalize_xyz(in_place, t, 0.3, REFINE_INVALID_Z, out=in_place)
    torch.testing.assert_close(in_place, expected, rtol=0, atol=0)


def test_network_input_channel_order_rgb_then_xyz() -> None:
    rgb = torch.rand((2, 5, 5, 3))
    xyz = torch.rand((2, 5, 5, 3))
    joined = make_network_input(rgb, xyz)
    assert joined.shape == (2, 5, 5, 6) and joined.dtype == torch.float32
    torch.testing.assert_close(joined[..., :3], rgb, rtol=0, atol=0)
    torch.testing.assert_close(joined[..., 3:], xyz, rtol=0, atol=0)
    buffer = torch.zeros((3, 5, 5, 6))
    out = make_network_input(rgb, xyz, out=buffer[:2])
    assert out.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(buffer[:2], joined, rtol=0, atol=0)
    # already written in place (e.g. the warp wrote rgb into the buffer): nothing to copy, same result
    torch.testing.assert_close(
        make_network_input(buffer[:2, ..., :3], buffer[:2, ..., 3:], out=buffer[:2]), joined
    )


def test_rgb_to_unit_is_the_reference_gpu_division() -> None:
    values = torch.arange(256, dtype=torch.float32)
    inv = np.float32(np.float32(1) / np.float32(255))
    np.testing.assert_array_equal(rgb_to_unit(values).numpy(), values.numpy() * inv)
    assert rgb_to_unit(values)[255].item() == 1.0
    buffer = values.clone()
    assert rgb_to_unit(buffer, out=buffer).data_ptr() == buffer.data_ptr()
    np.testing.assert_array_equal(buffer.numpy(), values.numpy() * inv)


def test_renders_of_another_size_than_the_real_crops_are_refused() -> None:
    """A renderer whose crop_size_px is not the crop size would leave most of the inputs unwritten: refused."""
    from foundationpose.refine import assemble_pair_inputs
    from foundationpose.render.base import RenderOutput

    def crops(n: int, s: int) -> RenderOutput:
        return RenderOutput(rgb=torch.zeros(n, s, s, 3), xyz_cam=torch.zeros(n, s, s, 3), mask=torch.zeros(n, s, s, dtype=torch.bool))

    pose = torch.eye(4).expand(2, 4, 4).clone()
    pose[:, 2, 3] = 0.5
    crop_from_img = torch.eye(3).expand(2, 3, 3)
    real = torch.zeros(2, 8, 8, 3)
    with pytest.raises(ValueError, match=r"^the renders are 16x16 crops but the real crops are 8x8: the renderer's "
                                         r"crop_size_px must equal the crop size$"):
        assemble_pair_inputs(crops(2, 16), real, real, pose, 0.1, 0.1, crop_from_img)
    inputs = assemble_pair_inputs(crops(2, 8), real, real, pose, 0.1, 0.1, crop_from_img)
    assert inputs.render_input.shape == inputs.transf_input.shape == (2, 8, 8, 6)
