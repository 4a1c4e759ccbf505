"""UV-mapped building blocks of the procedural object suite (:mod:`foundationpose.synthetic.objects`).

Each primitive is a :class:`Part`: vertices in metres, outward-wound triangles and per-vertex texture coordinates
in the unit square of the part's own texture cell. Two primitives make every object:

* :func:`prism`: a footprint polygon (star-shaped about its centroid) extruded along z, with an optional
  different top footprint (a frustum, a tapered sole) and caps. Layout of its cell: the side band spans
  ``v`` in [:data:`SIDE_V0`, 1] (bottom edge to top edge) with ``u`` the fraction of the perimeter from the
  footprint's first vertex (counter-clockwise seen from +z); the bottom cap is a disc centred at ``(0.25, 0.13)``
  and the top cap one at ``(0.75, 0.13)``, both of radius :data:`CAP_RADIUS_UV`. ``smooth=False`` gives every side
  its own vertices (flat normals, sharp edges: boxes); ``smooth=True`` shares them between neighbours (cylinders).
* :func:`tube_arc`: a tube along a circular arc (a mug's handle), ``u`` along the arc and ``v`` around the tube.

:func:`transformed` places a part with a rigid transform. Triangles are oriented outward by construction
(:func:`_orient` flips any whose normal points against the primitive's outward direction).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["CAP_RADIUS_UV", "SIDE_V0", "Part", "circle", "perimeter_fractions", "prism", "rectangle", "rotation",
           "transformed", "tube_arc"]

SIDE_V0 = 0.3  # the side band of a prism's cell starts here (v); the caps lie below it
CAP_RADIUS_UV = 0.12
_CAP_CENTRES_UV = ((0.25, 0.13), (0.75, 0.13))  # bottom, top


@dataclass(frozen=True, slots=True, eq=False)
class Part:
    """One piece of an object. vertices: (V, 3) float64 metres. faces: (F, 3) int64, outward winding.
    uv: (V, 2) float64 in [0, 1]^2, coordinates in the part's own texture cell (``v`` up)."""

    vertices: np.ndarray
    faces: np.ndarray
    uv: np.ndarray


def circle(radius: float, segments: int = 48, centre: tuple[float, float] = (0.0, 0.0),
           scale: tuple[float, float] = (1.0, 1.0)) -> np.ndarray:
    """(segments, 2) counter-clockwise points of a circle (an ellipse with ``scale``), the first on +x."""
    angle = 2.0 * np.pi * np.arange(segments) / segments
    return np.column_stack([centre[0] + radius * scale[0] * np.cos(angle), centre[1] + radius * scale[1] * np.sin(angle)])


def rectangle(width: float, depth: float, centre: tuple[float, float] = (0.0, 0.0)) -> np.ndarray:
    """(4, 2) counter-clockwise corners of a ``width`` (x) by ``depth`` (y) rectangle, the first at (+x, -y):
    the perimeter starts with the +x side, then +y, -x and -y."""
    cx, cy = centre
    w, d = width / 2.0, depth / 2.0
    return np.array([[cx + w, cy - d], [cx + w, cy + d], [cx - w, cy + d], [cx - w, cy - d]], dtype=np.float64)


def rotation(axis: str, degrees: float) -> np.ndarray:
    """(4, 4) rotation about the x, y or z axis through the origin."""
    c, s = math.cos(math.radians(degrees)), math.sin(math.radians(degrees))
    i, j = {"x": (1, 2), "y": (2, 0), "z": (0, 1)}[axis]
    tf = np.eye(4)
    tf[i, i], tf[i, j], tf[j, i], tf[j, j] = c, -s, s, c
    return tf


def transformed(part: Part, tf: np.ndarray) -> Part:
    """The part moved by a rigid (4, 4) transform (its texture coordinates unchanged)."""
    tf = np.asarray(tf, dtype=np.float64)
    return Part(part.vertices @ tf[:3, :3].T + tf[:3, 3], part.faces, part.uv)


def _orient(vertices: np.ndarray, faces: np.ndarray, outward: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """faces with every triangle whose normal points against ``outward(face centres)`` flipped."""
    tri = vertices[faces]
    normals = np.cross(tri[:, 1] - tri[:, 0], tri[:, 2] - tri[:, 0])
    flip = (normals * outward(tri.mean(axis=1))).sum(axis=1) < 0
    out = faces.copy()
    out[flip] = out[flip][:, ::-1]
    return out


def _grid_faces(rows: int, cols: int, offset: int = 0) -> np.ndarray:
    """Two triangles per cell of a (rows + 1) x (cols + 1) vertex grid, row-major."""
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    a = (r * (cols + 1) + c).ravel() + offset
    b, d = a + 1, a + cols + 1
    return np.concatenate([np.column_stack([a, b, d + 1]), np.column_stack([a, d + 1, d])])


def perimeter_fractions(bottom: np.ndarray, top: np.ndarray | None = None) -> np.ndarray:
    """(N + 1,) the side band's ``u`` at each footprint vertex, the first repeated at the end with ``u = 1``:
    the perimeter fraction of the mid-height footprint. Side ``i`` of a prism spans ``u`` in [f[i], f[i + 1]]."""
    bottom = np.asarray(bottom, dtype=np.float64)
    mid = bottom if top is None else (bottom + np.asarray(top, dtype=np.float64)) / 2.0
    edge = np.linalg.norm(np.roll(mid, -1, axis=0) - mid, axis=1)
    return np.concatenate([[0.0], np.cumsum(edge) / edge.sum()])


def prism(bottom: np.ndarray, z0: float, z1: float, top: np.ndarray | None = None, *, smooth: bool = True,
          caps: tuple[bool, bool] = (True, True)) -> Part:
    """A footprint extruded from ``z0`` to ``z1`` (metres); ``top`` (same vertex count) tapers it. The layout of
    its texture cell is the module docstring's."""
    bottom = np.asarray(bottom, dtype=np.float64)
    top = bottom if top is None else np.asarray(top, dtype=np.float64)
    if bottom.shape != top.shape or bottom.ndim != 2 or bottom.shape[1] != 2 or len(bottom) < 3:
        raise ValueError(f"footprints must be the same (N >= 3, 2) shape, got {bottom.shape} and {top.shape}")
    n = len(bottom)
    u_at = perimeter_fractions(bottom, top)
    verts, faces, uvs = [], [], []
    if smooth:  # one ring per end, the seam vertex repeated with u = 1
        idx = np.arange(n + 1) % n
        ring0 = np.column_stack([bottom[idx], np.full(n + 1, z0)])
        ring1 = np.column_stack([top[idx], np.full(n + 1, z1)])
        verts.append(np.concatenate([ring0, ring1]))
        uvs.append(np.concatenate([np.column_stack([u_at, np.full(n + 1, SIDE_V0)]),
                                   np.column_stack([u_at, np.ones(n + 1)])]))
        faces.append(_grid_faces(1, n))
    else:  # four vertices per side
        for i in range(n):
            j = (i + 1) % n
            verts.append(np.array([[*bottom[i], z0], [*bottom[j], z0], [*top[j], z1], [*top[i], z1]]))
            uvs.append(np.array([[u_at[i], SIDE_V0], [u_at[i + 1], SIDE_V0], [u_at[i + 1], 1.0], [u_at[i], 1.0]]))
            faces.append(np.array([[0, 1, 2], [0, 2, 3]]) + 4 * i)
    side_count = sum(len(v) for v in verts)
    side_v = np.concatenate(verts)
    centroid = np.concatenate([bottom, top]).mean(axis=0)

    def radial(points: np.ndarray) -> np.ndarray:
        out = points.copy()
        out[:, :2] -= centroid
        out[:, 2] = 0.0
        return out

    side_faces = _orient(side_v, np.concatenate(faces), radial)
    all_v, all_f, all_uv = [side_v], [side_faces], [np.concatenate(uvs)]
    count = side_count
    for end, (footprint, z, wanted) in enumerate(((bottom, z0, caps[0]), (top, z1, caps[1]))):
        if not wanted:
            continue
        centre = footprint.mean(axis=0)
        rel = footprint - centre
        reach = float(np.linalg.norm(rel, axis=1).max())
        cap_v = np.concatenate([[[*centre, z]], np.column_stack([footprint, np.full(n, z)])])
        cu, cv = _CAP_CENTRES_UV[end]
        cap_uv = np.concatenate([[[cu, cv]], np.column_stack([cu + CAP_RADIUS_UV * rel[:, 0] / reach,
                                                              cv + CAP_RADIUS_UV * rel[:, 1] / reach])])
        fan = np.column_stack([np.zeros(n, np.int64), 1 + np.arange(n), 1 + (np.arange(n) + 1) % n])
        sign = -1.0 if end == 0 else 1.0
        fan = _orient(cap_v, fan, lambda p, s=sign: np.tile([0.0, 0.0, s], (len(p), 1)))
        all_v.append(cap_v)
        all_f.append(fan + count)
        all_uv.append(cap_uv)
        count += len(cap_v)
    return Part(np.concatenate(all_v), np.concatenate(all_f).astype(np.int64), np.concatenate(all_uv))


def tube_arc(arc_radius: float, tube_radius: float, start_deg: float, end_deg: float, *, along: int = 16,
             around: int = 12, tube_scale: tuple[float, float] = (1.0, 1.0)) -> Part:
    """A tube of (elliptic, ``tube_scale`` in-plane / out-of-plane) cross-section along an arc of radius
    ``arc_radius`` in the xz-plane about the origin, from ``start_deg`` to ``end_deg`` (0 = +x, 90 = +z). Open
    ends (they sit inside the body a handle joins)."""
    theta = np.radians(np.linspace(start_deg, end_deg, along + 1))
    phi = 2.0 * np.pi * np.arange(around + 1) / around
    t, p = np.meshgrid(theta, phi, indexing="ij")  # (along + 1, around + 1)
    radial_dir = np.stack([np.cos(t), np.zeros_like(t), np.sin(t)], axis=-1)
    centre = arc_radius * radial_dir
    offset = (tube_radius * tube_scale[0] * np.cos(p))[..., None] * radial_dir
    offset[..., 1] += tube_radius * tube_scale[1] * np.sin(p)
    verts = (centre + offset).reshape(-1, 3)
    uv = np.column_stack([np.repeat(np.linspace(0.0, 1.0, along + 1), around + 1),
                          np.tile(SIDE_V0 + (1.0 - SIDE_V0) * phi / (2.0 * np.pi), along + 1)])

    def from_centre_line(points: np.ndarray) -> np.ndarray:
        angle = np.arctan2(points[:, 2], points[:, 0])
        line = arc_radius * np.column_stack([np.cos(angle), np.zeros(len(points)), np.sin(angle)])
        return points - line

    faces = _orient(verts, _grid_faces(along, around), from_centre_line)
    return Part(verts, faces.astype(np.int64), uv)
