"""Points drawn uniformly over a mesh's surface, with the normals of the faces they lie on.

Used by the per-frame validity measurements (:mod:`foundationpose.validity`: which parts of the object the camera
should see at a pose) and by the ADD / ADD-S metrics of :mod:`foundationpose.evaluate` (distinct vertices weight a
mesh by its triangulation: the L-block has 12 distinct corners and nothing in between).

Sampling is area-weighted: a face is drawn with probability proportional to its area, then a point uniformly
inside it (``sqrt`` trick of Osada et al. 2002, "Shape distributions", §4.2). Every draw comes from
``numpy.random.default_rng(seed)``, so a seed gives the same points on every machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from foundationpose.errors import InputError

__all__ = ["SurfaceSamples", "sample_surface"]


@dataclass(frozen=True, slots=True, eq=False)
class SurfaceSamples:
    """points: (P, 3) float64 metres, in the frame of the vertices given. normals: (P, 3) float64 unit outward
    normals of the faces the points lie on (the faces' winding decides "outward"). count, seed: how they were drawn."""

    points: np.ndarray
    normals: np.ndarray
    count: int
    seed: int

    def describe(self) -> dict:
        """What an evaluation report says about its model points."""
        return {"kind": "uniform surface samples (area-weighted)", "count": self.count, "seed": self.seed}


def sample_surface(vertices: np.ndarray, faces: np.ndarray, count: int, seed: int = 0) -> SurfaceSamples:
    """``count`` points uniformly distributed over the triangles' area.

    vertices: (V, 3) float metres (any frame; the points come out in it). faces: (F, 3) int vertex indices.
    Degenerate (zero-area) faces are never drawn. Raises InputError for a mesh without area.
    """
    verts = np.asarray(vertices, dtype=np.float64)
    tris = np.asarray(faces, dtype=np.int64)
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if verts.ndim != 2 or verts.shape[1] != 3 or tris.ndim != 2 or tris.shape[1] != 3 or len(tris) == 0:
        raise InputError("mesh", "(V, 3) vertices and (F, 3) faces, F >= 1", f"{verts.shape} and {tris.shape}")
    a, b, c = verts[tris[:, 0]], verts[tris[:, 1]], verts[tris[:, 2]]  # (F, 3) each
    cross = np.cross(b - a, c - a)  # (F, 3), |cross| = 2 area
    double_area = np.linalg.norm(cross, axis=1)
    total = double_area.sum()
    if not total > 0:
        raise InputError("mesh", "triangles with a non-zero total area", "a mesh without area")
    rng = np.random.default_rng(seed)
    face = rng.choice(len(tris), size=count, p=double_area / total)  # (P,)
    r1, r2 = rng.random(count), rng.random(count)
    s = np.sqrt(r1)
    wa, wb, wc = 1.0 - s, s * (1.0 - r2), s * r2  # barycentric weights, uniform over the triangle
    points = wa[:, None] * a[face] + wb[:, None] * b[face] + wc[:, None] * c[face]
    normals = cross[face] / double_area[face][:, None]
    return SurfaceSamples(points=points, normals=normals, count=int(count), seed=int(seed))
