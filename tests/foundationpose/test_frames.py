"""Rigid-transform helpers and the mesh <-> centred frame conversion (spec §0)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from foundationpose.coordinate_frames import (
    centred_from_mesh,
    invert_rigid,
    mesh_from_centred,
    to_centred_frame,
    to_mesh_frame,
)


def random_rigid(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.normal(size=(n, 3, 3)))
    q *= np.sign(np.linalg.det(q))[:, None, None]
    out = np.tile(np.eye(4), (n, 1, 1))
    out[:, :3, :3] = q
    out[:, :3, 3] = rng.normal(scale=0.5, size=(n, 3))
    return out


def test_invert_rigid_numpy_batched_matches_inverse() -> None:
    cam_from_mesh = random_rigid(5)
    mesh_from_cam = invert_rigid(cam_from_mesh)
    assert mesh_from_cam.shape == (5, 4, 4) and mesh_from_cam.dtype == np.float64
    np.testing.assert_allclose(mesh_from_cam, np.linalg.inv(cam_from_mesh), rtol=0, atol=1e-12)
    np.testing.assert_allclose(
        cam_from_mesh @ mesh_from_cam, np.tile(np.eye(4), (5, 1, 1)), rtol=0, atol=1e-12
    )
    np.testing.assert_array_equal(mesh_from_cam[:, 3], np.tile([0.0, 0.0, 0.0, 1.0], (5, 1)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_invert_rigid_torch_keeps_dtype_and_round_trips(dtype: torch.dtype) -> None:
    cam_from_centred = torch.as_tensor(random_rigid(7, seed=1), dtype=dtype)
    centred_from_cam = invert_rigid(cam_from_centred)
    assert centred_from_cam.dtype == dtype and centred_from_cam.shape == (7, 4, 4)
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(invert_rigid(centred_from_cam), cam_from_centred, rtol=0, atol=tol)
    eye = torch.eye(4, dtype=dtype).expand(7, 4, 4)
    torch.testing.assert_close(cam_from_centred @ centred_from_cam, eye, rtol=0, atol=tol)
    single = invert_rigid(cam_from_centred[0])  # unbatched (4, 4) works too (batched matmul: last-bit noise)
    torch.testing.assert_close(single, centred_from_cam[0], rtol=0, atol=tol)


def test_invert_rigid_rejects_wrong_shape() -> None:
    with pytest.raises(ValueError, match=r"^invert_rigid expects"):
        invert_rigid(np.eye(3))


def test_centred_from_mesh_translates_by_minus_centre() -> None:
    centre = np.array([0.1, -0.2, 0.05])
    c_from_m = centred_from_mesh(centre)
    m_from_c = mesh_from_centred(centre)
    np.testing.assert_array_equal(c_from_m[:3, 3], -centre)
    np.testing.assert_array_equal(c_from_m[:3, :3], np.eye(3))
    np.testing.assert_array_equal(c_from_m @ m_from_c, np.eye(4))
    np.testing.assert_array_equal(invert_rigid(c_from_m), m_from_c)


def test_mesh_pose_from_centred_pose_maps_points_consistently() -> None:
    centre = np.array([0.03, 0.01, -0.02])
    cam_from_centred = random_rigid(1, seed=2)[0]
    cam_from_mesh = to_mesh_frame(cam_from_centred, centred_from_mesh(centre))
    p_mesh = np.array([0.07, -0.01, 0.02, 1.0])
    p_centred = p_mesh - np.append(centre, 0.0)
    np.testing.assert_allclose(cam_from_mesh @ p_mesh, cam_from_centred @ p_centred, rtol=0, atol=1e-15)
    back = to_centred_frame(cam_from_mesh, mesh_from_centred(centre))
    np.testing.assert_allclose(back, cam_from_centred.astype(np.float32), rtol=0, atol=1e-7)


def test_conversion_dtypes_follow_the_reference() -> None:
    """The mesh-frame pose is a float64 product of the float32 state; the centred one is rounded to float32."""
    centre = np.array([0.03, 0.01, -0.02])
    cam_from_centred = random_rigid(1, seed=4)[0].astype(np.float32)
    cam_from_mesh = to_mesh_frame(cam_from_centred, centred_from_mesh(centre))
    assert cam_from_mesh.dtype == np.float64
    np.testing.assert_array_equal(cam_from_mesh, cam_from_centred.astype(np.float64) @ centred_from_mesh(centre))
    np.testing.assert_array_equal(cam_from_mesh[:3, :3], cam_from_centred[:3, :3])  # rotation untouched
    back = to_centred_frame(cam_from_mesh, mesh_from_centred(centre))
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back, (cam_from_mesh @ mesh_from_centred(centre)).astype(np.float32))
