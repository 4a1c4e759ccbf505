"""Vectorised z-buffer rasteriser in plain torch (any device), the CPU backend and the fallback.

:func:`rasterize` mirrors ``nvdiffrast.torch.rasterize`` in instanced mode (forward output only):

* raster pixel ``(j, i)`` is centred at NDC ``(xs*j + xo, ys*i + yo)``, ``xs = 2/Wr``, ``xo = 1/Wr - 1``;
* coverage, depth and barycentrics come from homogeneous 2-D edge functions evaluated at the pixel centre
  (Olano & Greer), exactly the formulas of nvdiffrast's pixel shader: with ``p_k' = (x_k - fx w_k, y_k - fy w_k)``,
  ``a0 = p1' x p2'``, ``a1 = p2' x p0'``, ``a2 = p0' x p1'``, barycentrics ``b_k = a_k / (a0 + a1 + a2)`` are
  perspective-correct, ``z/w = (sum z_k a_k) / (sum w_k a_k)``;
* a pixel is covered by a triangle when all ``b_k >= 0`` (edges inclusive, both windings: no culling), the
  surface point is in front of the camera (``sum w_k a_k`` has the sign of ``sum a_k``) and
  ``-1 <= z/w <= 1``. This per-fragment test is equivalent to clipping against the near and far planes, so
  triangles crossing the near plane (or behind the camera) need no special path;
* the depth test keeps the smallest ``z/w``; exact ties go to the lowest triangle index (deterministic).

Differences from nvdiffrast's CUDA rasteriser: it snaps vertices to 1/16 pixel for its coverage decision and
compares fixed-point depths, so pixels whose centre lies within ~1/32 px of a silhouette edge, and the winner
between nearly coplanar surfaces, can differ; barycentrics of a pixel covered by the same triangle agree to
float32 rounding (nvcc contracts some products into FMAs).

Work is organised as (hypothesis, face) pairs: pairs are culled against the view volume, each surviving pair's
pixel bounding box is enumerated exactly (no padding), and candidate fragments are evaluated in steps of at most
``fragment_budget``; winners are kept per pixel in one int64 key ``(sortable z/w bits << 32) + face``, reduced
with ``scatter_reduce(amin)``. Memory stays bounded by the two budgets.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from foundationpose.render._core import ChunkInputs, RendererCore
from foundationpose.render.attributes import interpolate_pixels, texture_linear_wrap, triangle_ids
from foundationpose.render.base import RenderConfig
from foundationpose.render.shading import shade

if TYPE_CHECKING:
    from foundationpose.mesh import MeshTensors

__all__ = ["CpuRasterizer", "rasterize"]

logger = logging.getLogger(__name__)

_EMPTY_KEY = torch.iinfo(torch.int64).max
_BBOX_EPS_PX = 1e-2  # widen each bounding box by this much: the edge test, not the box, decides coverage


def rasterize(
    clip: Tensor,
    faces: Tensor,
    resolution: tuple[int, int],
    *,
    fragment_budget: int = 1 << 19,
    pair_budget: int = 1 << 20,
) -> Tensor:
    """Rasterise ``N`` instances of one triangle list (mirror of ``dr.rasterize(ctx, clip, faces, resolution)``).

    clip: (N, V, 4) float32 clip-space vertices (x, y, z, w). faces: (F, 3) integer vertex indices.
    resolution: (Hr, Wr). Returns (N, Hr, Wr, 4) float32 ``(b0, b1, z/w, face + 1)``, zeros on background,
    raster convention (row 0 = NDC y = -1); ``b0, b1`` clamped to [0, 1] and ``z/w`` to [-1, 1] as nvdiffrast does.
    """
    assert clip.ndim == 3 and clip.shape[2] == 4, clip.shape
    assert faces.ndim == 2 and faces.shape[1] == 3, faces.shape
    n = clip.shape[0]
    h, w = int(resolution[0]), int(resolution[1])
    device = clip.device
    clip = clip.to(torch.float32)
    faces = faces.to(device=device, dtype=torch.int64)
    n_faces = faces.shape[0]
    keys = torch.full((n * h * w,), _EMPTY_KEY, dtype=torch.int64, device=device)
    if n_faces and n:
        hyp_step = max(1, pair_budget // n_faces)
        for h0 in range(0, n, hyp_step):
            tri = clip[h0 : h0 + hyp_step][:, faces]  # (n_step, F, 3, 4)
            _raster_pairs(tri, h0, keys, (h, w), fragment_budget)
    return _resolve(keys, clip, faces, n, (h, w))


def _pixel_centre_consts(size: int) -> tuple[float, float]:
    scale = np.float32(2.0) / np.float32(size)
    offset = np.float32(1.0) / np.float32(size) - np.float32(1.0)
    return float(scale), float(offset)


def _raster_pairs(tri: Tensor, hyp_offset: int, keys: Tensor, hw: tuple[int, int], fragment_budget: int) -> None:
    """Set up the (hypothesis, face) pairs of ``tri`` (n, F, 3, 4) and z-test their fragments into ``keys``."""
    h, w = hw
    x, y, z, wc = tri.unbind(-1)  # each (n, F, 3)
    outside = (
        (x > wc).all(-1) | (x < -wc).all(-1) | (y > wc).all(-1) | (y < -wc).all(-1)
        | (z > wc).all(-1) | (z < -wc).all(-1) | (wc <= 0).all(-1)
    )  # (n, F): the whole triangle lies beyond one plane of the view volume
    in_front = (wc > 0).all(-1)
    safe_w = torch.where(wc > 0, wc, torch.ones_like(wc))
    # Raster-pixel coordinates of the vertices (pixel index whose centre the vertex would sit on).
    sx = (x / safe_w + 1.0) * (0.5 * w) - 0.5
    sy = (y / safe_w + 1.0) * (0.5 * h) - 0.5
    x_lo = torch.ceil(sx.amin(-1) - _BBOX_EPS_PX).clamp(-1, w)
    x_hi = torch.floor(sx.amax(-1) + _BBOX_EPS_PX).clamp(-1, w)
    y_lo = torch.ceil(sy.amin(-1) - _BBOX_EPS_PX).clamp(-1, h)
    y_hi = torch.floor(sy.amax(-1) + _BBOX_EPS_PX).clamp(-1, h)
    # Triangles reaching behind the camera: no projected box, scan the whole target (rare).
    x_lo = torch.where(in_front, x_lo.clamp_min(0), torch.zeros_like(x_lo)).to(torch.int64)
    x_hi = torch.where(in_front, x_hi.clamp_max(w - 1), torch.full_like(x_hi, w - 1)).to(torch.int64)
    y_lo = torch.where(in_front, y_lo.clamp_min(0), torch.zeros_like(y_lo)).to(torch.int64)
    y_hi = torch.where(in_front, y_hi.clamp_max(h - 1), torch.full_like(y_hi, h - 1)).to(torch.int64)
    keep = ~outside & (x_lo <= x_hi) & (y_lo <= y_hi)
    hyp_idx, face_idx = keep.nonzero(as_tuple=True)  # (P,)
    if hyp_idx.numel() == 0:
        return
    box_w = (x_hi - x_lo + 1)[hyp_idx, face_idx]
    counts = box_w * (y_hi - y_lo + 1)[hyp_idx, face_idx]  # (P,) candidate fragments per pair
    pair_x0 = x_lo[hyp_idx, face_idx]
    pair_y0 = y_lo[hyp_idx, face_idx]
    pair_verts = tri[hyp_idx, face_idx].reshape(-1, 12).t().contiguous()  # (12, P): x0 y0 z0 w0 x1 ... w2
    pair_img = hyp_idx + hyp_offset
    consts = (*_pixel_centre_consts(w), *_pixel_centre_consts(h))

    ends = torch.cumsum(counts, 0)
    ends_host = ends.cpu()
    n_pairs = ends_host.shape[0]
    start, done = 0, 0
    while start < n_pairs:
        stop = int(torch.searchsorted(ends_host, done + fragment_budget, right=True))
        stop = max(stop, start + 1)
        sel = slice(start, stop)
        _fragments(
            counts[sel], box_w[sel], pair_x0[sel], pair_y0[sel], pair_verts[:, sel], pair_img[sel], face_idx[sel],
            keys, hw, consts,
        )
        done = int(ends_host[stop - 1])
        start = stop


def _fragments(
    counts: Tensor,
    box_w: Tensor,
    x0: Tensor,
    y0: Tensor,
    verts: Tensor,
    img: Tensor,
    face: Tensor,
    keys: Tensor,
    hw: tuple[int, int],
    consts: tuple[float, float, float, float],
) -> None:
    """Evaluate every pixel of each pair's bounding box and z-test the covered ones into ``keys``."""
    h, w = hw
    xs, xo, ys, yo = consts
    pair = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts)  # (T,)
    first = torch.cumsum(counts, 0) - counts
    local = torch.arange(pair.shape[0], device=counts.device) - first[pair]
    bw = box_w[pair]
    px = x0[pair] + local % bw
    py = y0[pair] + torch.div(local, bw, rounding_mode="floor")
    _, _, zw, ok = _barycentrics(verts[:, pair], px, py, xs, xo, ys, yo)
    if not bool(ok.any()):
        return
    zw = zw[ok].contiguous()
    bits = zw.view(torch.int32)
    sortable = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)  # monotone in z/w
    key = sortable * (1 << 32) + face[pair][ok]
    pix = (img[pair][ok] * h + py[ok]) * w + px[ok]
    keys.scatter_reduce_(0, pix, key, reduce="amin")


def _barycentrics(
    verts: Tensor, px: Tensor, py: Tensor, xs: float, xo: float, ys: float, yo: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """nvdiffrast's pixel-shader arithmetic for fragments.

    verts: (12, T) float32 clip coordinates of the three vertices (rows x0 y0 z0 w0 x1 ... w2; rows are
    contiguous, which keeps the element-wise ops vectorised). px, py: (T,) int64 raster pixel.
    Returns unclamped ``b0, b1``, ``z/w`` (T,) float32 and the coverage test ``ok`` (T,) bool.
    """
    x0, y0, z0, w0, x1, y1, z1, w1, x2, y2, z2, w2 = verts.unbind(0)
    fx = px.to(torch.float32) * xs + xo
    fy = py.to(torch.float32) * ys + yo
    p0x, p0y = x0 - fx * w0, y0 - fy * w0
    p1x, p1y = x1 - fx * w1, y1 - fy * w1
    p2x, p2y = x2 - fx * w2, y2 - fy * w2
    a0 = p1x * p2y - p1y * p2x
    a1 = p2x * p0y - p2y * p0x
    a2 = p0x * p1y - p0y * p1x
    area = a0 + a1 + a2
    iw = 1.0 / area
    b0 = a0 * iw
    b1 = a1 * iw
    zc = z0 * a0 + z1 * a1 + z2 * a2
    wcomb = w0 * a0 + w1 * a1 + w2 * a2
    zw = zc / wcomb
    positive = (a0 >= 0) & (a1 >= 0) & (a2 >= 0) & (area > 0)
    negative = (a0 <= 0) & (a1 <= 0) & (a2 <= 0) & (area < 0)
    in_front = torch.where(area > 0, wcomb > 0, wcomb < 0)  # surface point w = wcomb / area > 0
    ok = (positive | negative) & in_front & (zw >= -1.0) & (zw <= 1.0)
    return b0, b1, zw, ok


def _resolve(keys: Tensor, clip: Tensor, faces: Tensor, n: int, hw: tuple[int, int]) -> Tensor:
    """Turn the winning key of each pixel into nvdiffrast's ``(b0, b1, z/w, face + 1)`` output."""
    h, w = hw
    rast = torch.zeros((n * h * w, 4), dtype=torch.float32, device=clip.device)
    covered = (keys != _EMPTY_KEY).nonzero(as_tuple=True)[0]
    if covered.numel():
        face = keys[covered] & 0xFFFFFFFF
        img = torch.div(covered, h * w, rounding_mode="floor")
        rem = covered - img * (h * w)
        py = torch.div(rem, w, rounding_mode="floor")
        px = rem - py * w
        verts = clip[img[:, None], faces[face]].reshape(-1, 12).t().contiguous()  # (12, M)
        b0, b1, zw, _ = _barycentrics(verts, px, py, *_pixel_centre_consts(w), *_pixel_centre_consts(h))
        rast[covered] = torch.stack(
            [b0.clamp(0.0, 1.0), b1.clamp(0.0, 1.0), zw.clamp(-1.0, 1.0), (face + 1).to(torch.float32)], dim=1
        )
    return rast.view(n, h, w, 4)


class CpuRasterizer(RendererCore):
    """Renderer backend built on :func:`rasterize` and the torch twins of nvdiffrast's attribute ops.

    Runs on any torch device (CPU here; on CUDA it is a slow but exact fallback that enqueues on the caller's
    current stream, so ``RenderOutput.ready`` is ``None``). It holds no mutable state beyond its config, so
    one instance may serve several threads.
    """

    name = "cpu"

    def __init__(self, device: str | torch.device = "cpu", config: RenderConfig | None = None) -> None:
        super().__init__(device, config)

    def _draw(self, mesh: MeshTensors, chunk: ChunkInputs, rgb: Tensor, xyz: Tensor, mask: Tensor) -> None:
        cfg = self.config
        faces = mesh.faces
        rast = rasterize(
            chunk.clip,
            faces,
            chunk.size_hw,
            fragment_budget=cfg.cpu_fragment_budget,
            pair_budget=cfg.cpu_pair_budget,
        ).flip(1)  # (n, Hr, Wr, 4), row 0 = top; every step below is per pixel
        # Same arithmetic as interpolate()/texture on full maps, evaluated at covered pixels only.
        tri_id = triangle_ids(rast)
        torch.ge(tri_id, 0, out=mask)
        img, row, col = mask.nonzero(as_tuple=True)
        tri_px, rast_px = tri_id[img, row, col], rast[img, row, col]  # (M,), (M, 4)
        xyz_px = interpolate_pixels(chunk.xyz_cam, faces, img, tri_px, rast_px)
        diffuse_px = interpolate_pixels(chunk.diffuse, faces, img, tri_px, rast_px)
        source = self.albedo_source(mesh)
        if source == "texture":
            uv_faces = mesh.uv_faces if mesh.uv_faces is not None else faces
            uv_px = interpolate_pixels(mesh.uv, uv_faces, img, tri_px, rast_px)
            albedo_px = texture_linear_wrap(mesh.texture, uv_px)
        elif source == "vertex_colors":
            albedo_px = interpolate_pixels(mesh.vertex_colors, faces, img, tri_px, rast_px)
        else:
            albedo_px = torch.full_like(xyz_px, cfg.untextured_albedo)
        rgb.zero_()
        xyz.zero_()
        rgb[img, row, col] = shade(albedo_px, diffuse_px, cfg.ambient_weight, cfg.diffuse_weight)  # coverage 1
        xyz[img, row, col] = xyz_px
