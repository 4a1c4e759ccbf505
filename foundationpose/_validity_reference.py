"""Readable reference twin of :func:`foundationpose.validity.measure_validity` (one request at a time).

It computes the same float32 quantities point by point with boolean selections and Python control flow, the way
one would write them without the capture rules; the parity test compares the two. Not used by the track path.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from foundationpose.constants import MIN_VALID_DEPTH_M
from foundationpose.validity import MEASUREMENTS, ValidityConfig, ValidityModel

__all__ = ["measure_validity_reference"]


def _one(depth: Tensor, K: Tensor, start: Tensor, final: Tensor, model: ValidityModel, tol: float) -> list[float]:
    height, width = depth.shape
    R, t = final[:3, :3], final[:3, 3]
    points_cam = model.points_centred @ R.T + t  # (P, 3)
    normals_cam = model.normals_centred @ R.T
    fx, fy, cx, cy = (float(K[0, 0]), float(K[1, 1]), float(K[0, 2]), float(K[1, 2]))

    facing = [(n @ p) < 0 and p[2] > 1e-3 for p, n in zip(points_cam, normals_cam, strict=True)]
    n_facing = sum(bool(f) for f in facing)
    inside, agree, occluded, behind, reading, residuals = 0, 0, 0, 0, 0, []
    for p, front in zip(points_cam, facing, strict=True):
        if not front:
            continue
        x, y, z = (float(c) for c in p)
        u = round(torch.tensor(fx * x / z + cx, dtype=torch.float32).item())  # half to even, like torch.round
        v = round(torch.tensor(fy * y / z + cy, dtype=torch.float32).item())
        if not (0 <= u <= width - 1 and 0 <= v <= height - 1):
            continue
        inside += 1
        seen = float(depth[v, u])
        if seen < MIN_VALID_DEPTH_M:
            continue
        reading += 1
        residual = seen - z
        if abs(residual) <= tol:
            agree += 1
            residuals.append(abs(residual))
        elif residual < -tol:
            occluded += 1
        else:
            behind += 1

    cos = (float(torch.trace(R @ start[:3, :3].T)) - 1.0) / 2.0
    values = {
        "in_image_fraction": inside / max(n_facing, 1),
        "reading_fraction": reading / max(inside, 1),
        "agree_fraction": agree / max(reading, 1),
        "occluded_fraction": occluded / max(reading, 1),
        "behind_fraction": behind / max(reading, 1),
        "consistent_fraction": agree / max(agree + behind, 1),
        "support_fraction": agree / max(n_facing, 1),
        "residual_m": sum(residuals) / max(agree, 1),
        "translation_m": float((final[:3, 3] - start[:3, 3]).norm()),
        "rotation_deg": math.degrees(math.acos(min(1.0, max(-1.0, cos)))),
        "visible_points": float(inside),
    }
    return [values[name] for name in MEASUREMENTS]


def measure_validity_reference(depth: Tensor, K: Tensor, start_cam_from_centred: Tensor, cam_from_centred: Tensor,
                               model: ValidityModel, config: ValidityConfig) -> Tensor:
    """Mirrors :func:`foundationpose.validity.measure_validity` (same arguments, same (B, M) float32 result)."""
    tol = config.depth_tolerance_diameters * model.diameter
    rows = [_one(depth[b], K[b], start_cam_from_centred[b], cam_from_centred[b], model, tol)
            for b in range(depth.shape[0])]
    return torch.tensor(rows, dtype=torch.float32)
