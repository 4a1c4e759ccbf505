"""Plain-torch twins of nvdiffrast's ``interpolate`` and ``texture`` (forward only, any device).

They consume a rasteriser output in nvdiffrast's format, ``rast (N, Hr, Wr, 4)`` float32 =
``(b0, b1, z/w, triangle_id + 1)`` with ``triangle_id + 1 = 0`` on background, and reproduce the kernels'
float32 arithmetic: ``b2 = 1 - b0 - b1``, ``out = b0*a0 + b1*a1 + b2*a2``; bilinear texturing with
``u = u - floor(u)``, ``u * Wt - 0.5``, wrapped texel indices and ``lerp(a, b, t) = a + t * (b - a)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["triangle_ids", "interpolate", "interpolate_pixels", "texture_linear_wrap"]


def triangle_ids(rast: Tensor) -> Tensor:
    """(N, Hr, Wr) int64 triangle index per pixel, -1 on background, from ``rast[..., 3]``."""
    return rast[..., 3].to(torch.int64) - 1


def interpolate(attr: Tensor, rast: Tensor, tri: Tensor) -> Tensor:
    """Mirror of ``nvdiffrast.torch.interpolate(attr, rast, tri)`` (first output only).

    attr: (V, C) float32 shared by all images, or (N, V, C) per image (instanced mode; N = 1 broadcasts).
    rast: (N, Hr, Wr, 4) float32 rasteriser output. tri: (F, 3) integer vertex indices into ``attr``.
    Returns (N, Hr, Wr, C) float32, 0 where no triangle covers the pixel.
    """
    n, h, w, _ = rast.shape
    out = torch.zeros((n, h, w, attr.shape[-1]), dtype=torch.float32, device=rast.device)
    tri_id = triangle_ids(rast)
    img, row, col = ((tri_id >= 0) & (tri_id < tri.shape[0])).nonzero(as_tuple=True)
    if img.numel():
        out[img, row, col] = interpolate_pixels(attr, tri, img, tri_id[img, row, col], rast[img, row, col])
    return out


def interpolate_pixels(attr: Tensor, tri: Tensor, img: Tensor, tri_id: Tensor, rast_px: Tensor) -> Tensor:
    """:func:`interpolate` at selected covered pixels only.

    attr: (V, C) or (N, V, C) float32. tri: (F, 3). img: (M,) int64 image index of each pixel.
    tri_id: (M,) int64 covering triangle (>= 0). rast_px: (M, 4) float32 rasteriser output at the pixels.
    Returns (M, C) float32 ``b0*a0 + b1*a1 + b2*a2`` with ``b2 = 1 - b0 - b1``.
    """
    b0, b1 = rast_px[:, 0:1], rast_px[:, 1:2]
    b2 = 1.0 - b0 - b1
    vidx = tri.to(device=rast_px.device, dtype=torch.int64)[tri_id]  # (M, 3)
    if attr.ndim == 3 and attr.shape[0] > 1:
        a = attr[img[:, None], vidx]  # (M, 3, C)
    else:
        a = (attr[0] if attr.ndim == 3 else attr)[vidx]
    return b0 * a[:, 0] + b1 * a[:, 1] + b2 * a[:, 2]


def texture_linear_wrap(tex: Tensor, uv: Tensor) -> Tensor:
    """Mirror of ``nvdiffrast.torch.texture(tex[None], uv, filter_mode='linear', boundary_mode='wrap')``.

    tex: (Ht, Wt, C) float32, row 0 = first (top) row of the image as stored.
    uv: (..., 2) float32; ``u`` runs along columns and ``v`` along rows, texel ``(k, l)`` centred at
    ``((k + 0.5)/Wt, (l + 0.5)/Ht)``; the unit square repeats (wrap).
    Returns (..., C) float32 bilinear samples, no mipmaps.
    """
    ht, wt, _ = tex.shape
    u, v = uv[..., 0], uv[..., 1]
    u = u - torch.floor(u)
    v = v - torch.floor(v)
    u = u * float(wt) - 0.5
    v = v * float(ht) - 0.5
    u0f, v0f = torch.floor(u), torch.floor(v)
    fu, fv = (u - u0f)[..., None], (v - v0f)[..., None]
    iu0, iv0 = u0f.to(torch.int64), v0f.to(torch.int64)
    iu1, iv1 = iu0 + 1, iv0 + 1
    iu0 = torch.where(iu0 < 0, iu0 + wt, iu0)
    iv0 = torch.where(iv0 < 0, iv0 + ht, iv0)
    iu1 = torch.where(iu1 >= wt, iu1 - wt, iu1)
    iv1 = torch.where(iv1 >= ht, iv1 - ht, iv1)
    a00, a10 = tex[iv0, iu0], tex[iv0, iu1]
    a01, a11 = tex[iv1, iu0], tex[iv1, iu1]
    top = a00 + fu * (a10 - a00)
    bottom = a01 + fu * (a11 - a01)
    return top + fv * (bottom - top)
