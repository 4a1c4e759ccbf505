"""Symmetries of a mesh found from its geometry, and whether its texture breaks them.

:func:`detect_symmetries` samples the surface with its colours (:func:`foundationpose.symmetry_evidence.coloured_surface`)
and tries rotation axes through the surface's centroid: the mesh frame's x, y and z axes and the principal axes of
the surface's spread (both exact, from the triangles). About each axis it asks (:func:`foundationpose.symmetry_evidence.symmetry_evidence`):

* continuous: do rotations by every angle of :attr:`DetectionConfig.continuous_test_deg` (angles no small order
  reaches) map the shape onto itself? Then the axis is ``AXIS:inf``;
* discrete: otherwise, the largest order ``n`` of :attr:`DetectionConfig.orders` whose rotation by ``360 / n`` does.

"Maps onto itself" means a geometric fit of at least :attr:`DetectionConfig.min_fit`; an axis whose best rotation
fits at least :attr:`DetectionConfig.near_fit` only is reported as a near-symmetry (the geometry breaks it: a
mug's handle). A symmetry of the shape is broken by the texture when the rotations move more than
:attr:`DetectionConfig.max_colour_mismatch` of the fitting surface onto another colour (a printed label).

:func:`real_symmetries` keeps the symmetries that are real: of the geometry, not broken by the texture. Those are
the ones an estimator cannot tell apart, the ones to declare (``load_object(symmetries=...)``) and the only ones
ADD-S may excuse. Perpendicular two-fold axes of a continuous axis are kept once (any one generates the rest
with it), so that the declarations close into a group of at most
:data:`foundationpose.symmetry.MAX_SYMMETRIES` transforms.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import trimesh

from foundationpose.errors import InputError
from foundationpose.symmetry import Symmetry, parse_symmetry, rotation_about, symmetry_tfs
from foundationpose.symmetry_evidence import ColouredSurface, coloured_surface, symmetry_evidence

__all__ = ["DetectedSymmetry", "DetectionConfig", "detect_symmetries", "real_symmetries"]

_MESH_AXES = {"x": (1.0, 0.0, 0.0), "y": (0.0, 1.0, 0.0), "z": (0.0, 0.0, 1.0)}
_DESCRIBED = ("declaration", "point_m", "geometric_fit", "colour_mismatch", "geometry_breaks", "texture_breaks")


@dataclass(frozen=True, slots=True, kw_only=True)
class DetectionConfig:
    """Settings of :func:`detect_symmetries` (the module docstring says what each decides)."""

    samples: int = 12_000
    seed: int = 0
    probes: int = 3000  # samples moved by each rotation (all of them are what they are compared with)
    tolerance_spacings: float = 2.0  # a moved sample fits within this many sample spacings of another
    orders: tuple[int, ...] = (8, 6, 5, 4, 3, 2)
    continuous_test_deg: tuple[float, ...] = (23.0, 61.0, 137.0)
    min_fit: float = 0.97
    near_fit: float = 0.8
    max_colour_mismatch: float = 0.05

    def __post_init__(self) -> None:
        if not 100 <= self.probes <= self.samples:
            raise ValueError(f"need 100 <= probes <= samples, got {self.probes} and {self.samples}")
        if not 0 < self.near_fit <= self.min_fit <= 1:
            raise ValueError(f"need 0 < near_fit <= min_fit <= 1, got {self.near_fit} and {self.min_fit}")
        if not self.orders or min(self.orders) < 2:
            raise ValueError(f"orders must be integers >= 2, got {self.orders}")


@dataclass(frozen=True, slots=True)
class DetectedSymmetry:
    """One axis's finding. declaration: ``--symmetry`` spelling (``z:inf``, ``x:2``, ``0.6,0.8,0:4``), about an
    axis through ``point`` (mesh frame, metres). geometric_fit: the smallest fit over the rotations tested (the
    share of the surface they map onto the surface). colour_mismatch: the largest share of the fitting surface
    they move onto another colour. geometry_breaks: a near-symmetry only (fit below ``min_fit``).
    texture_breaks: the colours differ where the shape fits."""

    declaration: str
    point: tuple[float, float, float]
    geometric_fit: float
    colour_mismatch: float
    geometry_breaks: bool
    texture_breaks: bool

    @property
    def real(self) -> bool:
        """A symmetry of the object as seen: neither its geometry nor its texture breaks it."""
        return not (self.geometry_breaks or self.texture_breaks)

    def symmetry(self) -> Symmetry:
        """The declaration as a :class:`~foundationpose.symmetry.Symmetry` about :attr:`point`."""
        sym = parse_symmetry(self.declaration)
        return Symmetry(sym.kind, axis=sym.axis, order=sym.order, step_deg=sym.step_deg, point=self.point)

    @classmethod
    def from_description(cls, described: dict[str, Any]) -> DetectedSymmetry:
        """The finding that :meth:`describe` wrote (e.g. kept in a stored object's ``object.json``); ValueError
        when a key is missing or of the wrong type, InputError when the declaration does not parse."""
        try:
            point = tuple(float(v) for v in described["point_m"])
            flags = (described["geometry_breaks"], described["texture_breaks"])
            found = cls(str(described["declaration"]), point, float(described["geometric_fit"]),  # type: ignore[arg-type]
                        float(described["colour_mismatch"]), bool(flags[0]), bool(flags[1]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"a described symmetry needs {', '.join(_DESCRIBED)}; got {described!r}") from exc
        if len(point) != 3 or not all(isinstance(f, bool) for f in flags):
            raise ValueError(f"a described symmetry needs a 3-vector point_m and boolean flags; got {described!r}")
        parse_symmetry(found.declaration)
        return found

    def describe(self) -> dict[str, Any]:
        return {"declaration": self.declaration, "point_m": [round(v, 6) for v in self.point],
                "geometric_fit": round(self.geometric_fit, 4), "colour_mismatch": round(self.colour_mismatch, 4),
                "geometry_breaks": self.geometry_breaks, "texture_breaks": self.texture_breaks, "real": self.real}


def _surface_moments(mesh: trimesh.Trimesh) -> tuple[np.ndarray, np.ndarray]:
    """(centroid (3,), covariance (3, 3)) of the mesh's surface, area-weighted, exact per triangle (a uniform
    point of triangle abc has mean (a + b + c) / 3 and second moment (aa' + bb' + cc' + ss') / 12, s = a + b + c)."""
    tri = np.asarray(mesh.triangles, dtype=np.float64)  # (F, 3, 3)
    area = np.asarray(mesh.area_faces, dtype=np.float64)
    total = float(area.sum())
    if not total > 0:
        raise ValueError("a mesh without surface area has no symmetries to find")
    s = tri.sum(axis=1)
    centroid = (area[:, None] * s / 3.0).sum(axis=0) / total
    second = (np.einsum("fvi,fvj->fij", tri, tri) + np.einsum("fi,fj->fij", s, s)) / 12.0
    return centroid, (area[:, None, None] * second).sum(axis=0) / total - np.outer(centroid, centroid)


def _candidate_axes(spread: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """The mesh axes, then the principal axes of the samples not already among them (sign-normalised), except
    those whose spread another axis shares within 5 % (any direction of that plane is as principal); then one
    direction perpendicular to each (named ``perpendicular``: tried only when that axis is continuous)."""
    axes = [(name, np.asarray(v)) for name, v in _MESH_AXES.items()]
    values, vectors = np.linalg.eigh(spread)
    for i, vector in enumerate(vectors.T):
        if any(abs(values[i] - values[j]) <= 0.05 * max(values[i], values[j]) for j in range(3) if j != i):
            continue
        v = vector / np.linalg.norm(vector)
        v = v if v[np.argmax(np.abs(v))] > 0 else -v
        if all(abs(float(v @ a)) < 0.995 for _, a in axes):
            axes.append((",".join(f"{c:.4f}" for c in v), v))
    for _, a in list(axes):  # a direction perpendicular to each, for the half-turns of a continuous axis
        other = np.eye(3)[int(np.argmin(np.abs(a)))]
        v = np.cross(a, other)
        axes.append(("perpendicular", v / np.linalg.norm(v)))
    return axes


def _worst(surface: ColouredSurface, axis: np.ndarray, point: np.ndarray, angles: Sequence[float],
           cfg: DetectionConfig) -> tuple[float, float]:
    """(smallest geometric fit, largest colour mismatch) over rotations by ``angles``."""
    tol = cfg.tolerance_spacings * surface.spacing_m
    evidence = [symmetry_evidence(surface, rotation_about(axis, math.radians(a), point), tol, probes=cfg.probes)
                for a in angles]
    return min(e.geometric_fit for e in evidence), max(e.colour_mismatch for e in evidence)


def _axis_order(surface: ColouredSurface, axis: np.ndarray, point: np.ndarray,
                cfg: DetectionConfig) -> tuple[float, float, float] | None:
    """(order, fit, colour mismatch) of an axis: continuous (``math.inf``) or the largest discrete order that fits
    at least ``min_fit``; else its best-fitting near-symmetry (fit at least ``near_fit``); None when neither."""
    tested = [(math.inf, *_worst(surface, axis, point, cfg.continuous_test_deg, cfg))]
    if tested[0][1] >= cfg.min_fit:
        return tested[0]
    for n in sorted(cfg.orders, reverse=True):
        tested.append((float(n), *_worst(surface, axis, point, [360.0 * k / n for k in range(1, n)], cfg)))
        if tested[-1][1] >= cfg.min_fit:
            return tested[-1]
    near = max(tested, key=lambda t: t[1])
    return near if near[1] >= cfg.near_fit else None


def detect_symmetries(mesh: trimesh.Trimesh, config: DetectionConfig | None = None) -> tuple[DetectedSymmetry, ...]:
    """The symmetries and near-symmetries of ``mesh`` (its own frame, metres): one per candidate axis that has
    one, continuous axes first, then by order."""
    cfg = config or DetectionConfig()
    point, spread = _surface_moments(mesh)
    surface = coloured_surface(mesh, cfg.samples, cfg.seed)
    found: list[tuple[float, DetectedSymmetry]] = []
    candidates = _candidate_axes(spread)
    for name, axis in candidates:
        if name == "perpendicular":  # a continuous axis's half-turn axes: one stands for all
            if not any(d.declaration.endswith(":inf") and abs(float(np.dot(d.symmetry().axis, axis))) < 1e-3
                       for _, d in found):
                continue
            if any(d.declaration.endswith(":2") and abs(float(np.dot(d.symmetry().axis, axis))) < 1e-3
                   and not d.geometry_breaks for _, d in found):
                continue
            name = ",".join(f"{c:.4f}" for c in axis)
        order = _axis_order(surface, axis, point, cfg)
        if order is None:
            continue
        n, fit, mismatch = order
        if math.isinf(n):  # the texture judged over a full turn too, in 60-degree steps
            mismatch = max(mismatch, _worst(surface, axis, point, [60.0 * k for k in range(1, 6)], cfg)[1])
        found.append((-n, DetectedSymmetry(f"{name}:{'inf' if math.isinf(n) else int(n)}",
                                           tuple(float(c) for c in point), fit, mismatch, fit < cfg.min_fit,
                                           mismatch > cfg.max_colour_mismatch)))
    return tuple(d for _, d in sorted(found, key=lambda item: item[0]))


def real_symmetries(detected: Sequence[DetectedSymmetry]) -> list[Symmetry]:
    """The real ones of ``detected`` as declarations, in order, each kept only when the group of those kept so far
    and it stays within :data:`~foundationpose.symmetry.MAX_SYMMETRIES` transforms (a continuous axis's
    perpendicular two-fold axes: the first one generates the others with it)."""
    chosen: list[Symmetry] = []
    for d in detected:
        if not d.real:
            continue
        trial = [*chosen, d.symmetry()]
        try:
            size = len(symmetry_tfs(trial, np.zeros(3)))  # the axis points are given: any centre will do
        except InputError:
            continue
        if size > (len(symmetry_tfs(chosen, np.zeros(3))) if chosen else 1):  # else the group holds it already
            chosen = trial
    return chosen
