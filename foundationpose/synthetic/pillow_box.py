"""A procedural textured test object: a pillowed box with six differently bulged faces (no symmetry).

Used by the renderer tests and by ``python -m foundationpose.bench.render_parity``; needs neither trimesh nor files.
Each box side is an ``n x n`` grid of quads (``12 n^2`` triangles, ``6 (n+1)^2`` vertices: vertices are split
per side, like trimesh splits them on UV seams) mapped to its own cell of a 3 x 2 texture atlas. Normals are
the corner-angle-weighted averages of unit face normals (trimesh's rule, spec §1.1), computed here.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["pillow_box_arrays", "pillow_box", "angle_weighted_normals", "atlas_texture"]

_SIDES = (  # (normal axis, sign, in-plane axis a, in-plane axis b) with a x b = sign * e_normal (outward winding)
    (0, 1.0, 1, 2), (0, -1.0, 2, 1), (1, 1.0, 2, 0), (1, -1.0, 0, 2), (2, 1.0, 0, 1), (2, -1.0, 1, 0),
)
_BULGE = (0.22, 0.05, 0.15, 0.0, 0.30, 0.10)  # outward push of each side's centre, fraction of the half extent


def angle_weighted_normals(verts: Tensor, faces: Tensor) -> Tensor:
    """(V, 3) float32 unit vertex normals: sum over incident faces of unit face normal x corner angle."""
    v = verts.to(torch.float64)
    f = faces.to(torch.int64)
    p0, p1, p2 = v[f[:, 0]], v[f[:, 1]], v[f[:, 2]]
    fn = torch.linalg.cross(p1 - p0, p2 - p0)
    fn = fn / fn.norm(dim=1, keepdim=True).clamp_min(1e-30)
    normals = torch.zeros_like(v)
    for k in range(3):
        a, b, c = (p0, p1, p2)[k], (p0, p1, p2)[(k + 1) % 3], (p0, p1, p2)[(k + 2) % 3]
        e1, e2 = b - a, c - a
        cos = (e1 * e2).sum(1) / (e1.norm(dim=1) * e2.norm(dim=1)).clamp_min(1e-30)
        angle = torch.arccos(cos.clamp(-1.0, 1.0))
        normals.index_add_(0, f[:, k], fn * angle[:, None])
    return (normals / normals.norm(dim=1, keepdim=True).clamp_min(1e-30)).to(torch.float32)


def atlas_texture(height: int = 96, width: int = 144) -> Tensor:
    """(height, width, 3) float32 in [0.05, 0.75]: a 3 x 2 atlas, one hue per cell, checker + gradients."""
    rows = torch.arange(height, dtype=torch.float64)[:, None].expand(height, width)
    cols = torch.arange(width, dtype=torch.float64)[None, :].expand(height, width)
    cell = (rows * 2 // height) * 3 + (cols * 3 // width)  # 0..5
    hue = cell / 6.0 * 2.0 * math.pi
    checker = ((rows // 6 + cols // 6) % 2) * 0.25
    base = torch.stack([torch.cos(hue), torch.cos(hue - 2.1), torch.cos(hue + 2.1)], dim=-1) * 0.2 + 0.35
    grad = torch.stack([cols / width, rows / height, (cols + rows) / (width + height)], dim=-1) * 0.15
    return (base + checker[..., None] + grad).clamp(0.05, 0.75).to(torch.float32)


def pillow_box_arrays(
    extents_m: tuple[float, float, float] = (0.10, 0.07, 0.045),
    subdivisions: int = 9,
    texture_hw: tuple[int, int] = (96, 144),
    device: str | torch.device = "cpu",
) -> dict[str, Tensor | None]:
    """Tensors of the test object, with the field names of ``foundationpose.mesh.MeshTensors``.

    Returns verts (V, 3) float32 centred on the AABB centre, faces (F, 3) int32, normals (V, 3) float32,
    uv (V, 2) float32 (rows already top-down: ``v' = 1 - v``), uv_faces (F, 3) int32 (= faces),
    texture (Ht, Wt, 3) float32 in [0, 1], vertex_colors (V, 3) float32 (a smooth colour field, for tests
    that switch the texture off).
    """
    n = subdivisions
    half = torch.tensor(extents_m, dtype=torch.float64) / 2.0
    g = torch.linspace(-1.0, 1.0, n + 1, dtype=torch.float64)
    ga, gb = torch.meshgrid(g, g, indexing="ij")  # (n+1, n+1)
    verts, uvs, faces = [], [], []
    margin = 0.04
    for side, (axis, sign, a, b) in enumerate(_SIDES):
        q = torch.zeros((n + 1, n + 1, 3), dtype=torch.float64)
        q[..., axis] = sign
        q[..., a] = ga
        q[..., b] = gb
        push = 1.0 + _BULGE[side] * torch.cos(ga * math.pi / 2) * torch.cos(gb * math.pi / 2)
        q[..., axis] = q[..., axis] * push
        verts.append((q * half).reshape(-1, 3))
        cell_r, cell_c = divmod(side, 3)
        u = (cell_c + margin + (ga + 1) / 2 * (1 - 2 * margin)) / 3.0
        v = (cell_r + margin + (gb + 1) / 2 * (1 - 2 * margin)) / 2.0
        uvs.append(torch.stack([u, v], dim=-1).reshape(-1, 2))
        idx = torch.arange((n + 1) * (n + 1)).reshape(n + 1, n + 1) + side * (n + 1) * (n + 1)
        i00, i10, i01, i11 = idx[:-1, :-1], idx[1:, :-1], idx[:-1, 1:], idx[1:, 1:]
        quads = torch.stack([i00, i10, i11, i01], dim=-1).reshape(-1, 4)  # counter-clockwise around +normal
        faces.append(torch.cat([quads[:, [0, 1, 2]], quads[:, [0, 2, 3]]]))
    v_all = torch.cat(verts)
    v_all = v_all - (v_all.amin(0) + v_all.amax(0)) / 2  # AABB centre at the origin (the "centred" frame)
    f_all = torch.cat(faces).to(torch.int32)
    normals = angle_weighted_normals(v_all, f_all)
    colours = (0.25 + 0.5 * (v_all / (2 * half.max()) + 0.5)).clamp(0.0, 1.0)
    dev = torch.device(device)
    return {
        "verts": v_all.to(torch.float32).to(dev),
        "faces": f_all.to(dev),
        "normals": normals.to(dev),
        "uv": torch.cat(uvs).to(torch.float32).to(dev),
        "uv_faces": f_all.clone().to(dev),
        "texture": atlas_texture(*texture_hw).to(dev),
        "vertex_colors": colours.to(torch.float32).to(dev),
    }


def pillow_box(device: str | torch.device = "cpu", **kwargs: object):  # -> MeshTensors
    """The test object as a ``foundationpose.mesh.MeshTensors`` (textured; keyword arguments as above)."""
    from foundationpose.mesh import MeshTensors

    return MeshTensors(**pillow_box_arrays(device=device, **kwargs))  # type: ignore[arg-type]
