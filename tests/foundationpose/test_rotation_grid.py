"""Rotation hypotheses (spec §2.1): icosphere order, grid construction, symmetry clustering."""

from __future__ import annotations

import math

import numpy as np
import pytest

import foundationpose.sampling as sampling
from foundationpose.sampling import (
    centred_from_view_cam,
    cluster_poses,
    icosphere_views,
    make_rotation_grid,
    symmetry_tfs_from_bop_info,
)


def _rot_z(deg: float) -> np.ndarray:
    tf = np.eye(4)
    c, s = math.cos(math.radians(deg)), math.sin(math.radians(deg))
    tf[:2, :2] = [[c, -s], [s, c]]
    return tf


def _flat(tf: np.ndarray) -> list[float]:
    return np.asarray(tf, dtype=np.float64).reshape(-1).tolist()


# ----------------------------------------------------------------------------------------------
# Views
# ----------------------------------------------------------------------------------------------


def test_icosphere_views_order_and_values() -> None:
    views = icosphere_views()
    assert views.shape == (42, 3) and views.dtype == np.float64
    np.testing.assert_allclose(np.linalg.norm(views, axis=1), 1.0, rtol=0, atol=1e-15)
    t = (1 + math.sqrt(5)) / 2
    first = np.array([(-1, t, 0), (1, t, 0), (-1, -t, 0), (1, -t, 0), (0, -1, t), (0, 1, t)])
    np.testing.assert_allclose(views[:6], first / np.linalg.norm(first, axis=1, keepdims=True), atol=1e-15)
    np.testing.assert_array_equal(views[18], [0.0, 0.0, 1.0])  # edge (4,5): +z pole
    np.testing.assert_array_equal(views[23], [0.0, 0.0, -1.0])  # edge (6,7): -z pole
    mid_0_1 = views[0] + views[1]
    np.testing.assert_allclose(views[12], mid_0_1 / np.linalg.norm(mid_0_1), atol=1e-15)


def test_icosphere_views_equal_trimesh() -> None:
    trimesh = pytest.importorskip("trimesh")
    np.testing.assert_array_equal(icosphere_views(), trimesh.creation.icosphere(subdivisions=1).vertices)


def test_view_frames_look_at_origin_with_pole_fallback() -> None:
    views = icosphere_views()
    centred_from_cam = centred_from_view_cam(views)
    rot = centred_from_cam[:, :3, :3]
    np.testing.assert_allclose(
        rot @ rot.transpose(0, 2, 1), np.broadcast_to(np.eye(3), rot.shape), atol=1e-12
    )
    np.testing.assert_allclose(np.linalg.det(rot), 1.0, atol=1e-12)
    np.testing.assert_allclose(rot[:, :, 2], -views, atol=1e-15)  # camera z looks at the origin
    np.testing.assert_array_equal(centred_from_cam[:, :3, 3], views)
    np.testing.assert_allclose(rot[18], np.diag([1.0, -1.0, -1.0]), atol=1e-15)  # up x z == 0 -> x = (1,0,0)
    np.testing.assert_allclose(rot[23], np.eye(3), atol=1e-15)
    # Elsewhere, camera x is horizontal (perpendicular to the object's z axis).
    others = np.setdiff1d(np.arange(42), [18, 23])
    np.testing.assert_allclose(rot[others, 2, 0], 0.0, atol=1e-15)


# ----------------------------------------------------------------------------------------------
# Grid
# ----------------------------------------------------------------------------------------------


def test_grid_without_symmetry_has_252_rotations() -> None:
    grid = make_rotation_grid()
    assert grid.shape == (252, 4, 4) and grid.dtype == np.float32
    rot = grid[:, :3, :3].astype(np.float64)
    np.testing.assert_allclose(rot @ rot.transpose(0, 2, 1), np.broadcast_to(np.eye(3), rot.shape), atol=1e-6)
    np.testing.assert_allclose(np.linalg.det(rot), 1.0, atol=1e-6)
    np.testing.assert_allclose(grid[:, :3, 3], np.broadcast_to([0.0, 0.0, 1.0], (252, 3)), atol=1e-6)
    np.testing.assert_array_equal(grid[:, 3], np.broadcast_to([0.0, 0.0, 0.0, 1.0], (252, 4)))
    assert np.array_equal(make_rotation_grid(np.eye(4)[None]), grid)


def test_grid_order_is_view_major_angle_minor() -> None:
    grid = make_rotation_grid().astype(np.float64)
    views = icosphere_views()
    cam_from_centred = grid.reshape(42, 6, 4, 4)
    # Row 2 of cam_from_centred's rotation is the camera z axis in the object frame: -view.
    np.testing.assert_allclose(
        cam_from_centred[:, :, 2, :3], np.broadcast_to(-views[:, None], (42, 6, 3)), atol=1e-6
    )
    for a in range(6):  # inverse(C Rz(theta)) = Rz(theta)^T inverse(C)
        expected = _rot_z(60.0 * a).T[None] @ cam_from_centred[:, 0]
        np.testing.assert_allclose(cam_from_centred[:, a], expected, atol=1e-6)
    # The two poles (views 18 and 23), angle 0.
    np.testing.assert_allclose(grid[18 * 6, :3, :3], np.diag([1.0, -1.0, -1.0]), atol=1e-7)
    np.testing.assert_allclose(grid[23 * 6, :3, :3], np.eye(3), atol=1e-7)


def test_grid_matches_float64_construction_rounded() -> None:
    views = icosphere_views()
    rows = []
    for view in views:
        z = -view / np.linalg.norm(view)
        x = np.cross([0.0, 0.0, 1.0], z)
        if not x.any():
            x = np.array([1.0, 0.0, 0.0])
        x = x / np.linalg.norm(x)
        y = np.cross(z, x)
        y = y / np.linalg.norm(y)
        centred_from_cam = np.eye(4)
        centred_from_cam[:3, :3] = np.stack([x, y, z], axis=1)
        centred_from_cam[:3, 3] = view
        for a in range(6):
            rows.append(np.linalg.inv(centred_from_cam @ _rot_z(60.0 * a)))
    np.testing.assert_allclose(make_rotation_grid(), np.stack(rows).astype(np.float32), rtol=0, atol=1e-7)


def test_min_pairwise_angle_is_31_72_degrees() -> None:
    rot = make_rotation_grid()[:, :3, :3].astype(np.float64)
    trace = np.einsum("pab,qab->pq", rot, rot)
    angles = np.degrees(np.arccos(np.clip((trace - 1) / 2, -1, 1)))
    np.fill_diagonal(angles, np.inf)
    assert angles.min() == pytest.approx(31.7175, abs=1e-3)


def test_symmetry_counts_match_the_reference() -> None:
    continuous_z = symmetry_tfs_from_bop_info(
        {"symmetries_continuous": [{"axis": [0, 0, 1], "offset": [0, 0, 0]}]}
    )
    assert len(continuous_z) == 73
    assert len(make_rotation_grid(continuous_z)) == 20
    flips = [np.diag(d) for d in ([1.0, -1, -1, 1], [-1.0, 1, -1, 1], [-1.0, -1, 1, 1])]
    flips_xyz = symmetry_tfs_from_bop_info({"symmetries_discrete": [_flat(f) for f in flips]})
    assert len(make_rotation_grid(flips_xyz)) == 63


def test_denser_grid_uses_a_finer_icosphere() -> None:
    pytest.importorskip("trimesh")
    grid = make_rotation_grid(min_n_views=43, inplane_step_deg=90)  # level 2: 162 views x 4
    rot = grid[:, :3, :3].astype(np.float64)
    np.testing.assert_allclose(np.linalg.det(rot), 1.0, atol=1e-6)
    assert 0 < len(grid) < 162 * 4


# ----------------------------------------------------------------------------------------------
# Clustering
# ----------------------------------------------------------------------------------------------


def naive_cluster(poses: np.ndarray, symmetry_tfs: np.ndarray, angle_deg: float, dist: float) -> np.ndarray:
    """One pose, kept pose and symmetry at a time (mirrors cluster_poses)."""
    poses = poses.astype(np.float32)
    syms = symmetry_tfs.astype(np.float32)
    thres = np.float32(angle_deg / 180.0 * np.pi)
    kept = [0]
    for p in range(1, len(poses)):
        duplicate = False
        for q in kept:
            if not np.linalg.norm(poses[p, :3, 3] - poses[q, :3, 3]) < dist:
                continue
            for sym in syms:
                rot = (poses[p] @ sym)[:3, :3]
                cos = (np.float32(np.sum(rot * poses[q, :3, :3])) - np.float32(1)) / np.float32(2)
                if np.arccos(np.clip(cos, np.float32(-1), np.float32(1))) < thres:
                    duplicate = True
                    break
            if duplicate:
                break
        if not duplicate:
            kept.append(p)
    return np.asarray(kept)


def test_cluster_greedy_in_list_order() -> None:
    poses = np.stack([_rot_z(d) for d in (0.0, 10.0, 40.0, 45.0, 71.0, 100.0)]).astype(np.float32)
    kept = cluster_poses(poses)
    assert kept.dtype == np.float32
    np.testing.assert_array_equal(kept, poses[[0, 2, 4]])  # 10~0; 45~40; 71 is 31 from 40; 100~71


def test_cluster_translation_threshold() -> None:
    poses = np.stack([_rot_z(0.0), _rot_z(5.0)]).astype(np.float32)
    poses[1, :3, 3] = [1.0, 0.0, 0.0]
    assert len(cluster_poses(poses, dist=0.5)) == 2
    assert len(cluster_poses(poses)) == 1


def test_cluster_symmetry_merges_flipped_poses() -> None:
    flip_z = _rot_z(180.0)
    poses = np.stack([_rot_z(0.0), _rot_z(175.0)]).astype(np.float32)
    assert len(cluster_poses(poses)) == 2
    assert len(cluster_poses(poses, np.stack([np.eye(4), flip_z]))) == 1


@pytest.mark.parametrize("seed", range(3))
def test_cluster_matches_naive_loop(seed: int) -> None:
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(60, 4))
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    w, x, y, z = q.T
    rot = np.stack(
        [
            [1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
            [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
            [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)],
        ]
    ).transpose(2, 0, 1)
    poses = np.tile(np.eye(4), (60, 1, 1))
    poses[:, :3, :3] = rot
    poses[:, :3, 3] = rng.normal(size=(60, 3))
    syms = np.stack([np.eye(4), _rot_z(180.0), _rot_z(90.0)])
    for angle, dist in ((30.0, 99999.0), (45.0, 1.5)):
        kept = cluster_poses(poses, syms, angle_deg=angle, dist=dist)
        expected = poses[naive_cluster(poses, syms, angle, dist)].astype(np.float32)
        np.testing.assert_array_equal(kept, expected)


def test_cluster_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError):
        cluster_poses(np.zeros((3, 3, 3)))
    with pytest.raises(ValueError):
        cluster_poses(np.zeros((3, 4, 4)), np.zeros((0, 4, 4)))


# ----------------------------------------------------------------------------------------------
# BOP symmetries
# ----------------------------------------------------------------------------------------------


def test_symmetry_tfs_from_bop_info_discrete_mm_to_m() -> None:
    flip = np.diag([-1.0, -1.0, 1.0, 1.0])
    flip[:3, 3] = [0.0, 0.0, 24.0]  # millimetres
    tfs = symmetry_tfs_from_bop_info({"symmetries_discrete": [_flat(flip)]})
    assert tfs.shape == (2, 4, 4)
    np.testing.assert_array_equal(tfs[0], np.eye(4))
    np.testing.assert_array_equal(tfs[1, :3, :3], flip[:3, :3])
    np.testing.assert_allclose(tfs[1, :3, 3], [0.0, 0.0, 0.024], rtol=1e-15)


@pytest.mark.parametrize(
    ("axis", "about"), [([1, 0, 0], 0), ([0, 1, 0], 1), ([0, 0, 1], 2), ([0, 0.3, 0.9], 1)]
)
def test_symmetry_tfs_from_bop_info_continuous(axis: list[float], about: int) -> None:
    info = {
        "symmetries_discrete": [_flat(np.diag([1.0, -1.0, -1.0, 1.0]))],
        "symmetries_continuous": [
            {"axis": axis, "offset": [0.0, 0.0, 5.0]},
            {"axis": [1, 0, 0], "offset": [0, 0, 0]},
        ],
    }
    tfs = symmetry_tfs_from_bop_info(info)
    assert tfs.shape == (1 + 1 + 72, 4, 4)  # identity, the discrete one, 72 samples of the first continuous
    samples = tfs[2:]
    np.testing.assert_array_equal(samples[:, :3, 3], np.broadcast_to([0.0, 0.0, 5.0], (72, 3)))  # unscaled
    rot = samples[:, :3, :3]
    # Rotation about the chosen axis: that axis is fixed, and the angle steps by 5 degrees.
    unit = np.eye(3)[about]
    np.testing.assert_allclose(rot @ unit, np.broadcast_to(unit, (72, 3)), atol=1e-15)
    angles = np.degrees(np.arccos(np.clip((np.trace(rot, axis1=1, axis2=2) - 1) / 2, -1, 1)))
    np.testing.assert_allclose(angles, np.minimum(np.arange(72) * 5.0, 360 - np.arange(72) * 5.0), atol=1e-6)
    np.testing.assert_allclose(np.linalg.det(rot), 1.0, atol=1e-12)
    i, j = [(1, 2), (2, 0), (0, 1)][about]
    assert rot[1, j, i] > 0  # right-handed: +5 degrees about the axis


def test_symmetry_tfs_from_bop_info_edge_cases() -> None:
    np.testing.assert_array_equal(symmetry_tfs_from_bop_info({}), np.eye(4)[None])
    # No positive axis component: one identity-rotation sample carrying the offset (reference behaviour).
    tfs = symmetry_tfs_from_bop_info(
        {"symmetries_continuous": [{"axis": [0, 0, -1], "offset": [1.0, 2.0, 3.0]}]}
    )
    assert tfs.shape == (2, 4, 4)
    np.testing.assert_array_equal(tfs[1, :3, :3], np.eye(3))
    np.testing.assert_array_equal(tfs[1, :3, 3], [1.0, 2.0, 3.0])


def test_public_names() -> None:
    assert sorted(sampling.__all__) == sampling.__all__
    for name in sampling.__all__:
        assert hasattr(sampling, name), name
