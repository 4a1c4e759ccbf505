"""Pose error metrics ADD and ADD-S over a mesh's points, in metres.

* ADD (average distance of model points): ``mean_i |T_est p_i - T_gt p_i|``.
* ADD-S (symmetric variant): ``mean_i min_j |T_gt p_i - T_est p_j|``; 0 for poses that differ by a
  symmetry of the point set.

``p_i`` are the mesh's distinct vertices in the mesh frame, at most ``max_points`` of them (a deterministic
random subset when there are more). Poses are ``cam_from_mesh`` (4, 4), metres.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from foundationpose.errors import InputError

__all__ = [
    "MAX_MODEL_POINTS",
    "PoseErrors",
    "add_error",
    "adds_error",
    "error_report",
    "model_points",
    "pose_errors",
    "rotation_error_deg",
    "translation_error_m",
]

MAX_MODEL_POINTS = 2000  # points the metrics are evaluated on (bounded cost for ADD-S)
_CDIST_ROWS = 1024  # rows of the pairwise-distance matrix held at once


@dataclass(frozen=True, slots=True)
class PoseErrors:
    """ADD and ADD-S (metres), rotation error (degrees) and translation error (metres) of one estimate."""

    add_m: float
    adds_m: float
    rot_deg: float = float("nan")
    trans_m: float = float("nan")


def model_points(verts_mesh: np.ndarray, max_points: int = MAX_MODEL_POINTS, seed: int = 0) -> np.ndarray:
    """(P, 3) float64 distinct mesh-frame vertices, P <= max_points.

    verts_mesh: (V, 3) vertices in metres (e.g. ``ObjectModel.mesh.vertices``). Duplicates (vertices split
    on UV seams) are merged first; above ``max_points`` a subset is drawn with ``default_rng(seed)``
    (deterministic), kept in ascending vertex order.
    """
    verts = np.asarray(verts_mesh, dtype=np.float64)
    if verts.ndim != 2 or verts.shape[1] != 3 or len(verts) == 0:
        raise InputError("verts_mesh", "(V, 3) vertices with V >= 1", f"shape {verts.shape}")
    if not np.isfinite(verts).all():
        raise InputError("verts_mesh", "finite vertex coordinates", "NaN or inf")
    if max_points < 1:
        raise ValueError(f"max_points must be >= 1, got {max_points}")
    unique = np.unique(verts, axis=0)
    if len(unique) > max_points:
        ids = np.sort(np.random.default_rng(seed).choice(len(unique), size=max_points, replace=False))
        unique = unique[ids]
    return unique


def _check_pose(pose: np.ndarray, field: str) -> np.ndarray:
    arr = np.asarray(pose, dtype=np.float64)
    if arr.shape != (4, 4) or not np.isfinite(arr).all():
        raise InputError(field, "a finite (4, 4) cam_from_mesh transform", f"shape {arr.shape}"
                         + ("" if arr.shape != (4, 4) else " with NaN or inf"))
    return arr


def _transform(pose: np.ndarray, points: np.ndarray) -> np.ndarray:
    return points @ pose[:3, :3].T + pose[:3, 3]


def add_error(cam_from_mesh_est: np.ndarray, cam_from_mesh_gt: np.ndarray, points_mesh: np.ndarray) -> float:
    """ADD in metres. points_mesh: (P, 3) float64 mesh-frame points (see :func:`model_points`)."""
    est = _check_pose(cam_from_mesh_est, "cam_from_mesh_est")
    gt = _check_pose(cam_from_mesh_gt, "cam_from_mesh_gt")
    pts = np.asarray(points_mesh, dtype=np.float64)
    return float(np.linalg.norm(_transform(est, pts) - _transform(gt, pts), axis=1).mean())


def adds_error(
    cam_from_mesh_est: np.ndarray,
    cam_from_mesh_gt: np.ndarray,
    points_mesh: np.ndarray,
    device: str | torch.device = "cpu",
) -> float:
    """ADD-S in metres: mean over ground-truth-posed points of the distance to the closest estimate-posed point.

    Pairwise distances are computed with ``torch.cdist`` in float64, ``_CDIST_ROWS`` rows at a time, on
    ``device``.
    """
    est = _check_pose(cam_from_mesh_est, "cam_from_mesh_est")
    gt = _check_pose(cam_from_mesh_gt, "cam_from_mesh_gt")
    pts = np.asarray(points_mesh, dtype=np.float64)
    est_cam = torch.as_tensor(_transform(est, pts), device=device)  # (P, 3) metres
    gt_cam = torch.as_tensor(_transform(gt, pts), device=device)  # (P, 3)
    total = 0.0
    for start in range(0, len(pts), _CDIST_ROWS):
        dists = torch.cdist(  # (rows, P); exact differences, not the |a|^2 + |b|^2 - 2ab expansion
            gt_cam[start : start + _CDIST_ROWS], est_cam, compute_mode="donot_use_mm_for_euclid_dist"
        )
        total += float(dists.min(dim=1).values.sum())
    return total / len(pts)


def pose_errors(cam_from_mesh_est: np.ndarray, cam_from_mesh_gt: np.ndarray, points_mesh: np.ndarray) -> PoseErrors:
    """ADD, ADD-S, rotation and translation error of one estimate (metres, degrees)."""
    return PoseErrors(
        add_m=add_error(cam_from_mesh_est, cam_from_mesh_gt, points_mesh),
        adds_m=adds_error(cam_from_mesh_est, cam_from_mesh_gt, points_mesh),
        rot_deg=rotation_error_deg(cam_from_mesh_est, cam_from_mesh_gt),
        trans_m=translation_error_m(cam_from_mesh_est, cam_from_mesh_gt),
    )


def rotation_error_deg(cam_from_mesh_est: np.ndarray, cam_from_mesh_gt: np.ndarray) -> float:
    """Geodesic angle between the two rotations, degrees."""
    est = _check_pose(cam_from_mesh_est, "cam_from_mesh_est")
    gt = _check_pose(cam_from_mesh_gt, "cam_from_mesh_gt")
    cos = (np.trace(est[:3, :3] @ gt[:3, :3].T) - 1.0) / 2.0
    return float(np.degrees(np.arccos(np.clip(cos, -1.0, 1.0))))


def translation_error_m(cam_from_mesh_est: np.ndarray, cam_from_mesh_gt: np.ndarray) -> float:
    """Distance between the two translations (the mesh-frame origins in the camera), metres."""
    est = _check_pose(cam_from_mesh_est, "cam_from_mesh_est")
    gt = _check_pose(cam_from_mesh_gt, "cam_from_mesh_gt")
    return float(np.linalg.norm(est[:3, 3] - gt[:3, 3]))


def _stats(values: np.ndarray) -> dict[str, float]:
    return {"mean": float(values.mean()), "median": float(np.median(values)), "max": float(values.max())}


def error_report(errors: list[PoseErrors], diameter_m: float, success_fraction: float = 0.1) -> dict:
    """Summary of per-frame errors of a sequence or a set of views (the JSON of evaluate and the demo).

    Returns ``frames``; mean / median / max of ``add_m``, ``adds_m``, ``rot_deg``, ``trans_m``;
    ``success_rate`` (share of frames with ADD < ``success_fraction`` x diameter) and ``worst_add_diameters``;
    ``drift``: ADD and translation error of the last frame minus the first, and the least-squares slope of
    ADD per frame (metres / frame), which is how tracking error accumulates over a sequence.
    """
    if not errors:
        raise ValueError("error_report needs at least one frame")
    add = np.array([e.add_m for e in errors])
    trans = np.array([e.trans_m for e in errors])
    report = {
        "frames": len(errors),
        "add_m": _stats(add),
        "adds_m": _stats(np.array([e.adds_m for e in errors])),
        "rot_deg": _stats(np.array([e.rot_deg for e in errors])),
        "trans_m": _stats(trans),
        "success_rate": float((add < success_fraction * diameter_m).mean()),
        "success_threshold_m": success_fraction * diameter_m,
        "worst_add_diameters": float(add.max() / diameter_m),
    }
    slope = float(np.polyfit(np.arange(len(add)), add, 1)[0]) if len(add) > 1 else 0.0
    report["drift"] = {"add_last_minus_first_m": float(add[-1] - add[0]),
                       "trans_last_minus_first_m": float(trans[-1] - trans[0]), "add_slope_m_per_frame": slope}
    return report
