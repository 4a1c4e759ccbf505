"""Pose error metrics ADD and ADD-S over a mesh's points, in metres.

* ADD (average distance of model points): ``mean_i |T_est p_i - T_gt p_i|``.
* ADD-S (symmetric variant): ``mean_i min_j |T_gt p_i - T_est p_j|``; 0 for poses that differ by a
  symmetry of the point set.
* ADD under declared symmetries: ``min_k ADD(T_est S_k, T_gt)`` over the object's symmetry transforms
  (:mod:`foundationpose.symmetry`); equal to ADD for an object without declared symmetries.

``p_i`` are :data:`MODEL_POINTS` points drawn uniformly over the mesh's surface (:func:`model_points`, seeded):
distinct vertices would weight the surface by its triangulation (the L-block has 12 corners and nothing
between them). Poses are ``cam_from_mesh`` (4, 4), metres.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import trimesh

from foundationpose.errors import InputError
from foundationpose.surface import SurfaceSamples, sample_surface

__all__ = [
    "MODEL_POINTS",
    "PoseErrors",
    "add_error",
    "add_symmetric_error",
    "adds_error",
    "error_report",
    "model_points",
    "pose_errors",
    "rotation_error_deg",
    "translation_error_m",
]

MODEL_POINTS = 2000  # surface samples the metrics are evaluated on (bounded cost for ADD-S)
_CDIST_ROWS = 1024  # rows of the pairwise-distance matrix held at once


@dataclass(frozen=True, slots=True)
class PoseErrors:
    """ADD and ADD-S (metres), rotation error (degrees) and translation error (metres) of one estimate;
    add_sym_m: ADD under the declared symmetries (NaN when not computed)."""

    add_m: float
    adds_m: float
    rot_deg: float = float("nan")
    trans_m: float = float("nan")
    add_sym_m: float = float("nan")


def model_points(mesh: trimesh.Trimesh, count: int = MODEL_POINTS, seed: int = 0) -> SurfaceSamples:
    """``count`` points uniformly over ``mesh``'s surface (its own frame, e.g. ``ObjectModel.mesh``: the mesh
    frame), seeded; ``.points`` (P, 3) float64 metres, ``.describe()`` for reports. Raises InputError for a mesh
    without faces or area."""
    verts, faces = np.asarray(mesh.vertices, dtype=np.float64), np.asarray(mesh.faces)
    if verts.ndim != 2 or verts.shape[1] != 3 or len(verts) == 0 or not np.isfinite(verts).all():
        raise InputError("mesh", "finite (V, 3) vertices with V >= 1", f"shape {verts.shape}")
    return sample_surface(verts, faces, count, seed)


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


def add_symmetric_error(cam_from_mesh_est: np.ndarray, cam_from_mesh_gt: np.ndarray, points_mesh: np.ndarray,
                        symmetry_tfs_mesh: np.ndarray) -> float:
    """``min_k ADD(est @ S_k, gt)`` in metres. symmetry_tfs_mesh: (K, 4, 4) mesh-frame symmetries, identity
    included (:func:`foundationpose.symmetry.to_mesh_frame_tfs`)."""
    est = _check_pose(cam_from_mesh_est, "cam_from_mesh_est")
    gt = _check_pose(cam_from_mesh_gt, "cam_from_mesh_gt")
    pts = np.asarray(points_mesh, dtype=np.float64)
    gt_cam = _transform(gt, pts)  # (P, 3)
    variants = est[None] @ np.asarray(symmetry_tfs_mesh, dtype=np.float64)  # (K, 4, 4)
    est_cam = pts @ variants[:, :3, :3].transpose(0, 2, 1) + variants[:, None, :3, 3]  # (K, P, 3)
    return float(np.linalg.norm(est_cam - gt_cam, axis=2).mean(axis=1).min())


def pose_errors(cam_from_mesh_est: np.ndarray, cam_from_mesh_gt: np.ndarray, points_mesh: np.ndarray,
                symmetry_tfs_mesh: np.ndarray | None = None) -> PoseErrors:
    """ADD, ADD-S, rotation and translation error of one estimate (metres, degrees); ADD under the symmetries
    when ``symmetry_tfs_mesh`` (K, 4, 4) is given, else ``add_sym_m`` = ADD."""
    add = add_error(cam_from_mesh_est, cam_from_mesh_gt, points_mesh)
    return PoseErrors(
        add_m=add,
        adds_m=adds_error(cam_from_mesh_est, cam_from_mesh_gt, points_mesh),
        rot_deg=rotation_error_deg(cam_from_mesh_est, cam_from_mesh_gt),
        trans_m=translation_error_m(cam_from_mesh_est, cam_from_mesh_gt),
        add_sym_m=add if symmetry_tfs_mesh is None else add_symmetric_error(
            cam_from_mesh_est, cam_from_mesh_gt, points_mesh, symmetry_tfs_mesh),
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

    Returns ``frames``; mean / median / max of ``add_m``, ``adds_m``, ``add_sym_m``, ``rot_deg``, ``trans_m``;
    ``success_rate`` (share of frames with ADD under the declared symmetries < ``success_fraction`` x diameter;
    plain ADD where it was not computed) and ``worst_add_diameters``;
    ``drift``: ADD and translation error of the last frame minus the first, and the least-squares slope of
    ADD per frame (metres / frame), which is how tracking error accumulates over a sequence.
    """
    if not errors:
        raise ValueError("error_report needs at least one frame")
    add = np.array([e.add_m for e in errors])
    add_sym = np.array([e.add_m if math.isnan(e.add_sym_m) else e.add_sym_m for e in errors])
    trans = np.array([e.trans_m for e in errors])
    report = {
        "frames": len(errors),
        "add_m": _stats(add),
        "adds_m": _stats(np.array([e.adds_m for e in errors])),
        "add_sym_m": _stats(add_sym),
        "rot_deg": _stats(np.array([e.rot_deg for e in errors])),
        "trans_m": _stats(trans),
        "success_rate": float((add_sym < success_fraction * diameter_m).mean()),
        "success_threshold_m": success_fraction * diameter_m,
        "worst_add_diameters": float(add.max() / diameter_m),
    }
    slope = float(np.polyfit(np.arange(len(add)), add, 1)[0]) if len(add) > 1 else 0.0
    report["drift"] = {"add_last_minus_first_m": float(add[-1] - add[0]),
                       "trans_last_minus_first_m": float(trans[-1] - trans[0]), "add_slope_m_per_frame": slope}
    return report
