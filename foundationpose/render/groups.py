"""Several meshes in one render: a :class:`MeshGroup` and the rows that say which mesh each pose renders.

``Renderer.render`` takes, in place of one mesh, a :class:`RowMeshes`: the group and a per-row mesh index; row i
renders pose i of mesh ``row_mesh[i]`` only (its own triangles, its colour source), exactly as a render of that mesh
alone would. The Triton rasteriser renders every row in one pass over the group's packed tables
(:class:`PackedMeshes`: the meshes' vertices, normals, faces, colours and textures concatenated, with per-mesh
face ranges and colour sources; grids sized by the largest mesh), so a group renders with the launches of one mesh
and can be captured in a CUDA graph (``row_mesh`` is device data). The other backends (the CPU rasteriser,
nvdiffrast) render the rows of each mesh as one sub-batch and scatter them into the output
(:meth:`foundationpose.render._core.RendererCore._render_split`): the readable reference twin, which reads the row
indices on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from foundationpose.mesh import MeshTensors

__all__ = ["ALBEDO_TEXTURE", "ALBEDO_UNIFORM", "ALBEDO_VERTEX", "MeshGroup", "PackedMeshes", "RowMeshes",
           "albedo_source"]

ALBEDO_UNIFORM, ALBEDO_VERTEX, ALBEDO_TEXTURE = 0, 1, 2  # the Triton resolve kernel's colour sources


def albedo_source(mesh: MeshTensors) -> str:
    """Which colour the mesh renders with: ``"texture"``, ``"vertex_colors"`` or ``"uniform"`` (grey 0.4)."""
    if mesh.uv is not None and mesh.texture is not None:
        return "texture"
    if mesh.vertex_colors is not None:
        return "vertex_colors"
    return "uniform"


@dataclass(frozen=True, slots=True, eq=False)
class PackedMeshes:
    """The group's meshes in one set of tables on one device (what the Triton kernels read).

    verts, normals: (sum V, 3) float32. faces: (sum F, 3) int32 indices into ``verts`` (offset per mesh).
    face_start, face_count: (K,) int32 each mesh's face range. max_faces: the largest face count (the raster grid).
    vertex_colors: (sum V, 3) float32 (0 for meshes without). uv: (sum UV, 2) float32 and uv_faces: (sum F, 3)
    int32 indices into ``uv`` (a mesh without texture keeps its faces' rows pointing at row 0). texture: flat
    float32 texels of every textured mesh; tex_offset: (K,) int64 its first texel's index * 3, tex_h / tex_w: (K,)
    int32 (1 x 1 for the others). albedo: (K,) int32 :data:`ALBEDO_UNIFORM` / ``VERTEX`` / ``TEXTURE``.
    """

    verts: Tensor
    normals: Tensor
    faces: Tensor
    face_start: Tensor
    face_count: Tensor
    max_faces: int
    total_faces: int
    vertex_colors: Tensor
    uv: Tensor
    uv_faces: Tensor
    texture: Tensor
    tex_offset: Tensor
    tex_h: Tensor
    tex_w: Tensor
    albedo: Tensor

    @classmethod
    def of(cls, meshes: tuple[MeshTensors, ...], device: torch.device) -> PackedMeshes:
        verts, normals, faces, colours, uvs, uv_faces, texels = [], [], [], [], [], [], []
        face_start, face_count, tex_offset, tex_h, tex_w, albedo = [], [], [], [], [], []
        v_off = f_off = uv_off = t_off = 0
        for mesh in meshes:
            v = mesh.verts.detach().to("cpu", torch.float32)
            f = mesh.faces.detach().to("cpu", torch.int64)
            n_v, n_f = int(v.shape[0]), int(f.shape[0])
            verts.append(v)
            normals.append(mesh.normals.detach().to("cpu", torch.float32))
            faces.append(f + v_off)
            face_start.append(f_off)
            face_count.append(n_f)
            source = albedo_source(mesh)
            colours.append(mesh.vertex_colors.detach().to("cpu", torch.float32) if source == "vertex_colors"
                           else torch.zeros((n_v, 3), dtype=torch.float32))
            if source == "texture":
                uv = mesh.uv.detach().to("cpu", torch.float32)
                uvf = (mesh.uv_faces if mesh.uv_faces is not None else mesh.faces).detach().to("cpu", torch.int64)
                tex = mesh.texture.detach().to("cpu", torch.float32).contiguous()
                if tex.ndim != 3 or tex.shape[2] != 3:
                    raise ValueError(f"mesh.texture: expected (Ht, Wt, 3); got {tuple(tex.shape)}")
                uvs.append(uv)
                uv_faces.append(uvf + uv_off)
                texels.append(tex.reshape(-1))
                tex_offset.append(t_off)
                tex_h.append(int(tex.shape[0]))
                tex_w.append(int(tex.shape[1]))
                uv_off += int(uv.shape[0])
                t_off += int(tex.numel())
                albedo.append(ALBEDO_TEXTURE)
            else:
                uv_faces.append(torch.zeros((n_f, 3), dtype=torch.int64))
                tex_offset.append(0)
                tex_h.append(1)
                tex_w.append(1)
                albedo.append(ALBEDO_VERTEX if source == "vertex_colors" else ALBEDO_UNIFORM)
            v_off += n_v
            f_off += n_f
        if not uvs:
            uvs.append(torch.zeros((1, 2), dtype=torch.float32))
        if not texels:
            texels.append(torch.zeros((3,), dtype=torch.float32))

        def dev(t: Tensor, dtype: torch.dtype) -> Tensor:
            return t.to(dtype).contiguous().to(device)

        def table(values: list[int], dtype: torch.dtype) -> Tensor:
            return torch.tensor(np.asarray(values), dtype=dtype, device=device)

        return cls(
            verts=dev(torch.cat(verts), torch.float32), normals=dev(torch.cat(normals), torch.float32),
            faces=dev(torch.cat(faces), torch.int32), face_start=table(face_start, torch.int32),
            face_count=table(face_count, torch.int32), max_faces=max(face_count), total_faces=f_off,
            vertex_colors=dev(torch.cat(colours), torch.float32), uv=dev(torch.cat(uvs), torch.float32),
            uv_faces=dev(torch.cat(uv_faces), torch.int32), texture=dev(torch.cat(texels), torch.float32),
            tex_offset=table(tex_offset, torch.int64), tex_h=table(tex_h, torch.int32),
            tex_w=table(tex_w, torch.int32), albedo=table(albedo, torch.int32),
        )


class MeshGroup:
    """K meshes rendered together (all on one device); :attr:`packed` is built on first use and kept."""

    def __init__(self, meshes: tuple[MeshTensors, ...] | list[MeshTensors]) -> None:
        self.meshes = tuple(meshes)
        if not self.meshes:
            raise ValueError("a mesh group needs at least one mesh")
        self.device = self.meshes[0].verts.device
        for i, mesh in enumerate(self.meshes):
            if mesh.verts.device != self.device:
                raise ValueError(f"meshes[{i}] is on {mesh.verts.device}, meshes[0] on {self.device}")
        self._packed: PackedMeshes | None = None

    @property
    def packed(self) -> PackedMeshes:
        """The meshes' packed tables (host-to-device copies on the first call: build it before a capture)."""
        if self._packed is None:
            self._packed = PackedMeshes.of(self.meshes, self.device)
        return self._packed

    def __len__(self) -> int:
        return len(self.meshes)


@dataclass(frozen=True, slots=True, eq=False)
class RowMeshes:
    """What ``render`` takes in place of a mesh: row i renders mesh ``row_mesh[i]`` of ``group``.

    row_mesh: (N,) int64 on the render device (data: a captured render reads it, never the host). row_mesh_host:
    the same indices on the host when the caller knows them (the backends that split the rows per mesh read them
    from here instead of synchronising on the device copy), else None.
    """

    group: MeshGroup
    row_mesh: Tensor
    row_mesh_host: np.ndarray | None = None

    def rows(self, sl: slice) -> RowMeshes:
        """The rows of ``sl`` (a chunk of the render)."""
        host = None if self.row_mesh_host is None else self.row_mesh_host[sl]
        return RowMeshes(self.group, self.row_mesh[sl], host)

    def host_indices(self) -> np.ndarray:
        """The row indices on the host (the device copy is read, a synchronisation, when the caller gave none)."""
        if self.row_mesh_host is not None:
            return np.asarray(self.row_mesh_host, dtype=np.int64)
        return self.row_mesh.detach().cpu().numpy().astype(np.int64)
