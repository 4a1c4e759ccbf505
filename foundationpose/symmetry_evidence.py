"""How well a rigid transform maps a textured mesh onto itself: in shape, and in colour.

:func:`coloured_surface` draws points uniformly over a mesh's surface (trimesh's area-weighted sampler, seeded)
with the colour the mesh shows there (:func:`surface_colours`: texture lookup through the UVs, or face colours).
:func:`symmetry_evidence` moves those points by a candidate symmetry and asks, for each moved point, for the
nearest original sample:

* ``geometric_fit``: the share of moved points within ``distance_tol_m`` of a sample (1.0 for an exact symmetry of
  the shape; the surface the transform does not map onto itself shows as the rest);
* ``colour_mismatch``: among the points that fit, the share whose colour differs from that nearest sample's by
  more than ``colour_tol`` (largest channel difference, colours in [0, 1]): 0 for a texture the transform leaves
  unchanged, the printed area it moves elsewhere otherwise.

A transform is a symmetry of the geometry when nearly every point fits; the texture breaks it when a clear share of
the fitting points changes colour.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import trimesh
from scipy.spatial import cKDTree

from foundationpose.mesh import material_image

__all__ = ["ColouredSurface", "SymmetryEvidence", "coloured_surface", "surface_colours", "symmetry_evidence"]


@dataclass(frozen=True, slots=True, eq=False)
class ColouredSurface:
    """points: (P, 3) float64 metres (the mesh's frame). colours: (P, 3) float64 RGB in [0, 1].
    spacing_m: the mean distance between neighbouring samples (``sqrt(area / P)``)."""

    points: np.ndarray
    colours: np.ndarray
    spacing_m: float
    tree: cKDTree


@dataclass(frozen=True, slots=True)
class SymmetryEvidence:
    """The module docstring's two shares for one transform."""

    geometric_fit: float
    colour_mismatch: float


def surface_colours(mesh: trimesh.Trimesh, points: np.ndarray, face_index: np.ndarray) -> np.ndarray:
    """(P, 3) RGB in [0, 1] that ``mesh`` shows at ``points`` on faces ``face_index``: its texture image through
    the UVs (simple or PBR material), else its face colours (trimesh's default grey when it has none)."""
    visual = mesh.visual
    if isinstance(visual, trimesh.visual.TextureVisuals):
        image = material_image(visual.material)
        if image is not None and visual.uv is not None:
            corners = np.asarray(mesh.faces)[face_index]
            bary = trimesh.triangles.points_to_barycentric(np.asarray(mesh.triangles)[face_index], points)
            uv = (np.asarray(visual.uv, dtype=np.float64)[corners] * bary[:, :, None]).sum(axis=1)
            return np.asarray(trimesh.visual.color.uv_to_color(uv, image), dtype=np.float64)[:, :3] / 255.0
        visual = visual.to_color()
    return np.asarray(visual.face_colors, dtype=np.float64)[face_index, :3] / 255.0


def coloured_surface(mesh: trimesh.Trimesh, count: int = 20_000, seed: int = 0) -> ColouredSurface:
    """``count`` seeded surface samples of ``mesh`` with their colours (:func:`surface_colours`)."""
    points, face_index = trimesh.sample.sample_surface(mesh, count, seed=seed)
    pts = np.asarray(points, dtype=np.float64)
    colours = surface_colours(mesh, pts, np.asarray(face_index))
    return ColouredSurface(pts, colours, float(np.sqrt(mesh.area / count)), cKDTree(pts))


def symmetry_evidence(surface: ColouredSurface, transform: np.ndarray, distance_tol_m: float | None = None,
                      colour_tol: float = 0.15, probes: int | None = None) -> SymmetryEvidence:
    """The shares of the module docstring for ``transform`` (4, 4) in the surface's frame. distance_tol_m: None =
    three sample spacings. probes: move only the first ``probes`` samples (a uniform subset: the samples are
    drawn in random order), None = all."""
    tf = np.asarray(transform, dtype=np.float64)
    if tf.shape != (4, 4):
        raise ValueError(f"transform must be (4, 4), got {tf.shape}")
    tol = 3.0 * surface.spacing_m if distance_tol_m is None else distance_tol_m
    points, colours = surface.points[:probes], surface.colours[:probes]
    distance, nearest = surface.tree.query(points @ tf[:3, :3].T + tf[:3, 3])
    fits = distance <= tol
    if not fits.any():
        return SymmetryEvidence(0.0, 0.0)
    differs = np.abs(colours[fits] - surface.colours[nearest[fits]]).max(axis=1) > colour_tol
    return SymmetryEvidence(float(fits.mean()), float(differs.mean()))
