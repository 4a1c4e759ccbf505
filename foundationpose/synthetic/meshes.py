"""Small procedural test objects (no downloads): asymmetric prisms in metres.

Shapes: ``"L"`` (the default and the bundled demo object, an L-shaped block) and ``"tee"`` (a taller T with
its stem off-centre; a second, differently shaped object for training and evaluation). Neither has a
rotational or mirror symmetry and the mesh-frame origin is off the bounding-box centre, so frame mistakes
(``mesh`` vs ``centred``) show up in tests. Every planar face has its own vertices (flat normals, like a
UV-split box) and its own cell of the texture atlas.
"""

from __future__ import annotations

import numpy as np
import trimesh
from PIL import Image

__all__ = ["PROCEDURAL_KINDS", "PROCEDURAL_SHAPES", "make_procedural_mesh", "procedural_texture"]

PROCEDURAL_KINDS = ("textured_asym", "vertex_color_asym", "plain_asym")
PROCEDURAL_SHAPES = ("L", "tee")

# L-shaped footprint (counter-clockwise, metres): a 12 x 3.5 cm leg along x and a 4 x 8 cm leg along y.
_FOOTPRINT_XY = np.array(
    [[0.0, 0.0], [0.12, 0.0], [0.12, 0.035], [0.04, 0.035], [0.04, 0.08], [0.0, 0.08]], dtype=np.float64
)
_FOOTPRINT_TRIANGLES = np.array([[0, 1, 2], [0, 2, 3], [0, 3, 4], [0, 4, 5]])  # inside the L, CCW
_HEIGHT_M = 0.05
# T-shaped footprint: a 10 x 3 cm bar on a 2.5 x 6 cm stem that sits off-centre (no mirror symmetry), 7 cm tall.
_TEE_XY = np.array(
    [[0.02, 0.0], [0.045, 0.0], [0.045, 0.06], [0.10, 0.06], [0.10, 0.09], [0.0, 0.09], [0.0, 0.06], [0.02, 0.06]],
    dtype=np.float64,
)
_TEE_TRIANGLES = np.array([[0, 1, 2], [0, 2, 7], [5, 6, 7], [5, 7, 2], [5, 2, 3], [5, 3, 4]])  # CCW
_TEE_HEIGHT_M = 0.07
_SHAPES = {"L": (_FOOTPRINT_XY, _FOOTPRINT_TRIANGLES, _HEIGHT_M, 3), "tee": (_TEE_XY, _TEE_TRIANGLES, _TEE_HEIGHT_M, 4)}
_ORIGIN_OFFSET_M = np.array([0.013, -0.021, 0.007])  # mesh origin is deliberately not the AABB centre

_ATLAS_CELLS = 3  # 3 x 3 atlas cells, 8 used (2 caps + 6 sides)
_CELL_PX = 128
_FACE_COLOURS_U8 = np.array(
    [
        [220, 40, 40],
        [40, 170, 60],
        [40, 80, 220],
        [230, 190, 30],
        [200, 60, 200],
        [30, 190, 200],
        [240, 130, 30],
        [120, 80, 40],
        [90, 90, 90],
        [160, 220, 90],  # cells 9-15: only the 4 x 4 atlas of the tee uses them
        [250, 160, 190],
        [60, 60, 140],
        [200, 200, 120],
        [20, 110, 110],
        [150, 30, 90],
        [110, 150, 230],
    ],
    dtype=np.uint8,
)


def procedural_texture(cells: int = _ATLAS_CELLS) -> np.ndarray:
    """(128 cells, 128 cells, 3) uint8 RGB atlas (default 384 x 384): per cell a distinct colour x checker (16 px)
    x left-to-right ramp, with a dark bar along the cell's top edge (so every face's orientation is visible)."""
    side = cells * _CELL_PX
    rows, cols = np.mgrid[0:side, 0:side]
    cell = ((rows // _CELL_PX) * cells + cols // _CELL_PX) % len(_FACE_COLOURS_U8)
    local_r, local_c = rows % _CELL_PX, cols % _CELL_PX
    checker = np.where(((local_r // 16) + (local_c // 16)) % 2 == 0, 1.0, 0.55)
    ramp = 0.55 + 0.45 * local_c / (_CELL_PX - 1)
    bar = np.where(local_r < 12, 0.15, 1.0)
    shade = (checker * ramp * bar)[..., None]
    image = _FACE_COLOURS_U8[cell].astype(np.float64) * shade
    return np.clip(np.round(image), 0, 255).astype(np.uint8)


def _planar_faces(
    footprint: np.ndarray = _FOOTPRINT_XY, triangles: np.ndarray = _FOOTPRINT_TRIANGLES, height: float = _HEIGHT_M
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Planar faces of a prism: (corners (k, 3), triangles (m, 3) local, in-plane 2-D coords (k, 2))."""
    faces = []
    bottom = np.column_stack([footprint, np.zeros(len(footprint))])
    top = np.column_stack([footprint, np.full(len(footprint), height)])
    faces.append((top, triangles.copy(), footprint.copy()))  # +z cap, CCW from above
    faces.append((bottom, triangles[:, ::-1].copy(), footprint * [-1.0, 1.0]))  # -z cap
    n = len(footprint)
    for i in range(n):
        a, b = footprint[i], footprint[(i + 1) % n]
        corners = np.array([[*a, 0.0], [*b, 0.0], [*b, height], [*a, height]])
        length = float(np.linalg.norm(b - a))
        local = np.array([[0.0, 0.0], [length, 0.0], [length, height], [0.0, height]])
        faces.append((corners, np.array([[0, 1, 2], [0, 2, 3]]), local))  # outward: edge x up
    return faces


def make_procedural_mesh(kind: str = "textured_asym", shape: str = "L") -> trimesh.Trimesh:
    """An asymmetric prism in metres, as a ``trimesh.Trimesh``.

    kind: ``"textured_asym"`` (UV texture atlas from :func:`procedural_texture`),
    ``"vertex_color_asym"`` (one distinct colour per planar face, as vertex colours) or
    ``"plain_asym"`` (no colour: trimesh's default grey). shape: ``"L"`` (12 x 8 x 5 cm; 36 vertices,
    20 faces) or ``"tee"`` (10 x 9 x 7 cm; 48 vertices, 28 faces). Outward-facing triangles.
    """
    if kind not in PROCEDURAL_KINDS:
        raise ValueError(f"kind must be one of {PROCEDURAL_KINDS}, got {kind!r}")
    if shape not in _SHAPES:
        raise ValueError(f"shape must be one of {PROCEDURAL_SHAPES}, got {shape!r}")
    footprint, triangles, height, cells = _SHAPES[shape]
    verts, tris, uvs, colours = [], [], [], []
    margin = 0.04  # fraction of a cell left free on each side (keeps bilinear lookups inside the cell)
    for index, (corners, local_tris, local_2d) in enumerate(_planar_faces(footprint, triangles, height)):
        base = sum(len(v) for v in verts)
        verts.append(corners + _ORIGIN_OFFSET_M)
        tris.append(local_tris + base)
        lo, hi = local_2d.min(axis=0), local_2d.max(axis=0)
        unit = (local_2d - lo) / (hi - lo)  # (k, 2) in [0, 1]
        row, col = divmod(index, cells)
        u = (col + margin + unit[:, 0] * (1 - 2 * margin)) / cells
        v = 1.0 - (row + margin + (1.0 - unit[:, 1]) * (1 - 2 * margin)) / cells  # v up (OBJ)
        uvs.append(np.column_stack([u, v]))
        colours.append(np.tile(_FACE_COLOURS_U8[index % len(_FACE_COLOURS_U8)], (len(corners), 1)))
    vertices = np.concatenate(verts)
    faces = np.concatenate(tris)
    mesh = trimesh.Trimesh(vertices=vertices, faces=faces, process=False)
    if kind == "textured_asym":
        image = Image.fromarray(procedural_texture(cells), mode="RGB")
        mesh.visual = trimesh.visual.TextureVisuals(uv=np.concatenate(uvs), image=image)
    elif kind == "vertex_color_asym":
        mesh.visual = trimesh.visual.ColorVisuals(mesh, vertex_colors=np.concatenate(colours))
    mesh.metadata["name"] = f"procedural_{kind}" if shape == "L" else f"procedural_{shape}_{kind}"
    return mesh
