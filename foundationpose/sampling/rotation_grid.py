"""Rotation hypotheses for register: icosphere views x in-plane angles, pruned by symmetry (spec §2.1).

Frames: a hypothesis is ``cam_from_centred`` (object-in-camera, upstream ``ob_in_cam``) with a
placeholder translation; the register path replaces the translation by the depth guess (§2.2).
The grid is float32 NumPy, built once per object on the host.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "centred_from_view_cam",
    "cluster_poses",
    "icosphere_views",
    "make_rotation_grid",
    "symmetry_tfs_from_bop_info",
]

logger = logging.getLogger(__name__)

_GOLDEN = (1.0 + math.sqrt(5.0)) / 2.0

# Icosahedron vertices (trimesh order, spec §2.1), before normalisation.
_ICOSAHEDRON_RAW = (
    (-1.0, _GOLDEN, 0.0),
    (1.0, _GOLDEN, 0.0),
    (-1.0, -_GOLDEN, 0.0),
    (1.0, -_GOLDEN, 0.0),
    (0.0, -1.0, _GOLDEN),
    (0.0, 1.0, _GOLDEN),
    (0.0, -1.0, -_GOLDEN),
    (0.0, 1.0, -_GOLDEN),
    (_GOLDEN, 0.0, -1.0),
    (_GOLDEN, 0.0, 1.0),
    (-_GOLDEN, 0.0, -1.0),
    (-_GOLDEN, 0.0, 1.0),
)

# The 30 icosahedron edges (i, j), i < j, sorted by j then i: the order of the level-1 midpoints.
_ICOSAHEDRON_EDGES = (
    (0, 1), (2, 3), (2, 4), (3, 4), (0, 5), (1, 5), (4, 5), (2, 6), (3, 6), (0, 7),
    (1, 7), (6, 7), (1, 8), (3, 8), (6, 8), (7, 8), (1, 9), (3, 9), (4, 9), (5, 9),
    (8, 9), (0, 10), (2, 10), (6, 10), (7, 10), (0, 11), (2, 11), (4, 11), (5, 11), (10, 11),
)  # fmt: skip

_LEVEL1_VERTEX_COUNT = 42
_CONTINUOUS_SYMMETRY_STEP_DEG = 5  # ref rot_angle_discrete
_CLUSTER_CHUNK_ELEMENTS = 1 << 22  # angle-matrix entries per chunk in cluster_poses (16 MiB float32)


def _normalise_rows(vectors: np.ndarray) -> np.ndarray:
    return vectors / np.linalg.norm(vectors, axis=-1, keepdims=True)


def icosphere_views(subdivisions: int = 1) -> np.ndarray:
    """Unit view directions: the vertices of a radius-1 icosphere, in trimesh's order.

    Level 1 (the only level the default grid uses) is built here: the 12 normalised
    icosahedron vertices, then the 30 normalised edge midpoints ordered by (larger index, smaller
    index). It equals ``trimesh.creation.icosphere(subdivisions=1).vertices`` bit for bit.
    Levels >= 2 are delegated to trimesh (imported lazily).

    Returns:
        (V, 3) float64, V = 10 * 4**subdivisions + 2 (42 at level 1); rows have unit norm.
    """
    if subdivisions < 1:
        raise ValueError(f"subdivisions must be >= 1, got {subdivisions}")
    if subdivisions > 1:
        import trimesh  # heavy import; only for non-default grids

        return np.asarray(trimesh.creation.icosphere(subdivisions=subdivisions).vertices, dtype=np.float64)
    base = _normalise_rows(np.asarray(_ICOSAHEDRON_RAW, dtype=np.float64))  # (12, 3)
    edges = np.asarray(_ICOSAHEDRON_EDGES, dtype=np.int64)  # (30, 2)
    midpoints = (base[edges[:, 0]] + base[edges[:, 1]]) / 2.0  # (30, 3)
    return np.concatenate([base, _normalise_rows(midpoints)], axis=0)  # (42, 3)


def centred_from_view_cam(views: np.ndarray) -> np.ndarray:
    """Camera poses looking at the object origin from each view position (``centred_from_cam``).

    Camera z = -p/|p|; x = normalise(up x z) with up = (0,0,1), replaced by (1,0,0) where that cross
    product is exactly zero (the two poles); y = normalise(z x x). Translation = p.

    Args:
        views: (V, 3) float64 camera positions in the centred object frame.
    Returns:
        (V, 4, 4) float64 rigid transforms, rotation columns (x, y, z).
    """
    views = np.asarray(views, dtype=np.float64)
    z_axis = _normalise_rows(-views)  # (V, 3)
    up = np.array([0.0, 0.0, 1.0])
    x_axis = np.cross(up[None, :], z_axis)  # (V, 3)
    degenerate = np.all(x_axis == 0.0, axis=-1)
    x_axis[degenerate] = (1.0, 0.0, 0.0)
    x_axis = _normalise_rows(x_axis)
    y_axis = _normalise_rows(np.cross(z_axis, x_axis))
    centred_from_cam = np.tile(np.eye(4), (len(views), 1, 1))  # (V, 4, 4)
    centred_from_cam[:, :3, 0] = x_axis
    centred_from_cam[:, :3, 1] = y_axis
    centred_from_cam[:, :3, 2] = z_axis
    centred_from_cam[:, :3, 3] = views
    return centred_from_cam


def _rotation_about_axis(axis: int, angle_rad: float) -> np.ndarray:
    """(4, 4) float64 right-handed rotation about object x (0), y (1) or z (2)."""
    c, s = math.cos(angle_rad), math.sin(angle_rad)
    i, j = [(1, 2), (2, 0), (0, 1)][axis]  # the plane rotated: x -> (y, z), y -> (z, x), z -> (x, y)
    tf = np.eye(4)
    tf[i, i], tf[i, j] = c, -s
    tf[j, i], tf[j, j] = s, c
    return tf


def _inplane_rotations(step_deg: float) -> np.ndarray:
    """(A, 4, 4) float64 Rz(theta), theta = 0, step, ... < 360 degrees."""
    angles_rad = np.arange(0, 360, step_deg) / 180.0 * np.pi
    return np.stack([_rotation_about_axis(2, float(a)) for a in angles_rad])


def _rotation_angles_float32(rot_a: np.ndarray, rot_b: np.ndarray) -> np.ndarray:
    """Geodesic angles (rad, float32) between every rotation of ``rot_a`` and every one of ``rot_b``.

    Args:
        rot_a: (..., 3, 3) float32. rot_b: (Q, 3, 3) float32.
    Returns:
        (..., Q) float32 ``acos(clamp((trace(A B^T) - 1) / 2, -1, 1))``.
    """
    trace = np.einsum("...ab,qab->...q", rot_a, rot_b, dtype=np.float32)  # trace(A B^T) = sum(A * B)
    cos = np.clip((trace - np.float32(1.0)) / np.float32(2.0), np.float32(-1.0), np.float32(1.0))
    return np.arccos(cos).astype(np.float32)


def cluster_poses(
    poses: np.ndarray,
    symmetry_tfs: np.ndarray | None = None,
    angle_deg: float = 30.0,
    dist: float = 99999.0,
) -> np.ndarray:
    """Greedy pruning of near-duplicate poses under object symmetries (spec §2.1, ref ``cluster_poses``).

    Pose 0 is kept; a later pose P is dropped when some already-kept pose Q has
    ``|t_P - t_Q| < dist`` and, for some symmetry S, the geodesic angle between rot(P @ S) and
    rot(Q) is below ``angle_deg``. Angles are computed in float32 with the cosine clamped to [-1, 1].

    Args:
        poses: (M, 4, 4) ``cam_from_centred`` transforms (cast to float32), in priority order.
        symmetry_tfs: (K, 4, 4) symmetry transforms of the centred object (identity included);
            None means ``[I]``. Only their rotation part matters.
        angle_deg: rotation threshold in degrees (30).
        dist: translation threshold in metres (99999: effectively always close).
    Returns:
        (M', 4, 4) float32, the kept poses in their original order.
    """
    poses32 = np.asarray(poses, dtype=np.float32)
    if poses32.ndim != 3 or poses32.shape[1:] != (4, 4):
        raise ValueError(f"poses must be (M, 4, 4), got {poses32.shape}")
    sym32 = (
        np.eye(4, dtype=np.float32)[None] if symmetry_tfs is None else np.asarray(symmetry_tfs, np.float32)
    )
    if sym32.ndim != 3 or sym32.shape[1:] != (4, 4) or len(sym32) == 0:
        raise ValueError(f"symmetry_tfs must be (K, 4, 4) with K >= 1, got {sym32.shape}")
    if len(poses32) == 0:
        return poses32.copy()

    rot = poses32[:, :3, :3]  # (M, 3, 3)
    sym_rot = sym32[:, :3, :3]  # (K, 3, 3)
    angle_thres = np.float32(angle_deg / 180.0 * np.pi)
    rot_close = np.zeros((len(rot), len(rot)), dtype=bool)  # (M, M): [p, q]
    chunk = max(1, _CLUSTER_CHUNK_ELEMENTS // (len(sym_rot) * len(rot)))
    for start in range(0, len(rot), chunk):
        rot_sym = np.matmul(rot[start : start + chunk, None], sym_rot[None])  # (m, K, 3, 3) rot(P @ S)
        angles = _rotation_angles_float32(rot_sym, rot)  # (m, K, M): [p, k, q]
        rot_close[start : start + chunk] = (angles < angle_thres).any(axis=1)
    trans = poses32[:, :3, 3]
    trans_dist = np.linalg.norm(trans[:, None] - trans[None], axis=-1)  # (M, M) float32
    close = rot_close & (trans_dist < np.float32(dist))

    kept = np.zeros(len(poses32), dtype=bool)
    kept[0] = True
    for p in range(1, len(poses32)):
        kept[p] = not np.any(close[p] & kept)
    logger.debug("cluster_poses kept %d of %d poses (K=%d)", int(kept.sum()), len(poses32), len(sym32))
    return poses32[kept]


def make_rotation_grid(
    symmetry_tfs: np.ndarray | None = None,
    min_n_views: int = 40,
    inplane_step_deg: float = 60,
) -> np.ndarray:
    """Rotation hypotheses ``cam_from_centred`` for register (spec §2.1, ref ``make_rotation_grid``).

    Views: the coarsest icosphere (level >= 1) with at least ``min_n_views`` vertices (42 by
    default). For each view (major) and in-plane angle theta = 0, step, ... (minor):
    ``cam_from_centred = inv(centred_from_cam @ Rz(theta))`` (general 4x4 float64 inverse), rounded
    to float32, then pruned by :func:`cluster_poses` (30 deg) under ``symmetry_tfs``.

    Args:
        symmetry_tfs: (K, 4, 4) object symmetries (identity first) or None for ``[I]``.
        min_n_views: minimum number of view directions (40 -> 42).
        inplane_step_deg: in-plane step in degrees (60 -> 6 angles).
    Returns:
        (M, 4, 4) float32 NumPy; M = 252 without symmetries. The translation column is the
        placeholder (0, 0, 1) (up to rounding) and is meant to be overwritten.
    """
    if inplane_step_deg <= 0:
        raise ValueError(f"inplane_step_deg must be > 0, got {inplane_step_deg}")
    subdivisions = 1
    while 10 * 4**subdivisions + 2 < min_n_views:
        subdivisions += 1
    views = icosphere_views(subdivisions)  # (V, 3)
    centred_from_cam = centred_from_view_cam(views)  # (V, 4, 4)
    inplane = _inplane_rotations(inplane_step_deg)  # (A, 4, 4)
    rotated = np.matmul(centred_from_cam[:, None], inplane[None])  # (V, A, 4, 4) view-major
    cam_from_centred = np.linalg.inv(rotated.reshape(-1, 4, 4)).astype(np.float32)  # (V*A, 4, 4)
    grid = cluster_poses(cam_from_centred, symmetry_tfs, angle_deg=30.0, dist=99999.0)
    logger.info("rotation grid: %d views x %d in-plane -> %d hypotheses", len(views), len(inplane), len(grid))
    return grid


def symmetry_tfs_from_bop_info(info: Mapping[str, Any]) -> np.ndarray:
    """Symmetry transforms of an object from its BOP ``models_info.json`` entry (ref ``symmetry_tfs_from_info``).

    Order: identity; then each ``symmetries_discrete`` entry (16 row-major numbers, translation in
    millimetres, converted to metres); then, for the **first** ``symmetries_continuous`` entry only,
    rotations every 5 deg (0 deg included, 72 samples) about object x if ``axis[0] > 0``, else y if
    ``axis[1] > 0``, else z if ``axis[2] > 0``, each with ``offset`` copied unscaled into the translation.
    An axis with no positive component yields a single sample: identity rotation with the offset
    (as in the reference; it does not change the clustering).

    Returns:
        (K, 4, 4) float64.
    """
    tfs: list[np.ndarray] = [np.eye(4)]
    discrete: Sequence[Sequence[float]] = info.get("symmetries_discrete", ()) or ()
    for flat in discrete:
        tf = np.asarray(flat, dtype=np.float64).reshape(4, 4).copy()
        tf[:3, 3] *= 0.001  # mm -> m
        tfs.append(tf)
    continuous = info.get("symmetries_continuous", ()) or ()
    if len(continuous) > 0:
        first = continuous[0]
        axis = np.asarray(first["axis"], dtype=np.float64).reshape(3)
        offset = np.asarray(first["offset"], dtype=np.float64).reshape(3)
        positive = np.flatnonzero(axis > 0)
        if len(positive) > 0:
            about = int(positive[0])
            angles_rad = np.arange(0, 360, _CONTINUOUS_SYMMETRY_STEP_DEG) / 180.0 * np.pi
        else:
            about, angles_rad = 2, np.zeros(1)
        for angle in angles_rad:
            tf = _rotation_about_axis(about, float(angle))
            tf[:3, 3] = offset
            tfs.append(tf)
    return np.stack(tfs)
