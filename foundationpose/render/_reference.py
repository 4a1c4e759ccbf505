"""Readable reference twins of the renderer's shared flow (spec §3.2, §3.3), for the bit-parity tests.

Each function is the previous, one-element-wise-op-at-a-time code of the function it mirrors: no memoised
constants, no fused crop transform, the raster images flipped at the end. Not used by the render paths.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from foundationpose.render.attributes import interpolate_pixels, texture_linear_wrap, triangle_ids
from foundationpose.render.base import RenderConfig, RenderOutput
from foundationpose.render.projection import GL_FROM_CAM, projection_from_K, vertices_to_clip
from foundationpose.render.shading import shade, vertex_diffuse, vertices_in_cam

if TYPE_CHECKING:
    from foundationpose.mesh import MeshTensors

__all__ = ["crop_clip_coefficients_reference", "crop_clip_reference", "render_crops_reference"]


def crop_clip_coefficients_reference(bounds: Tensor, img_hw: tuple[int, int]) -> Tensor:
    """Mirrors :func:`foundationpose.render.projection.crop_clip_coefficients`: one op per term.

    bounds: (N, 4) float32 ``[x0, y0, x1, y1]``. Returns (N, 4) ``[ax, bx, ay, by]`` (torch evaluates
    ``w / t`` as ``t.reciprocal() * w``, which the fast code reproduces).
    """
    h, w = img_hw
    left, right = bounds[:, 0], bounds[:, 2]
    top, bottom = h - bounds[:, 1], h - bounds[:, 3]
    return torch.stack(
        [w / (right - left), (w - right - left) / (right - left), h / (top - bottom), (h - top - bottom) / (top - bottom)],
        dim=1,
    )


def crop_clip_reference(clip: Tensor, crop_from_img: Tensor, img_hw: tuple[int, int], crop_size_px: int) -> Tensor:
    """Mirrors ``crop_bounds`` + ``crop_scale_offset`` + ``apply_crop_to_clip_`` of
    :mod:`foundationpose.render.projection` (spec §3.3). clip: (N, V, 4) float32; returns a new (N, V, 4)."""
    img_from_crop, _ = torch.linalg.inv_ex(crop_from_img.to(torch.float32))
    last = crop_size_px - 1.0
    corners = torch.tensor([[0.0, last], [0.0, last]], dtype=torch.float32, device=clip.device)
    pts = img_from_crop[:, :2, :2] @ corners + img_from_crop[:, :2, 2:]
    bounds = torch.stack([pts[:, 0, 0], pts[:, 1, 0], pts[:, 0, 1], pts[:, 1, 1]], dim=1)
    c = crop_clip_coefficients_reference(bounds, img_hw)[:, None, :]
    x = clip[..., 0] * c[..., 0] + clip[..., 3] * c[..., 1]
    y = clip[..., 1] * c[..., 2] + clip[..., 3] * c[..., 3]
    return torch.stack([x, y, clip[..., 2], clip[..., 3]], dim=-1).contiguous()


def render_crops_reference(
    mesh: MeshTensors,
    cam_from_centred: Tensor,
    K: np.ndarray,
    img_hw: tuple[int, int],
    crop_from_img: Tensor,
    config: RenderConfig | None = None,
) -> RenderOutput:
    """Mirrors :meth:`foundationpose.render.CpuRasterizer.render` (CPU tensors, one (3, 3) K, one pass).

    Per-call projection and ``G``, the crop applied to the clip coordinates, rasterised in the raster
    convention, shaded, then flipped vertically. Returns (N, S, S) renders.
    """
    from foundationpose.render.cpu_raster import rasterize  # the rasteriser itself is shared, not mirrored

    config = config or RenderConfig()
    s = config.crop_size_px
    gl = torch.tensor(GL_FROM_CAM, dtype=torch.float32)
    projection = projection_from_K(K, img_hw, config.z_near_m, config.z_far_m)
    clip = vertices_to_clip(mesh.verts, projection @ (gl @ cam_from_centred))
    clip = crop_clip_reference(clip, crop_from_img, img_hw, s)
    rast = rasterize(clip, mesh.faces, (s, s))
    tri_id = triangle_ids(rast)
    mask = tri_id >= 0
    img, row, col = mask.nonzero(as_tuple=True)
    tri_px, rast_px = tri_id[img, row, col], rast[img, row, col]
    xyz_px = interpolate_pixels(vertices_in_cam(mesh.verts, cam_from_centred), mesh.faces, img, tri_px, rast_px)
    diffuse_px = interpolate_pixels(vertex_diffuse(mesh.normals, cam_from_centred), mesh.faces, img, tri_px, rast_px)
    if mesh.uv is not None and mesh.texture is not None:
        albedo_px = texture_linear_wrap(mesh.texture, interpolate_pixels(mesh.uv, mesh.uv_faces, img, tri_px, rast_px))
    elif mesh.vertex_colors is not None:
        albedo_px = interpolate_pixels(mesh.vertex_colors, mesh.faces, img, tri_px, rast_px)
    else:
        albedo_px = torch.full_like(xyz_px, config.untextured_albedo)
    rgb = torch.zeros((*mask.shape, 3))
    xyz_cam = torch.zeros_like(rgb)
    rgb[img, row, col] = shade(albedo_px, diffuse_px)
    xyz_cam[img, row, col] = xyz_px
    return RenderOutput(rgb.flip(1), xyz_cam.flip(1), mask.flip(1))
