"""ADD / ADD-S on known transforms."""

from __future__ import annotations

import math

import numpy as np
import pytest
import trimesh

from foundationpose.demo.metrics import (
    MODEL_POINTS,
    add_error,
    add_symmetric_error,
    adds_error,
    model_points,
    pose_errors,
)
from foundationpose.errors import InputError


def _pose(rot: np.ndarray | None = None, t=(0.0, 0.0, 0.6)) -> np.ndarray:
    pose = np.eye(4)
    if rot is not None:
        pose[:3, :3] = rot
    pose[:3, 3] = t
    return pose


def _rot_z(deg: float) -> np.ndarray:
    c, s = math.cos(math.radians(deg)), math.sin(math.radians(deg))
    return np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])


CUBE = np.array([[x, y, z] for x in (-0.05, 0.05) for y in (-0.05, 0.05) for z in (-0.05, 0.05)])


def test_add_of_pure_translation_is_its_norm():
    gt = _pose(_rot_z(30.0), (0.01, -0.02, 0.6))
    delta = np.array([0.003, -0.004, 0.012])  # |delta| = 0.013
    est = gt.copy()
    est[:3, 3] += delta
    assert add_error(est, gt, CUBE) == pytest.approx(0.013, abs=1e-12)
    errors = pose_errors(est, gt, CUBE)
    assert errors.add_m == pytest.approx(0.013, abs=1e-12)
    assert 0.0 < errors.adds_m <= errors.add_m + 1e-12  # closest point is never farther than the same point


def test_identical_poses_give_zero():
    pose = _pose(_rot_z(10.0))
    assert add_error(pose, pose, CUBE) == 0.0
    assert adds_error(pose, pose, CUBE) == 0.0


def test_adds_is_zero_for_a_symmetry_of_the_point_set():
    gt = _pose(_rot_z(20.0), (0.02, 0.01, 0.7))
    est = gt @ _pose(_rot_z(90.0), (0.0, 0.0, 0.0))  # a 90 degree turn maps the cube onto itself
    assert adds_error(est, gt, CUBE) == pytest.approx(0.0, abs=1e-12)
    # ...while ADD sees the turn: each corner moves by sqrt(2) * its distance from the z axis
    assert add_error(est, gt, CUBE) == pytest.approx(math.sqrt(2) * 0.05 * math.sqrt(2), rel=1e-9)


def test_adds_matches_brute_force_on_many_points():
    points = model_points(trimesh.creation.icosphere(subdivisions=2, radius=0.05)).points
    assert len(points) == MODEL_POINTS  # more rows than one cdist chunk
    gt = _pose(_rot_z(5.0))
    est = _pose(_rot_z(12.0), (0.004, 0.0, 0.61))
    gt_cam = points @ gt[:3, :3].T + gt[:3, 3]
    est_cam = points @ est[:3, :3].T + est[:3, 3]
    brute = np.sqrt(((gt_cam[:, None, :] - est_cam[None, :, :]) ** 2).sum(-1)).min(axis=1).mean()
    assert adds_error(est, gt, points) == pytest.approx(brute, rel=1e-12)


def test_model_points_cover_the_surface_uniformly_and_are_seeded():
    box = trimesh.creation.box(extents=(0.3, 0.1, 0.1))  # 2 end faces of 0.01 m^2, 4 long faces of 0.03 m^2
    samples = model_points(box, count=14000, seed=2)
    on_ends = np.isclose(np.abs(samples.points[:, 0]), 0.15)
    assert abs(on_ends.mean() - 0.02 / 0.14) < 0.01  # area share, whatever the triangulation
    np.testing.assert_array_equal(samples.points, model_points(box, count=14000, seed=2).points)
    assert samples.describe() == {"kind": "uniform surface samples (area-weighted)", "count": 14000, "seed": 2}


def test_add_under_symmetries_forgives_a_symmetric_flip():
    gt = _pose(_rot_z(20.0), (0.02, 0.01, 0.7))
    est = gt @ _pose(_rot_z(90.0), (0.0, 0.0, 0.0))
    sym = np.stack([_pose(_rot_z(a), (0, 0, 0)) for a in (0.0, 90.0, 180.0, 270.0)])
    assert add_symmetric_error(est, gt, CUBE, sym) == pytest.approx(0.0, abs=1e-12)
    errors = pose_errors(est, gt, CUBE, sym)
    assert errors.add_sym_m == pytest.approx(0.0, abs=1e-12) and errors.add_m > 0.05
    assert pose_errors(est, gt, CUBE).add_sym_m == errors.add_m  # no symmetries declared: plain ADD


def test_bad_inputs():
    with pytest.raises(InputError, match=r"^cam_from_mesh_est: expected a finite \(4, 4\)"):
        add_error(np.eye(3), np.eye(4), CUBE)
    bad = np.eye(4)
    bad[0, 3] = np.nan
    with pytest.raises(InputError, match=r"^cam_from_mesh_gt: .*NaN or inf"):
        adds_error(np.eye(4), bad, CUBE)
    with pytest.raises(InputError, match=r"^mesh: "):
        model_points(trimesh.Trimesh(vertices=np.zeros((0, 3)), faces=np.zeros((0, 3), int)))


def test_rotation_and_translation_errors_and_the_report():
    from foundationpose.demo.metrics import PoseErrors, error_report, rotation_error_deg, translation_error_m

    gt = _pose(_rot_z(10.0), (0.0, 0.0, 0.6))
    est = _pose(_rot_z(25.0), (0.003, 0.004, 0.6))
    assert rotation_error_deg(est, gt) == pytest.approx(15.0, abs=1e-9)
    assert translation_error_m(est, gt) == pytest.approx(0.005, abs=1e-12)
    errors = pose_errors(est, gt, CUBE)
    assert errors.rot_deg == pytest.approx(15.0, abs=1e-9) and errors.trans_m == pytest.approx(0.005, abs=1e-12)
    frames = [PoseErrors(add_m=a, adds_m=a / 2, rot_deg=1.0, trans_m=a) for a in (0.001, 0.002, 0.003, 0.02)]
    report = error_report(frames, diameter_m=0.1)
    assert report["frames"] == 4 and report["add_m"]["max"] == 0.02
    assert report["add_m"]["median"] == pytest.approx(0.0025) and report["adds_m"]["mean"] == pytest.approx(0.00325)
    assert report["success_rate"] == 0.75 and report["worst_add_diameters"] == pytest.approx(0.2)
    assert report["drift"]["add_last_minus_first_m"] == pytest.approx(0.019)
    assert report["drift"]["add_slope_m_per_frame"] > 0
    with pytest.raises(ValueError, match=r"^error_report needs at least one frame"):
        error_report([], 0.1)
