"""Symmetric objects: declarations, the symmetry transforms they generate, and one pose per symmetry class.

A symmetry ``S`` of an object (a rigid transform of its own frame) makes ``cam_from_mesh`` and
``cam_from_mesh @ S`` look the same, so an estimator may answer either. Declarations (mesh frame):

* discrete:   an axis and an order ``n`` (rotations by ``k 360/n`` degrees), e.g. ``z:4`` for a square box's lid;
* continuous: an axis, discretised every ``step_deg`` degrees (default 5, the reference's step for the register
  grid), e.g. ``z:inf`` for a cylinder, ``z:inf:10`` for 10-degree steps;
* explicit:   a list of 4x4 transforms in metres (e.g. from a BOP ``models_info.json``).

Axes pass through ``point`` (mesh frame), by default the centre of the mesh's bounding box, i.e. the origin of
the centred frame (the axis of a symmetric object passes through it whenever the axis is one of the mesh's
coordinate axes). :func:`symmetry_tfs` closes the declarations into a group (products of every pair, until
nothing new appears), in the centred frame that :func:`foundationpose.sampling.make_rotation_grid` and
``PoseEstimator.register(symmetry_tfs=...)`` take, identity first.

:func:`canonical_pose` maps a pose to the member of its symmetry class nearest a reference pose (the previous
answer), so that the estimator hopping between equivalent poses never shows as a jump; batched torch, no host
synchronisation, so it can run inside a captured track step.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from foundationpose.errors import InputError

__all__ = [
    "CONTINUOUS_STEP_DEG",
    "MAX_SYMMETRIES",
    "ObjectSymmetry",
    "Symmetry",
    "add_symmetry_options",
    "canonical_pose",
    "load_symmetry_file",
    "parse_symmetry",
    "rotation_about",
    "symmetries_of_options",
    "symmetry_tfs",
    "to_mesh_frame_tfs",
]

CONTINUOUS_STEP_DEG = 5.0  # the reference's discretisation of a continuous symmetry (spec §2.1, rot_angle_discrete)
MAX_SYMMETRIES = 2048  # a larger group is a declaration mistake (and would make register's clustering slow)
_AXES = {"x": (1.0, 0.0, 0.0), "y": (0.0, 1.0, 0.0), "z": (0.0, 0.0, 1.0)}


@dataclass(frozen=True, slots=True, eq=False)
class Symmetry:
    """One declaration. kind: "discrete" (axis, order), "continuous" (axis, step_deg) or "transforms"
    (transforms (K, 4, 4) float64, mesh frame, metres). axis: (3,) unit vector in the mesh frame; point: (3,) a
    point of the axis in the mesh frame, None = the bounding-box centre."""

    kind: str
    axis: tuple[float, float, float] | None = None
    order: int | None = None
    step_deg: float | None = None
    point: tuple[float, float, float] | None = None
    transforms: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("discrete", "continuous", "transforms"):
            raise ValueError(f"kind must be discrete, continuous or transforms, got {self.kind!r}")
        if self.kind == "discrete" and (self.order is None or self.order < 2):
            raise ValueError(f"a discrete symmetry needs an order >= 2, got {self.order}")
        if self.kind == "continuous" and not (self.step_deg is not None and 0 < self.step_deg <= 180):
            raise ValueError(f"a continuous symmetry needs 0 < step_deg <= 180, got {self.step_deg}")
        if self.kind == "transforms" and self.transforms is None:
            raise ValueError("a transforms symmetry needs transforms (K, 4, 4)")

    def describe(self) -> str:
        """A short text for reports: ``discrete z 4``, ``continuous (0, 0, 1) every 5 deg``, ``3 transforms``."""
        if self.kind == "transforms":
            return f"{len(self.transforms)} transforms"
        axis = next((name for name, v in _AXES.items() if np.allclose(v, self.axis)), str(tuple(self.axis)))
        return f"discrete {axis} {self.order}" if self.kind == "discrete" else f"continuous {axis} every {self.step_deg:g} deg"


def parse_symmetry(text: str) -> Symmetry:
    """A declaration from its command-line spelling: ``AXIS:ORDER`` or ``AXIS:inf[:STEP_DEG]``; AXIS is x, y, z
    or three comma-separated numbers (normalised). Raises InputError (field ``--symmetry``) otherwise."""
    parts = text.strip().split(":")
    expected = "AXIS:ORDER (e.g. z:4) or AXIS:inf[:STEP_DEG] (e.g. z:inf), AXIS = x, y, z or 'ax,ay,az'"
    if len(parts) not in (2, 3):
        raise InputError("--symmetry", expected, repr(text))
    axis = _parse_axis(parts[0], text, expected)
    if parts[1].lower() in ("inf", "continuous"):
        try:
            step = float(parts[2]) if len(parts) == 3 else CONTINUOUS_STEP_DEG
        except ValueError:
            raise InputError("--symmetry", expected, repr(text)) from None
        if not 0 < step <= 180:
            raise InputError("--symmetry", "a step in (0, 180] degrees", repr(text))
        return Symmetry("continuous", axis=axis, step_deg=step)
    if len(parts) == 3:
        raise InputError("--symmetry", expected, repr(text))
    try:
        order = int(parts[1])
    except ValueError:
        raise InputError("--symmetry", expected, repr(text)) from None
    if order < 2:
        raise InputError("--symmetry", "an order >= 2", repr(text))
    return Symmetry("discrete", axis=axis, order=order)


def _parse_axis(text: str, whole: str, expected: str) -> tuple[float, float, float]:
    if text.lower() in _AXES:
        return _AXES[text.lower()]
    try:
        values = np.array([float(v) for v in text.split(",")], dtype=np.float64)
    except ValueError:
        raise InputError("--symmetry", expected, repr(whole)) from None
    norm = float(np.linalg.norm(values)) if values.shape == (3,) else 0.0
    if not norm > 0 or not np.isfinite(values).all():
        raise InputError("--symmetry", "a non-zero, finite 3-vector axis", repr(whole))
    return tuple(float(v) for v in values / norm)  # type: ignore[return-value]


def load_symmetry_file(path: str | Path) -> Symmetry:
    """Explicit transforms from a file: ``.npy`` (K, 4, 4), or ``.json``: a list of 4x4 nested lists or of 16
    row-major numbers, metres, mesh frame. Raises InputError (field ``--symmetry-tfs``)."""
    p = Path(path)
    try:
        if p.suffix == ".npy":
            arr = np.load(p, allow_pickle=False)
        else:
            arr = np.asarray(json.loads(p.read_text(encoding="utf-8")), dtype=np.float64)
    except (OSError, ValueError) as exc:
        raise InputError("--symmetry-tfs", "a readable .npy or .json file of 4x4 transforms", f"'{p}' ({exc})") from exc
    arr = np.asarray(arr, dtype=np.float64)
    if arr.ndim == 2 and arr.shape[1] == 16:
        arr = arr.reshape(-1, 4, 4)
    if arr.ndim != 3 or arr.shape[1:] != (4, 4) or len(arr) == 0:
        raise InputError("--symmetry-tfs", "(K, 4, 4) transforms or K rows of 16 numbers", f"shape {arr.shape}")
    return Symmetry("transforms", transforms=arr)


def add_symmetry_options(parser: argparse.ArgumentParser) -> None:
    """``--symmetry`` (repeatable) and ``--symmetry-tfs``: the declarations of the commands that load an object."""
    parser.add_argument("--symmetry", action="append", default=[], metavar="AXIS:ORDER",
                        help="a symmetry of the object in its mesh frame, about an axis through its bounding-box "
                        "centre: AXIS:ORDER (discrete, e.g. z:4) or AXIS:inf[:STEP_DEG] (continuous, 5-degree steps "
                        "by default); AXIS = x, y, z or 'ax,ay,az'; repeat for several (default: none)")
    parser.add_argument("--symmetry-tfs", type=Path, default=None, metavar="FILE",
                        help="explicit symmetry transforms in the mesh frame, metres: .npy (K, 4, 4) or .json "
                        "(default: none)")


def symmetries_of_options(args: argparse.Namespace) -> list[Symmetry]:
    """What ``--symmetry`` / ``--symmetry-tfs`` declare (for ``load_object(symmetries=...)``); InputError naming
    the option."""
    declared = [parse_symmetry(text) for text in args.symmetry]
    if args.symmetry_tfs is not None:
        declared.append(load_symmetry_file(args.symmetry_tfs))
    return declared


def rotation_about(axis: Sequence[float], angle_rad: float, point: Sequence[float] = (0.0, 0.0, 0.0)) -> np.ndarray:
    """(4, 4) rotation by ``angle_rad`` about the unit ``axis`` through ``point`` (Rodrigues)."""
    x, y, z = axis
    c, s = math.cos(angle_rad), math.sin(angle_rad)
    k = np.array([[0.0, -z, y], [z, 0.0, -x], [-y, x, 0.0]])
    rot = np.eye(3) + s * k + (1.0 - c) * (k @ k)
    p = np.asarray(point, dtype=np.float64)
    tf = np.eye(4)
    tf[:3, :3], tf[:3, 3] = rot, p - rot @ p
    return tf


def _check_rigid(tfs: np.ndarray) -> None:
    rot = tfs[:, :3, :3]
    eye = np.broadcast_to(np.eye(3), rot.shape)
    ok = (np.isfinite(tfs).all(axis=(1, 2)) & np.allclose(tfs[:, 3], [0, 0, 0, 1], atol=1e-9)
          & (np.abs(rot @ rot.transpose(0, 2, 1) - eye).max(axis=(1, 2)) < 1e-5) & (np.linalg.det(rot) > 0))
    if not ok.all():
        bad = int(np.flatnonzero(~ok)[0])
        raise InputError("symmetry transforms", "rigid transforms (orthonormal rotation, det +1, last row 0 0 0 1)",
                         f"transform {bad}: {np.round(tfs[bad], 4).tolist()}")


def _generators(symmetry: Symmetry, mesh_centre: np.ndarray) -> list[np.ndarray]:
    """The declaration's transforms in the centred frame."""
    centred_from_mesh = np.eye(4)
    centred_from_mesh[:3, 3] = -mesh_centre
    mesh_from_centred = np.eye(4)
    mesh_from_centred[:3, 3] = mesh_centre
    if symmetry.kind == "transforms":
        tfs = np.asarray(symmetry.transforms, dtype=np.float64)
        _check_rigid(tfs)
        return [centred_from_mesh @ tf @ mesh_from_centred for tf in tfs]
    if symmetry.kind == "discrete":
        angles = [2.0 * math.pi * k / symmetry.order for k in range(1, symmetry.order)]
    else:
        n = max(1, round(360.0 / symmetry.step_deg))
        angles = [2.0 * math.pi * k / n for k in range(1, n)]
    point_c = np.zeros(3) if symmetry.point is None else np.asarray(symmetry.point, np.float64) - mesh_centre
    return [rotation_about(symmetry.axis, a, point_c) for a in angles]


def _key(tf: np.ndarray) -> bytes:
    """Hashable identity of a transform up to rounding (members closer than ~1e-6 share it)."""
    return (np.round(tf, 6) + 0.0).tobytes()  # + 0.0: -0.0 and 0.0 are the same entry


def symmetry_tfs(symmetries: Sequence[Symmetry], mesh_centre: np.ndarray) -> np.ndarray:
    """(K, 4, 4) float64 symmetry transforms of the centred object, identity first: the group the declarations
    generate. mesh_centre: (3,) the mesh's bounding-box centre (``ObjectModel.mesh_centre``).
    Raises InputError for non-rigid transforms or a group larger than :data:`MAX_SYMMETRIES`."""
    centre = np.asarray(mesh_centre, dtype=np.float64).reshape(3)
    members = [np.eye(4)]
    seen = {_key(members[0])}
    generators = np.stack([g for s in symmetries for g in _generators(s, centre)] or [np.eye(4)])
    frontier = list(members)
    while frontier:  # closure: multiply every new member by every generator
        new = []
        for m in frontier:
            for product in m @ generators:  # (G, 4, 4)
                key = _key(product)
                if key not in seen:
                    seen.add(key)
                    members.append(product)
                    new.append(product)
                    if len(members) > MAX_SYMMETRIES:
                        raise InputError("symmetries", f"a group of at most {MAX_SYMMETRIES} transforms",
                                         "more (check the declarations: they may not be symmetries of one object)")
        frontier = new
    return np.stack(members)


def to_mesh_frame_tfs(tfs_centred: np.ndarray, mesh_centre: np.ndarray) -> np.ndarray:
    """The same transforms in the mesh frame: ``mesh_from_centred @ S @ centred_from_mesh`` (for metrics on
    ``cam_from_mesh`` poses)."""
    centre = np.asarray(mesh_centre, dtype=np.float64).reshape(3)
    out = np.array(tfs_centred, dtype=np.float64, copy=True)
    rot, t = out[:, :3, :3], out[:, :3, 3]
    out[:, :3, 3] = t + centre - rot @ centre
    return out


def canonical_pose(cam_from_centred: Tensor, tfs_centred: Tensor, reference: Tensor | None = None) -> Tensor:
    """The member ``cam_from_centred @ S_k`` of each pose's symmetry class whose rotation is nearest the reference's.

    cam_from_centred: (B, 4, 4) float32. tfs_centred: (K, 4, 4) symmetry transforms (centred frame, same device).
    reference: (B, 4, 4) the previous answers, or None for the identity rotation (an absolute, deterministic
    choice). Nearest = largest ``trace(R_k R_ref^T)`` (smallest geodesic angle); ties go to the lowest k, so
    identity-first transforms keep a pose that is already nearest. No host synchronisation. Returns (B, 4, 4).
    """
    tfs = tfs_centred.to(cam_from_centred.dtype)
    candidates = torch.matmul(cam_from_centred[:, None], tfs[None])  # (B, K, 4, 4)
    if reference is None:
        closeness = candidates[:, :, 0, 0] + candidates[:, :, 1, 1] + candidates[:, :, 2, 2]  # trace(R_k)
    else:
        ref_rot = reference.to(cam_from_centred.dtype)[:, None, :3, :3]  # (B, 1, 3, 3)
        closeness = (candidates[:, :, :3, :3] * ref_rot).sum((2, 3))  # (B, K) trace(R_k R_ref^T)
    best = torch.argmax(closeness, dim=1)  # (B,) first maximum
    index = best[:, None, None, None].expand(-1, 1, 4, 4)
    return torch.gather(candidates, 1, index)[:, 0]


@dataclass(frozen=True, slots=True, eq=False)
class ObjectSymmetry:
    """An object's declared symmetries, closed into their group in both frames: tfs_centred (K, 4, 4) for the
    register grid and :func:`canonical_pose`, tfs_mesh (K, 4, 4) for metrics on ``cam_from_mesh`` poses."""

    declarations: tuple[Symmetry, ...]
    tfs_centred: np.ndarray
    tfs_mesh: np.ndarray

    @classmethod
    def of(cls, declarations: Sequence[Symmetry], mesh_centre: np.ndarray) -> ObjectSymmetry | None:
        """The group of ``declarations`` for an object with this bounding-box centre; None when none is declared."""
        if not declarations:
            return None
        tfs = symmetry_tfs(declarations, mesh_centre)
        return cls(tuple(declarations), tfs, to_mesh_frame_tfs(tfs, mesh_centre))

    def describe(self) -> dict:
        return {"declared": [s.describe() for s in self.declarations], "transforms": len(self.tfs_centred)}
