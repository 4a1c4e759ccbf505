"""Readable reference twins of the fast crop code in :mod:`foundationpose.crop` (spec §2.5, §2.6).

Each function computes the same float operations as the function it mirrors, one op at a time and without
the fast path's tricks (cached constants, fused index arithmetic, evaluation at the crop pixels only), so
the parity tests can ask for bit equality on the same device. Not used by the register/track paths.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from foundationpose.constants import MIN_VALID_DEPTH_M
from foundationpose.models.blocks import CROP_SIZE
from foundationpose.sampling.backprojection import depth_to_xyz

__all__ = ["crop_windows_reference", "scorer_real_xyz_reference", "warp_to_crops_reference"]

_BACK_WARP_PIXELS_PER_CHUNK = 1 << 22  # N' * H * W pixels per full-resolution chunk of the double warp


def crop_windows_reference(
    cam_from_centred: Tensor, K: np.ndarray | Tensor, diameter: float, crop_ratio: float, S: int = CROP_SIZE
) -> Tensor:
    """Mirrors :func:`foundationpose.crop.crop_windows` for one (3, 3) K (spec §2.5, ``box_3d``).

    cam_from_centred: (N, 4, 4) float32. Returns ``crop_from_img`` (N, 3, 3) float32: steps 2-5 in float64,
    edges rounded half to even, ``F`` assembled in float32.
    """
    device = cam_from_centred.device
    n = cam_from_centred.shape[0]
    radius_m = float(diameter) * float(crop_ratio) / 2
    offsets = torch.tensor(
        [[0.0, 0.0, 0.0], [radius_m, 0.0, 0.0], [-radius_m, 0.0, 0.0], [0.0, radius_m, 0.0], [0.0, -radius_m, 0.0]],
        dtype=torch.float64,
        device=device,
    )
    t_cam = cam_from_centred[:, :3, 3].to(torch.float64)
    pts_cam = t_cam[:, None, :] + offsets[None]  # (N, 5, 3)
    K64 = torch.as_tensor(K, dtype=torch.float64, device=device).reshape(3, 3)
    projected = (K64 @ pts_cam.reshape(-1, 3).T).T
    uv_img = (projected[:, :2] / projected[:, 2:3]).reshape(n, 5, 2)
    centre = uv_img[:, 0]
    radius_px = torch.abs(uv_img - centre[:, None, :]).reshape(n, -1).max(dim=-1).values
    left = torch.round(centre[:, 0] - radius_px)
    right = torch.round(centre[:, 0] + radius_px)
    top = torch.round(centre[:, 1] - radius_px)
    bottom = torch.round(centre[:, 1] + radius_px)
    sx = (S / (right - left)).to(torch.float32)
    sy = (S / (bottom - top)).to(torch.float32)
    crop_from_img = torch.zeros((n, 3, 3), dtype=torch.float32, device=device)
    crop_from_img[:, 0, 0] = sx
    crop_from_img[:, 1, 1] = sy
    crop_from_img[:, 0, 2] = sx * (-left).to(torch.float32)
    crop_from_img[:, 1, 2] = sy * (-top).to(torch.float32)
    crop_from_img[:, 2, 2] = 1.0
    return crop_from_img


def _pixel_to_normalised(height: int, width: int, device: torch.device) -> Tensor:
    """kornia 0.7.2 ``normal_transform_pixel``: (1, 3, 3) float32 pixels -> [-1, 1] with ``size - 1``."""
    mat = torch.tensor([[1.0, 0.0, -1.0], [0.0, 1.0, -1.0], [0.0, 0.0, 1.0]], dtype=torch.float32)
    mat[0, 0] = mat[0, 0] * 2.0 / (1e-14 if width == 1 else width - 1.0)
    mat[1, 1] = mat[1, 1] * 2.0 / (1e-14 if height == 1 else height - 1.0)
    return mat[None].to(device)


def _normalised_inverse(dst_from_src: Tensor, src_hw: tuple[int, int], dst_hw: tuple[int, int]) -> Tensor:
    """kornia 0.7.2 ``normalize_homography`` then ``linalg.inv``: (N, 3, 3) ``src_norm_from_dst_norm``."""
    device = dst_from_src.device
    src_from_src_norm = torch.linalg.inv(_pixel_to_normalised(src_hw[0], src_hw[1], device))
    dst_norm_from_dst = _pixel_to_normalised(dst_hw[0], dst_hw[1], device)
    return torch.linalg.inv(dst_norm_from_dst @ (dst_from_src @ src_from_src_norm))


def _sample(src: Tensor, src_norm_from_dst_norm: Tensor, dst_hw: tuple[int, int], mode: str) -> Tensor:
    """kornia 0.7.2 ``warp_perspective(align_corners=False)`` body: (N or 1, C, H, W) -> (N, C, h, w)."""
    device = src_norm_from_dst_norm.device
    dst_h, dst_w = dst_hw
    n = src_norm_from_dst_norm.shape[0]
    xs = torch.linspace(0, dst_w - 1, dst_w, device=device, dtype=torch.float32)
    ys = torch.linspace(0, dst_h - 1, dst_h, device=device, dtype=torch.float32)
    xs = (xs / (dst_w - 1) - 0.5) * 2
    ys = (ys / (dst_h - 1) - 0.5) * 2
    base = torch.stack(torch.meshgrid([xs, ys], indexing="ij"), dim=-1).permute(1, 0, 2)  # (h, w, 2)
    points = base[None].expand(n, dst_h, dst_w, 2).reshape(-1, dst_w, 2)
    points_h = F.pad(points, [0, 1], "constant", 1.0)
    mats = torch.repeat_interleave(src_norm_from_dst_norm, repeats=dst_h, dim=0)
    mapped = torch.bmm(points_h, mats.permute(0, 2, 1))
    w_h = mapped[..., -1:]
    scale = torch.where(torch.abs(w_h) > 1e-8, 1.0 / (w_h + 1e-8), torch.ones_like(w_h))
    grid = (scale * mapped[..., :-1]).reshape(n, dst_h, dst_w, 2)
    if src.shape[0] != n:
        src = src.expand(n, -1, -1, -1)
    return F.grid_sample(src, grid, mode=mode, padding_mode="zeros", align_corners=False)


def warp_to_crops_reference(
    image: Tensor, crop_from_img: Tensor, S: int = CROP_SIZE, mode: str = "bilinear"
) -> Tensor:
    """Mirrors :func:`foundationpose.crop.warp_to_crops` for one (H, W, C) image (spec §2.6.1).

    Returns (N, S, S, C) float32; outside samples are 0.
    """
    src = image.permute(2, 0, 1)[None]
    inv = _normalised_inverse(crop_from_img, (src.shape[-2], src.shape[-1]), (S, S))
    return _sample(src, inv, (S, S), mode).permute(0, 2, 3, 1).contiguous()


def scorer_real_xyz_reference(
    depth: Tensor,
    crop_from_img: Tensor,
    K: np.ndarray | Tensor,
    S: int = CROP_SIZE,
    min_depth: float = MIN_VALID_DEPTH_M,
    max_pixels_per_chunk: int | None = _BACK_WARP_PIXELS_PER_CHUNK,
) -> Tensor:
    """Mirrors :func:`foundationpose.crop.scorer_real_xyz`: the double warp of spec §2.6.3, literally.

    Nearest-warp the depth into each crop, warp it back to full resolution, back-project it there
    (:func:`foundationpose.sampling.depth_to_xyz`, float32) and nearest-warp the xyz map into the crop again.
    The (N, H, W, 3) intermediate is built for at most ``max_pixels_per_chunk`` = N' * H * W pixels at a time
    (None: the whole batch at once); chunking changes no value. Returns (N, S, S, 3) float32.
    """
    n = crop_from_img.shape[0]
    h, w = depth.shape
    fwd_norm = _normalised_inverse(crop_from_img, (h, w), (S, S))
    depth_crop = _sample(depth[None, None], fwd_norm, (S, S), "nearest")  # (N, 1, S, S)
    back_norm = _normalised_inverse(torch.linalg.inv(crop_from_img), (S, S), (h, w))
    out = torch.empty((n, S, S, 3), dtype=torch.float32, device=depth.device)
    chunk = max(1, n) if max_pixels_per_chunk is None else max(1, max_pixels_per_chunk // (h * w))
    for start in range(0, n, chunk):
        sl = slice(start, min(n, start + chunk))
        depth_full = _sample(depth_crop[sl], back_norm[sl], (h, w), "nearest")[:, 0]  # (n', H, W)
        xyz_full = depth_to_xyz(depth_full, K, min_depth).permute(0, 3, 1, 2)  # (n', 3, H, W)
        out[sl] = _sample(xyz_full, fwd_norm[sl], (S, S), "nearest").permute(0, 2, 3, 1)
    return out
