"""Readable reference twin of :func:`foundationpose.validity.measure_validity` (one request at a time) and of
:func:`~foundationpose.validity.measure_validity_rows` over a group's table (:func:`measure_rows_reference`: each
row with its own object's model and config, looked up by its index; no table, no padding).

It computes the same float32 quantities point by point (and, for the appearance, cell by cell over the crops'
pixels) with boolean selections and Python control flow, the way one would write them without the capture rules;
the parity tests compare the two. Not used by the track path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from foundationpose.constants import MIN_VALID_DEPTH_M
from foundationpose.validity import APPEARANCE_CELL_PX, MEASUREMENTS, ValidityConfig, ValidityModel

__all__ = ["measure_rows_reference", "measure_validity_reference"]


def _appearance(render_input: Tensor, transf_input: Tensor, band: float, textured: bool) -> dict[str, float]:
    """One pair of (S, S, 6) crops: the compared pixels, their cells and the correlation, cell by cell."""
    size = render_input.shape[0]
    cell = APPEARANCE_CELL_PX
    rendered_cells, observed_cells, weights = [], [], []
    for top in range(0, size, cell):
        for left in range(0, size, cell):
            r = render_input[top:top + cell, left:left + cell].reshape(-1, 6)
            o = transf_input[top:top + cell, left:left + cell].reshape(-1, 6)
            compared = [bool((a[3:] != 0).any() and (b[3:] != 0).any() and abs(float(a[5] - b[5])) <= band)
                        for a, b in zip(r, o, strict=True)]
            share = sum(compared) / len(compared)
            if share < 0.5:
                continue
            keep = torch.tensor(compared)
            rendered_cells.append(float(r[keep, :3].mean(1).mean()))
            observed_cells.append(float(o[keep, :3].mean(1).mean()))
            weights.append(share)
    if not weights:
        return {"appearance_cells": 0.0, "texture_contrast": 0.0, "appearance_ncc": 0.0}
    total = sum(weights)
    mean_r = sum(w * a for w, a in zip(weights, rendered_cells, strict=True)) / total
    mean_o = sum(w * b for w, b in zip(weights, observed_cells, strict=True)) / total
    var_r = sum(w * (a - mean_r) ** 2 for w, a in zip(weights, rendered_cells, strict=True))
    var_o = sum(w * (b - mean_o) ** 2 for w, b in zip(weights, observed_cells, strict=True))
    cov = sum(w * (a - mean_r) * (b - mean_o)
              for w, a, b in zip(weights, rendered_cells, observed_cells, strict=True))
    return {"appearance_cells": float(len(weights)) if textured else 0.0,
            "texture_contrast": math.sqrt(max(var_r, var_o) / total),
            "appearance_ncc": cov / max(math.sqrt(var_r * var_o), 1e-12)}


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
        "appearance_cells": 0.0, "texture_contrast": 0.0, "appearance_ncc": 0.0,
    }
    return [values[name] for name in MEASUREMENTS]


def measure_validity_reference(depth: Tensor, K: Tensor, start_cam_from_centred: Tensor, cam_from_centred: Tensor,
                               model: ValidityModel, config: ValidityConfig,
                               appearance: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Mirrors :func:`foundationpose.validity.measure_validity` (same arguments, same (B, M) float32 result)."""
    tol = config.depth_tolerance_diameters * model.diameter
    rows = []
    for b in range(depth.shape[0]):
        row = _one(depth[b], K[b], start_cam_from_centred[b], cam_from_centred[b], model, tol)
        if appearance is not None:
            seen = _appearance(appearance[0][b], appearance[1][b], 2.0 * config.depth_tolerance_diameters,
                               model.textured)
            row[-3:] = [seen[name] for name in MEASUREMENTS[-3:]]
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float32)


def measure_rows_reference(depth: Tensor, K: Tensor, start_cam_from_centred: Tensor, cam_from_centred: Tensor,
                           validity: Sequence[tuple[ValidityModel, ValidityConfig]], row_object: Sequence[int],
                           appearance: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Mirrors :func:`foundationpose.validity.measure_validity_rows` over ``ValidityTable.of(validity).rows(
    row_object)``: row i is :func:`measure_validity_reference` of row i with object ``row_object[i]``'s model and
    config. Returns (B, M) float32."""
    rows = []
    for b, k in enumerate(row_object):
        model, config = validity[int(k)]
        pair = None if appearance is None else (appearance[0][b:b + 1], appearance[1][b:b + 1])
        rows.append(measure_validity_reference(depth[b:b + 1], K[b:b + 1], start_cam_from_centred[b:b + 1],
                                               cam_from_centred[b:b + 1], model, config, pair)[0])
    return torch.stack(rows)
