"""Refiner output -> pose update (spec §2.7) and the pytorch3d-style SO(3) exponential."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from foundationpose.pose_update import ROT_NORMALIZER, apply_refiner_output, so3_exp_map

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    ),
]


def random_rotations(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, 3, 3, generator=g, dtype=torch.float64))
    q = q * torch.sign(torch.linalg.det(q))[:, None, None]
    return q


def random_poses(n: int, seed: int = 0) -> torch.Tensor:
    poses = torch.eye(4, dtype=torch.float64).repeat(n, 1, 1)
    poses[:, :3, :3] = random_rotations(n, seed)
    poses[:, :3, 3] = torch.tensor([0.01, -0.02, 0.6], dtype=torch.float64)
    return poses.float()


def rodrigues64(omega: np.ndarray, eps: float = 0.0) -> np.ndarray:
    """float64 Rodrigues; with eps > 0 the angle is sqrt(max(|w|^2, eps)) like pytorch3d."""
    theta = math.sqrt(max(float(omega @ omega), eps))
    x, y, z = omega
    k = np.array([[0, -z, y], [z, 0, -x], [-y, x, 0]])
    if theta == 0:
        return np.eye(3)
    return np.eye(3) + math.sin(theta) / theta * k + (1 - math.cos(theta)) / theta**2 * (k @ k)


def test_exp_of_zero_is_exactly_identity() -> None:
    rot = so3_exp_map(torch.zeros(4, 3))
    assert torch.equal(rot, torch.eye(3).expand(4, 3, 3))


@pytest.mark.parametrize("device", DEVICES)
def test_zero_outputs_leave_the_pose_unchanged_exactly(device: str) -> None:
    poses = random_poses(6).to(device)
    zeros = torch.zeros(6, 3, device=device)
    updated = apply_refiner_output(poses, zeros, zeros, diameter=0.15)
    assert updated.dtype == torch.float32 and updated.device == poses.device
    assert torch.equal(updated, poses)


def test_exp_matches_rodrigues_and_the_small_angle_clamp() -> None:
    omegas = np.array([[0.3, -0.2, 0.1], [0.0, 0.0, 1.2], [0.004, -0.003, 0.002], [1e-6, 0.0, 0.0]])
    got = so3_exp_map(torch.tensor(omegas, dtype=torch.float32)).double().numpy()
    for omega, rot in zip(omegas, got, strict=True):
        # float32 evaluation of the pytorch3d formula: ~1e-7 from the float64 value
        np.testing.assert_allclose(rot, rodrigues64(omega, eps=1e-4), rtol=0, atol=2e-7)
        np.testing.assert_allclose(rot, rodrigues64(omega), rtol=0, atol=1e-6)  # the clamp is tiny


def test_rotation_about_z_is_applied_transposed_on_the_left() -> None:
    pose = random_poses(1, seed=3)
    angle = 0.25  # rad, inside the +-20 deg range
    rot = torch.tensor([[0.0, 0.0, math.atanh(angle / ROT_NORMALIZER)]])
    updated = apply_refiner_output(pose, torch.zeros(1, 3), rot, diameter=0.2)
    c, s = math.cos(angle), math.sin(angle)
    rz_minus = np.array([[c, s, 0.0], [-s, c, 0.0], [0.0, 0.0, 1.0]])  # exp([w]x)^T = Rz(-angle)
    expected = rz_minus @ pose[0, :3, :3].double().numpy()
    np.testing.assert_allclose(updated[0, :3, :3].double().numpy(), expected, rtol=0, atol=2e-6)
    assert torch.equal(updated[0, :3, 3], pose[0, :3, 3])  # translation is not rotated


def test_translation_is_scaled_by_the_float32_radius_without_tanh() -> None:
    pose = random_poses(2, seed=1)
    trans = torch.tensor([[1.0, -2.0, 0.5], [3.0, 0.25, -4.0]])  # |.| > 1: no tanh, no clamp
    updated = apply_refiner_output(pose, trans, torch.zeros(2, 3), diameter=0.2)
    rho32 = np.float32(0.2) / np.float32(2)
    expected = pose[:, :3, 3].numpy() + trans.numpy() * rho32
    np.testing.assert_array_equal(updated[:, :3, 3].numpy(), expected.astype(np.float32))
    assert torch.equal(updated[:, :3, :3], pose[:, :3, :3])


def test_rotation_is_bounded_by_tanh_and_stays_orthonormal() -> None:
    poses = random_poses(16, seed=2)
    g = torch.Generator().manual_seed(0)
    rot = torch.randn(16, 3, generator=g) * 5
    rot[0] = 1e4  # saturated: every component at +20 deg
    updated = apply_refiner_output(poses, torch.randn(16, 3, generator=g), rot, diameter=0.1)
    r = updated[:, :3, :3].double()
    eye = torch.eye(3, dtype=torch.float64)
    assert float((r.transpose(1, 2) @ r - eye).abs().max()) < 2e-6
    assert float((torch.linalg.det(r) - 1).abs().max()) < 2e-6
    assert torch.equal(updated[:, 3], torch.tensor([0.0, 0.0, 0.0, 1.0]).expand(16, 4))
    delta = r @ poses[:, :3, :3].double().transpose(1, 2)  # = exp(w)^T
    angles = torch.arccos(((delta.diagonal(dim1=1, dim2=2).sum(-1) - 1) / 2).clamp(-1, 1))
    omega = torch.tanh(rot.double()) * ROT_NORMALIZER
    np.testing.assert_allclose(angles.numpy(), omega.norm(dim=1).numpy(), rtol=0, atol=1e-3)
    assert float(angles[0]) == pytest.approx(ROT_NORMALIZER * math.sqrt(3), abs=1e-3)
