"""Crop windows around pose hypotheses and sampling of the real image into them (spec §2.5, §2.6).

Every function here is batched over ``N`` hypotheses and device-agnostic (it runs where its tensor
inputs live). The warps reproduce kornia 0.7.2 ``warp_perspective(..., align_corners=False)`` as
the reference calls it, including its float32 path, so that nearest-neighbour picks and bilinear
weights match the reference to the last bit on the same device (spec §2.6.1): a crop pixel
``(j, i)`` samples the source at ``x = x_s * W / (W - 1) - 0.5``, ``y = y_s * H / (H - 1) - 0.5``
where ``(x_s, y_s)`` is ``crop_from_img^-1 (j, i, 1)`` dehomogenised; zero outside the source.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

__all__ = [
    "CROP_SIDE",
    "crop_windows",
    "warp_to_crops",
    "scorer_real_xyz",
    "depth_to_xyz_batch",
]

logger = logging.getLogger(__name__)

CROP_SIDE = 160  # S, network crop side in pixels (spec §0, input_resize = [160, 160])

_HOMOGENEOUS_EPS = 1e-8  # kornia convert_points_from_homogeneous
_NORMALISE_EPS = 1e-14  # kornia normal_transform_pixel, only used for a size of 1
_BACK_WARP_PIXELS_PER_CHUNK = 1 << 22  # N' * H * W pixels per full-resolution back-warp chunk (~200 MB peak)


def crop_windows(
    cam_from_centred: Tensor,
    K: np.ndarray | Tensor,
    diameter: float,
    crop_ratio: float,
    S: int = CROP_SIDE,
) -> Tensor:
    """Square crop window of each hypothesis, as an image-to-crop pixel transform (spec §2.5, ``box_3d``).

    cam_from_centred: (N, 4, 4) float32 poses of the centred mesh (upstream ``ob_in_cam``); only the
        translation ``t`` is used. The window is centred on the projection of ``t`` with half-size
        ``R_px = max |proj(t ± r e_x / e_y) - proj(t)|``, ``r = diameter * crop_ratio / 2`` metres.
    K: (3, 3) intrinsics, pixels (float64 recommended: it is used in float64, full matrix incl. skew).
    diameter: mesh diameter in metres (python float = the float64 value). crop_ratio: 1.2 refine, 1.1 score.
    S: crop side in pixels.
    Returns ``crop_from_img`` (N, 3, 3) float32 on the poses' device:
    ``[[sx, 0, sx*(-left)], [0, sy, sy*(-top)], [0, 0, 1]]`` with ``sx = float32(S / (right - left))``.

    Steps 2-5 run in float64 (translation promoted from float32) and the edges are rounded half to even,
    as the reference does; ``F`` is assembled in float32 exactly as the reference's float32 matrix product.
    """
    assert cam_from_centred.ndim == 3 and cam_from_centred.shape[1:] == (4, 4), cam_from_centred.shape
    device = cam_from_centred.device
    n = cam_from_centred.shape[0]
    radius_m = float(diameter) * float(crop_ratio) / 2
    offsets = torch.tensor(
        [
            [0.0, 0.0, 0.0],
            [radius_m, 0.0, 0.0],
            [-radius_m, 0.0, 0.0],
            [0.0, radius_m, 0.0],
            [0.0, -radius_m, 0.0],
        ],
        dtype=torch.float64,
        device=device,
    )  # (5, 3)
    t_cam = cam_from_centred[:, :3, 3].to(torch.float64)  # (N, 3)
    pts_cam = t_cam[:, None, :] + offsets[None]  # (N, 5, 3)
    K64 = torch.as_tensor(K, dtype=torch.float64, device=device).reshape(3, 3)
    projected = (K64 @ pts_cam.reshape(-1, 3).T).T  # (5N, 3)
    uv_img = (projected[:, :2] / projected[:, 2:3]).reshape(n, 5, 2)  # (N, 5, 2)
    centre = uv_img[:, 0]  # (N, 2)
    radius_px = torch.abs(uv_img - centre[:, None, :]).reshape(n, -1).max(dim=-1).values  # (N,)
    left = torch.round(centre[:, 0] - radius_px)  # torch.round: half to even
    right = torch.round(centre[:, 0] + radius_px)
    top = torch.round(centre[:, 1] - radius_px)
    bottom = torch.round(centre[:, 1] + radius_px)

    sx = (S / (right - left)).to(torch.float32)  # quotient in float64, then rounded
    sy = (S / (bottom - top)).to(torch.float32)
    crop_from_img = torch.zeros((n, 3, 3), dtype=torch.float32, device=device)
    crop_from_img[:, 0, 0] = sx
    crop_from_img[:, 1, 1] = sy
    crop_from_img[:, 0, 2] = sx * (-left).to(torch.float32)  # float32 product, like the reference's matmul
    crop_from_img[:, 1, 2] = sy * (-top).to(torch.float32)
    crop_from_img[:, 2, 2] = 1.0
    return crop_from_img


def _pixel_to_normalised(height: int, width: int, device: torch.device) -> Tensor:
    """(1, 3, 3) float32 map from pixel coordinates to [-1, 1] using ``size - 1`` (kornia's convention).

    Entries computed as kornia does (``1.0 * 2.0 / (n - 1)`` in float32); the result is the same on any
    device because the numerator is a power of two (reciprocal-multiply on CUDA rounds identically).
    """
    mat = torch.tensor([[1.0, 0.0, -1.0], [0.0, 1.0, -1.0], [0.0, 0.0, 1.0]], dtype=torch.float32)
    width_denom = _NORMALISE_EPS if width == 1 else width - 1.0
    height_denom = _NORMALISE_EPS if height == 1 else height - 1.0
    mat[0, 0] = mat[0, 0] * 2.0 / width_denom
    mat[1, 1] = mat[1, 1] * 2.0 / height_denom
    return mat[None].to(device)


def _normalised_inverse(dst_from_src: Tensor, src_hw: tuple[int, int], dst_hw: tuple[int, int]) -> Tensor:
    """``src_norm_from_dst_norm`` (N, 3, 3) float32 for pixel homographies ``dst_from_src`` (N, 3, 3) f32.

    kornia 0.7.2 ``normalize_homography``: ``M_n = N_dst (M N_src^-1)`` in float32, then ``M_n^-1`` by
    ``torch.linalg.inv`` on the homographies' device.
    """
    device = dst_from_src.device
    src_norm_from_src = _pixel_to_normalised(src_hw[0], src_hw[1], device)  # (1, 3, 3)
    src_from_src_norm = torch.linalg.inv(src_norm_from_src)
    dst_norm_from_dst = _pixel_to_normalised(dst_hw[0], dst_hw[1], device)
    dst_norm_from_src_norm = dst_norm_from_dst @ (dst_from_src @ src_from_src_norm)  # (N, 3, 3)
    return torch.linalg.inv(dst_norm_from_src_norm)


def _sampling_grid(src_norm_from_dst_norm: Tensor, dst_hw: tuple[int, int]) -> Tensor:
    """grid_sample grid (N, h, w, 2) float32 from ``src_norm_from_dst_norm`` (N, 3, 3) float32.

    kornia 0.7.2: the normalised destination grid ``(k / (n - 1) - 0.5) * 2`` is mapped with one ``bmm``
    and dehomogenised as ``x * 1 / (w + 1e-8)`` (scale 1 where ``|w| <= 1e-8``).
    """
    device = src_norm_from_dst_norm.device
    dst_h, dst_w = dst_hw
    n = src_norm_from_dst_norm.shape[0]
    xs = torch.linspace(0, dst_w - 1, dst_w, device=device, dtype=torch.float32)
    ys = torch.linspace(0, dst_h - 1, dst_h, device=device, dtype=torch.float32)
    xs = (xs / (dst_w - 1) - 0.5) * 2
    ys = (ys / (dst_h - 1) - 0.5) * 2
    base = torch.stack(torch.meshgrid([xs, ys], indexing="ij"), dim=-1).permute(1, 0, 2)  # (h, w, 2)
    points = base[None].expand(n, dst_h, dst_w, 2).reshape(-1, dst_w, 2)  # (N*h, w, 2)
    points_h = F.pad(points, [0, 1], "constant", 1.0)  # (N*h, w, 3)
    mats = torch.repeat_interleave(src_norm_from_dst_norm, repeats=dst_h, dim=0)  # (N*h, 3, 3)
    mapped = torch.bmm(points_h, mats.permute(0, 2, 1))  # (N*h, w, 3)
    w_h = mapped[..., -1:]
    scale = torch.where(
        torch.abs(w_h) > _HOMOGENEOUS_EPS, 1.0 / (w_h + _HOMOGENEOUS_EPS), torch.ones_like(w_h)
    )
    grid = scale * mapped[..., :-1]  # (N*h, w, 2)
    return grid.reshape(n, dst_h, dst_w, 2)


def _warp_nchw(src: Tensor, dst_from_src: Tensor, dst_hw: tuple[int, int], mode: str) -> Tensor:
    """kornia-0.7.2-equivalent ``warp_perspective`` of ``src`` (N or 1, C, H, W) -> (N, C, h, w), zeros outside."""
    src_norm_from_dst_norm = _normalised_inverse(dst_from_src, (src.shape[-2], src.shape[-1]), dst_hw)
    return _sample(src, src_norm_from_dst_norm, dst_hw, mode)


def _sample(src: Tensor, src_norm_from_dst_norm: Tensor, dst_hw: tuple[int, int], mode: str) -> Tensor:
    """grid_sample ``src`` (N or 1, C, H, W) through normalised homographies (N, 3, 3) -> (N, C, h, w)."""
    n = src_norm_from_dst_norm.shape[0]
    grid = _sampling_grid(src_norm_from_dst_norm, dst_hw)
    if src.shape[0] != n:
        src = src.expand(n, -1, -1, -1)
    return F.grid_sample(src, grid, mode=mode, padding_mode="zeros", align_corners=False)


def warp_to_crops(
    image: Tensor,
    crop_from_img: Tensor,
    S: int = CROP_SIDE,
    mode: str = "bilinear",
    out: Tensor | None = None,
) -> Tensor:
    """Sample one image into every hypothesis' S x S crop (spec §2.6.1), one batched grid_sample.

    image: (H, W, C) float32, same device as ``crop_from_img`` (RGB as 0-255 floats, xyz in metres,
        or depth (H, W, 1) metres; 0 = invalid). crop_from_img: (N, 3, 3) float32 (``crop_windows``).
    mode: ``"bilinear"`` (RGB) or ``"nearest"`` (xyz, depth; round half to even).
    out: optional (N, S, S, C) float32 buffer (e.g. a pool view), fully overwritten and returned.
    Returns (N, S, S, C) float32; samples outside the image are 0 (bilinear: per neighbour).
    """
    assert image.ndim == 3, image.shape
    assert crop_from_img.ndim == 3 and crop_from_img.shape[1:] == (3, 3), crop_from_img.shape
    assert image.device == crop_from_img.device, (image.device, crop_from_img.device)
    assert mode in ("bilinear", "nearest"), mode
    src = image.permute(2, 0, 1)[None]  # (1, C, H, W)
    warped = _warp_nchw(src, crop_from_img, (S, S), mode)  # (N, C, S, S)
    warped = warped.permute(0, 2, 3, 1)  # (N, S, S, C)
    if out is None:
        return warped.contiguous()
    assert out.shape == warped.shape, (out.shape, warped.shape)
    out.copy_(warped)
    return out


def depth_to_xyz_batch(depth: Tensor, K: np.ndarray | Tensor, min_depth_m: float = 0.001) -> Tensor:
    """Back-project a batch of depth maps in float32 on the integer pixel grid (track-style, spec §1.3).

    depth: (B, H, W) float32 metres, 0 = invalid. K: (3, 3) intrinsics, cast to float32 (skew ignored).
    Returns (B, H, W, 3) float32 camera-frame metres: ``x = ((u - cx) * z) / fx``, ``y = ((v - cy) * z) / fy``;
    all three zero where ``z < min_depth_m``.
    """
    assert depth.ndim == 3, depth.shape
    b, h, w = depth.shape
    device = depth.device
    K32 = torch.as_tensor(K, device=device).to(torch.float32).reshape(3, 3)
    vs, us = torch.meshgrid(
        torch.arange(0, h, device=device), torch.arange(0, w, device=device), indexing="ij"
    )
    us = us.reshape(-1).float()[None]  # (1, H*W)
    vs = vs.reshape(-1).float()[None]
    zs = depth.reshape(b, -1)  # (B, H*W)
    xs = (us - K32[0, 2]) * zs / K32[0, 0]
    ys = (vs - K32[1, 2]) * zs / K32[1, 1]
    xyz = torch.stack([xs, ys, zs], dim=-1).reshape(b, h, w, 3)
    invalid = depth < min_depth_m  # zfar = inf in the reference: no upper bound
    return xyz.masked_fill(invalid[..., None], 0.0)


def scorer_real_xyz(
    depth: Tensor,
    crop_from_img: Tensor,
    K: np.ndarray | Tensor,
    S: int = CROP_SIDE,
    min_depth: float = 0.001,
    out: Tensor | None = None,
    max_pixels_per_chunk: int | None = _BACK_WARP_PIXELS_PER_CHUNK,
) -> Tensor:
    """Real xyz crops of the scorer via the reference's double warp (spec §2.6.3).

    depth: (H, W) float32 metres (filtered), 0 = invalid. crop_from_img: (N, 3, 3) float32 (ratio 1.1).
    K: (3, 3) intrinsics (used as float32). out: optional (N, S, S, 3) float32 buffer, fully overwritten.
    Returns (N, S, S, 3) float32 camera-frame metres:
    ``warp_nearest(backproject(warp_nearest(warp_nearest(depth, F), F^-1 -> H x W)), F)``, back-projection
    on the full-resolution integer pixel grid in float32, zero where the back-warped depth < ``min_depth``.

    All 3x3 matrices (``F^-1`` and kornia's normalised inverses) are computed for the whole batch at once,
    as in the reference. The full-resolution intermediate (N, H, W, 3) is built for at most
    ``max_pixels_per_chunk`` = N' * H * W pixels at a time (None: the whole batch in one go, exactly the
    reference's call structure); chunking does not change any value on the CPU.
    """
    assert depth.ndim == 2, depth.shape
    assert crop_from_img.ndim == 3 and crop_from_img.shape[1:] == (3, 3), crop_from_img.shape
    assert depth.device == crop_from_img.device, (depth.device, crop_from_img.device)
    n = crop_from_img.shape[0]
    h, w = depth.shape
    fwd_norm = _normalised_inverse(crop_from_img, (h, w), (S, S))  # (N, 3, 3)
    depth_crop = _sample(depth[None, None], fwd_norm, (S, S), "nearest")  # (N, 1, S, S)
    img_from_crop = torch.linalg.inv(crop_from_img)  # (N, 3, 3) float32 (reference: tf_to_crops.inverse())
    back_norm = _normalised_inverse(img_from_crop, (S, S), (h, w))  # (N, 3, 3)
    if out is None:
        out = torch.empty((n, S, S, 3), dtype=torch.float32, device=depth.device)
    assert out.shape == (n, S, S, 3), out.shape
    chunk = n if max_pixels_per_chunk is None else max(1, max_pixels_per_chunk // (h * w))
    for start in range(0, n, chunk):
        sl = slice(start, min(n, start + chunk))
        depth_full = _sample(depth_crop[sl], back_norm[sl], (h, w), "nearest")[:, 0]  # (n', H, W)
        xyz_full = depth_to_xyz_batch(depth_full, K, min_depth).permute(0, 3, 1, 2)  # (n', 3, H, W)
        xyz_crop = _sample(xyz_full, fwd_norm[sl], (S, S), "nearest")  # (n', 3, S, S)
        out[sl].copy_(xyz_crop.permute(0, 2, 3, 1))
    return out
