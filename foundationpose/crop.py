"""Crop windows around pose hypotheses and sampling of the real image into them (spec §2.5, §2.6).

Every function here is batched over ``N`` hypotheses and device-agnostic (it runs where its tensor
inputs live). The warps reproduce kornia 0.7.2 ``warp_perspective(..., align_corners=False)`` as
the reference calls it, including its float32 path, so that nearest-neighbour picks and bilinear
weights match the reference to the last bit on the same device (spec §2.6.1): a crop pixel
``(j, i)`` samples the source at ``x = x_s * W / (W - 1) - 0.5``, ``y = y_s * H / (H - 1) - 0.5``
where ``(x_s, y_s)`` is ``crop_from_img^-1 (j, i, 1)`` dehomogenised; zero outside the source.

Launch count: no function here synchronises the host with the device (3x3 inverses use ``linalg.inv_ex``,
which computes the same values as ``linalg.inv`` without its error check), and tensors that only depend on
sizes, the device and K (normalised output grids, kornia's normalisation matrices, K on the device) are
built once by the same op sequence as before and kept in the caller's bounded memo (``constants=``: the
estimator's :class:`foundationpose.render._cache.GeometryConstants`; without one they are built per call).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from foundationpose.constants import MIN_VALID_DEPTH_M
from foundationpose.diameters import RowDiameters
from foundationpose.models.blocks import CROP_SIZE  # S, the networks' input side (spec §0, §2.8)
from foundationpose.render._cache import ConstantCache, GeometryConstants, cached, host_key
from foundationpose.render.projection import single_k

__all__ = [
    "closed_form_inverse_on",
    "crop_windows",
    "crop_sampling_grid",
    "warp_to_crops",
    "scorer_real_xyz",
]

logger = logging.getLogger(__name__)

_HOMOGENEOUS_EPS = 1e-8  # kornia convert_points_from_homogeneous
_NORMALISE_EPS = 1e-14  # kornia normal_transform_pixel, only used for a size of 1


def _shapes(constants: GeometryConstants | None) -> ConstantCache | None:
    return None if constants is None else constants.shapes


def _intrinsics(constants: GeometryConstants | None) -> ConstantCache | None:
    return None if constants is None else constants.intrinsics


def _k_float64(K: np.ndarray | Tensor, device: torch.device, constants: GeometryConstants | None) -> Tensor:
    """(3, 3) float64 K on ``device`` (cached for host K)."""

    def make() -> Tensor:
        # a copy: the memo is keyed by K's values, so it must not alias K's memory (a runner's static K buffer is
        # rewritten by every request; as_tensor shares the memory of a float64 host K)
        return torch.as_tensor(K, dtype=torch.float64, device=device).reshape(3, 3).clone()

    key = host_key(K)
    return cached(_intrinsics(constants), key and ("K64", key, device), make, device)


def _k_float32_pairs(
    K: np.ndarray | Tensor, device: torch.device, constants: GeometryConstants | None
) -> tuple[Tensor, Tensor]:
    """``([cx, cy], [fx, fy])`` as (1, 2, 1, 1) float32 tensors on ``device``, K cast like ``depth_to_xyz``."""

    def make() -> tuple[Tensor, Tensor]:
        K32 = torch.as_tensor(K, device=device).to(torch.float32).reshape(3, 3)
        return K32[:2, 2].reshape(1, 2, 1, 1).clone(), K32.diagonal()[:2].reshape(1, 2, 1, 1).clone()

    key = host_key(K)
    return cached(_intrinsics(constants), key and ("K32", key, device), make, device)


def _window_constants(
    device: torch.device, constants: GeometryConstants | None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Offsets of the 5 window points (units of r), edge signs, F's gather index and its constant entries."""

    def make() -> tuple[Tensor, Tensor, Tensor, Tensor]:
        units = torch.tensor(
            [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [-1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, -1.0, 0.0]],
            dtype=torch.float64,
            device=device,
        )
        signs = torch.tensor([[-1.0], [1.0]], dtype=torch.float64, device=device)  # (2, 1): low / high edge
        # F.view(9) from [sx, sy, ox, oy, 0, 1]
        index = torch.tensor([0, 4, 2, 4, 1, 3, 4, 4, 5], dtype=torch.int64, device=device)
        zero_one = torch.tensor([[0.0, 1.0]], dtype=torch.float32, device=device)
        return units, signs, index, zero_one

    return cached(_shapes(constants), ("window", device), make, device)


def crop_windows(
    cam_from_centred: Tensor,
    K: np.ndarray | Tensor,
    diameter: float | RowDiameters,
    crop_ratio: float,
    S: int = CROP_SIZE,
    *,
    constants: GeometryConstants | None = None,
) -> Tensor:
    """Square crop window of each hypothesis, as an image-to-crop pixel transform (spec §2.5, ``box_3d``).

    cam_from_centred: (N, 4, 4) float32 poses of the centred mesh (upstream ``ob_in_cam``); only the
        translation ``t`` is used. The window is centred on the projection of ``t`` with half-size
        ``R_px = max |proj(t ± r e_x / e_y) - proj(t)|``, ``r = diameter * crop_ratio / 2`` metres.
    K: (3, 3) intrinsics, pixels (float64 recommended: it is used in float64, full matrix incl. skew), or
        (N, 3, 3): one per hypothesis. Each hypothesis gets exactly the window the (3, 3) call with its K gives
        (a host stack of equal matrices takes the (3, 3) path; otherwise the projection is one batched matmul,
        ``K_i @ pts_i``, the same float64 dot products of length 3).
    diameter: mesh diameter in metres (python float = the float64 value), or one per hypothesis
        (:class:`foundationpose.diameters.RowDiameters`, rows of an object group: each row's radius is the scalar
        call's, ``d * crop_ratio / 2`` in float64, bit for bit). crop_ratio: 1.2 refine, 1.1 score.
    S: crop side in pixels. constants: the owner's memo of K on the device (None: uploaded per call).
    Returns ``crop_from_img`` (N, 3, 3) float32 on the poses' device:
    ``[[sx, 0, sx*(-left)], [0, sy, sy*(-top)], [0, 0, 1]]`` with ``sx = float32(S / (right - left))``.

    Steps 2-5 run in float64 (translation promoted from float32) and the edges are rounded half to even,
    as the reference does; ``F`` is assembled in float32 exactly as the reference's float32 matrix product.
    ``S / x`` is evaluated as torch evaluates a scalar divided by a tensor: ``x.reciprocal() * S``.
    """
    assert cam_from_centred.ndim == 3 and cam_from_centred.shape[1:] == (4, 4), cam_from_centred.shape
    device = cam_from_centred.device
    n = cam_from_centred.shape[0]
    units, signs, index, zero_one = _window_constants(device, constants)
    t_cam = cam_from_centred[:, :3, 3].to(torch.float64)  # (N, 3)
    if isinstance(diameter, RowDiameters):  # (N,) float64 radii; units are 0 / +-1, so r * unit is exact either way
        radius_rows = diameter.d64 * float(crop_ratio) / 2
        pts_cam = torch.addcmul(t_cam[:, None, :], units, radius_rows[:, None, None])  # (N, 5, 3)
    else:
        radius_m = float(diameter) * float(crop_ratio) / 2
        pts_cam = torch.add(t_cam[:, None, :], units, alpha=radius_m)  # (N, 5, 3): t, t ± r e_x, t ± r e_y (exact)
    k_one = single_k(K, n)
    if k_one is not None:
        projected = (_k_float64(k_one, device, constants) @ pts_cam.reshape(-1, 3).T).T  # (5N, 3)
    else:  # per-hypothesis K: (N, 3, 3) @ (N, 3, 5)
        k64 = torch.as_tensor(K, device=device).to(torch.float64)
        projected = torch.matmul(k64, pts_cam.transpose(1, 2)).transpose(1, 2).reshape(-1, 3)  # (5N, 3)
    uv_img = (projected[:, :2] / projected[:, 2:3]).reshape(n, 5, 2)  # (N, 5, 2)
    centre = uv_img[:, :1]  # (N, 1, 2)
    radius_px = (uv_img - centre).abs().amax(dim=(1, 2))  # (N,)
    # (N, 2, 2): [[left, top], [right, bottom]] = round(centre -/+ R_px), half to even
    edges = torch.round(torch.addcmul(centre, radius_px[:, None, None], signs))
    scale = ((edges[:, 1] - edges[:, 0]).reciprocal() * S).to(torch.float32)  # (N, 2): sx, sy
    offset = scale * (-edges[:, 0]).to(torch.float32)  # float32 products, like the reference's matmul
    values = torch.cat([scale, offset, zero_one.expand(n, 2)], dim=1)  # (N, 6): sx, sy, ox, oy, 0, 1
    return values[:, index].view(n, 3, 3)


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


def _normalisation_pair(
    src_hw: tuple[int, int], dst_hw: tuple[int, int], device: torch.device, constants: GeometryConstants | None
) -> tuple[Tensor, Tensor]:
    """``(N_src^-1, N_dst)``, each (1, 3, 3) float32 on ``device``; the inverse is ``linalg.inv`` there."""

    def make() -> tuple[Tensor, Tensor]:
        src_from_src_norm = torch.linalg.inv(_pixel_to_normalised(src_hw[0], src_hw[1], device))
        return src_from_src_norm, _pixel_to_normalised(dst_hw[0], dst_hw[1], device)

    return cached(_shapes(constants), ("norm", tuple(src_hw), tuple(dst_hw), device), make, device)


def closed_form_inverse_on(device: torch.device | str) -> bool:
    """Whether steps on ``device`` invert their crop windows in closed form (``affine_inverse``): on CUDA, where
    they are captured in CUDA graphs and a batched LU may not be. Elsewhere they keep the LU inverse, the reference
    path's own: LAPACK's LU rounds the shifts as ``c / a`` on some CPUs and as ``c * (1 / a)`` on others (MKL on an
    AVX-512 AMD EPYC), so only the same inverse keeps the graph runners' CPU results bit for bit the reference's."""
    return torch.device(device).type == "cuda"


def _normalised_inverse(
    dst_from_src: Tensor,
    src_hw: tuple[int, int],
    dst_hw: tuple[int, int],
    constants: GeometryConstants | None = None,
    affine: bool = False,
) -> Tensor:
    """``src_norm_from_dst_norm`` (N, 3, 3) float32 for pixel homographies ``dst_from_src`` (N, 3, 3) f32.

    kornia 0.7.2 ``normalize_homography``: ``M_n = N_dst (M N_src^-1)`` in float32, then ``M_n^-1`` by
    ``torch.linalg.inv`` on the homographies' device (here ``inv_ex``: same values, no error check / sync).
    affine: ``M`` is a crop window (scale and shift per axis, :func:`crop_windows`), so ``M_n`` is too; invert it
    in closed form (:func:`_scale_shift_inverse`) instead of by an LU factorisation, which a CUDA graph may not
    capture.
    """
    src_from_src_norm, dst_norm_from_dst = _normalisation_pair(src_hw, dst_hw, dst_from_src.device, constants)
    dst_norm_from_src_norm = dst_norm_from_dst @ (dst_from_src @ src_from_src_norm)  # (N, 3, 3)
    if affine:
        return _scale_shift_inverse(dst_norm_from_src_norm)
    return torch.linalg.inv_ex(dst_norm_from_src_norm)[0]


def _scale_shift_inverse(m: Tensor) -> Tensor:
    """Inverse of ``[[a, 0, c], [0, b, d], [0, 0, 1]]`` (N, 3, 3) float32: ``[[1/a, 0, -(c/a)], [0, 1/b, -(d/b)],
    [0, 0, 1]]``, exactly rounded (an LU inverse may round the shifts an ulp apart: :func:`closed_form_inverse_on`).
    Elementwise IEEE divisions: no factorisation, no pivots, capturable."""
    a, b, c, d = m[:, 0, 0], m[:, 1, 1], m[:, 0, 2], m[:, 1, 2]
    zero, one = torch.zeros_like(a), torch.ones_like(a)
    rows = (
        torch.stack([a.reciprocal(), zero, -(c / a)], dim=-1),
        torch.stack([zero, b.reciprocal(), -(d / b)], dim=-1),
        torch.stack([zero, zero, one], dim=-1),
    )
    return torch.stack(rows, dim=-2)


def _homogeneous_grid(
    dst_h: int, dst_w: int, device: torch.device, constants: GeometryConstants | None = None
) -> Tensor:
    """(h, w, 3) float32 ``(x_n, y_n, 1)``: kornia's normalised destination grid ``(k / (n - 1) - 0.5) * 2``."""

    def make() -> Tensor:
        xs = torch.linspace(0, dst_w - 1, dst_w, device=device, dtype=torch.float32)
        ys = torch.linspace(0, dst_h - 1, dst_h, device=device, dtype=torch.float32)
        xs = (xs / (dst_w - 1) - 0.5) * 2
        ys = (ys / (dst_h - 1) - 0.5) * 2
        base = torch.stack(torch.meshgrid([xs, ys], indexing="ij"), dim=-1).permute(1, 0, 2)  # (h, w, 2)
        return F.pad(base, [0, 1], "constant", 1.0).contiguous()

    return cached(_shapes(constants), ("grid", dst_h, dst_w, device), make, device)


def _map_points(points_h: Tensor, src_norm_from_dst_norm: Tensor, rows: int) -> Tensor:
    """kornia ``transform_points``: rows of homogeneous points (N*rows, c, 3) through (N, 3, 3) -> (N*rows, c, 2).

    One ``bmm`` against each matrix repeated ``rows`` times, then ``x * 1 / (w + 1e-8)`` (scale 1 where
    ``|w| <= 1e-8``; ``1 / v`` is evaluated as torch does, ``v.reciprocal()``).
    """
    mats = torch.repeat_interleave(src_norm_from_dst_norm, repeats=rows, dim=0)  # (N*rows, 3, 3)
    mapped = torch.bmm(points_h, mats.permute(0, 2, 1))  # (N*rows, c, 3)
    w_h = mapped[..., -1:]
    scale = torch.where(torch.abs(w_h) > _HOMOGENEOUS_EPS, (w_h + _HOMOGENEOUS_EPS).reciprocal(), 1.0)
    return scale * mapped[..., :-1]


def _sampling_grid(
    src_norm_from_dst_norm: Tensor, dst_hw: tuple[int, int], constants: GeometryConstants | None = None
) -> Tensor:
    """grid_sample grid (N, h, w, 2) float32 from ``src_norm_from_dst_norm`` (N, 3, 3) float32 (kornia 0.7.2)."""
    dst_h, dst_w = dst_hw
    n = src_norm_from_dst_norm.shape[0]
    base = _homogeneous_grid(dst_h, dst_w, src_norm_from_dst_norm.device, constants)  # (h, w, 3)
    points_h = base.expand(n, dst_h, dst_w, 3).reshape(n * dst_h, dst_w, 3)  # a view for N = 1
    return _map_points(points_h, src_norm_from_dst_norm, dst_h).reshape(n, dst_h, dst_w, 2)


def _sample(src: Tensor, src_norm_from_dst_norm: Tensor, dst_hw: tuple[int, int], mode: str) -> Tensor:
    """grid_sample ``src`` (N or 1, C, H, W) through normalised homographies (N, 3, 3) -> (N, C, h, w)."""
    return _grid_sample(src, _sampling_grid(src_norm_from_dst_norm, dst_hw), mode)


def _grid_sample(src: Tensor, grid: Tensor, mode: str) -> Tensor:
    if src.shape[0] != grid.shape[0]:
        src = src.expand(grid.shape[0], -1, -1, -1)
    return F.grid_sample(src, grid, mode=mode, padding_mode="zeros", align_corners=False)


def crop_sampling_grid(
    crop_from_img: Tensor,
    src_hw: tuple[int, int],
    S: int = CROP_SIZE,
    *,
    constants: GeometryConstants | None = None,
    affine_inverse: bool = False,
) -> Tensor:
    """The grid_sample grid (N, S, S, 2) float32 of :func:`warp_to_crops` for an (H, W) source image.

    Compute it once and pass it as ``grid=`` to warp several images of the same size with the same windows
    (e.g. the refiner's RGB and xyz); the warps are then bit-identical to warping without it.
    affine_inverse: invert the normalised windows in closed form (capturable in a CUDA graph; the same values as
    the LU inverse on the CPU, possibly an ulp apart on CUDA); only for :func:`crop_windows` windows.
    """
    assert crop_from_img.ndim == 3 and crop_from_img.shape[1:] == (3, 3), crop_from_img.shape
    inverse = _normalised_inverse(crop_from_img, tuple(src_hw), (S, S), constants, affine=affine_inverse)
    return _sampling_grid(inverse, (S, S), constants)


def warp_to_crops(
    image: Tensor,
    crop_from_img: Tensor,
    S: int = CROP_SIZE,
    mode: str = "bilinear",
    out: Tensor | None = None,
    grid: Tensor | None = None,
    *,
    constants: GeometryConstants | None = None,
    contiguous: bool = True,
) -> Tensor:
    """Sample one image into every hypothesis' S x S crop (spec §2.6.1), one batched grid_sample.

    image: (H, W, C) float32, same device as ``crop_from_img`` (RGB as 0-255 floats, xyz in metres,
        or depth (H, W, 1) metres; 0 = invalid), or (N, H, W, C): one source image per crop (e.g. the frames
        of several track sessions; each crop is sampled exactly as a separate call with its own image).
        crop_from_img: (N, 3, 3) float32 (``crop_windows``).
    mode: ``"bilinear"`` (RGB) or ``"nearest"`` (xyz, depth; round half to even).
    out: optional (N, S, S, C) float32 buffer (e.g. a pool view), fully overwritten and returned.
    grid: optional ``crop_sampling_grid(crop_from_img, (H, W), S)``, shared between warps.
    constants: the owner's memo of the size constants (None: built per call).
    contiguous: False returns (without ``out``) the (N, S, S, C) view of grid_sample's channels-first result
        instead of a contiguous copy (the same values; for consumers that read any strides, e.g. the
        network-input writers: one 4-byte-per-value pass fewer).
    Returns (N, S, S, C) float32; samples outside the image are 0 (bilinear: per neighbour).
    """
    assert crop_from_img.ndim == 3 and crop_from_img.shape[1:] == (3, 3), crop_from_img.shape
    n = crop_from_img.shape[0]
    assert image.ndim == 3 or (image.ndim == 4 and image.shape[0] == n), (image.shape, n)
    assert image.device == crop_from_img.device, (image.device, crop_from_img.device)
    assert mode in ("bilinear", "nearest"), mode
    src = image.permute(2, 0, 1)[None] if image.ndim == 3 else image.permute(0, 3, 1, 2)  # (1 or N, C, H, W)
    if grid is None:
        grid = crop_sampling_grid(crop_from_img, (src.shape[2], src.shape[3]), S, constants=constants)
    assert grid.shape == (n, S, S, 2), grid.shape
    warped = _grid_sample(src, grid, mode).permute(0, 2, 3, 1)  # (N, S, S, C)
    if out is None:
        return warped.contiguous() if contiguous else warped
    assert out.shape == warped.shape, (out.shape, warped.shape)
    out.copy_(warped)
    return out


def _pick_planes(h: int, w: int, device: torch.device, constants: GeometryConstants | None) -> Tensor:
    """(5, H, W) float32 per full-resolution pixel (u, v): ``x_n(u), y_n(v), 1, u, v``.

    ``(x_n, y_n, 1)`` is the back-warp's homogeneous grid point of the pixel (:func:`_homogeneous_grid`, the
    same values); ``u, v`` are the integer pixel coordinates as float32 (exact), as the back-projection uses them.
    """

    def make() -> Tensor:
        grid = _homogeneous_grid(h, w, device, constants).permute(2, 0, 1)  # (3, H, W)
        vs, us = torch.meshgrid(
            torch.arange(0, h, device=device), torch.arange(0, w, device=device), indexing="ij"
        )
        return torch.cat([grid, us.float()[None], vs.float()[None]], dim=0).contiguous()

    return cached(_shapes(constants), ("pick", h, w, device), make, device)


def scorer_real_xyz(
    depth: Tensor,
    crop_from_img: Tensor,
    K: np.ndarray | Tensor,
    S: int = CROP_SIZE,
    min_depth: float = MIN_VALID_DEPTH_M,
    out: Tensor | None = None,
    *,
    constants: GeometryConstants | None = None,
    grid: Tensor | None = None,
    affine_inverse: bool = False,
) -> Tensor:
    """Real xyz crops of the scorer via the reference's double warp (spec §2.6.3).

    depth: (H, W) float32 metres (filtered), 0 = invalid. crop_from_img: (N, 3, 3) float32 (ratio 1.1).
    K: (3, 3) intrinsics (used as float32). out: optional (N, S, S, 3) float32 buffer, fully overwritten (None:
    a new one with channels-first storage, returned as its (N, S, S, 3) view).
    constants: the owner's memo of the size and K constants (None: built per call).
    grid: optional ``crop_sampling_grid(crop_from_img, (H, W), S)`` (the forward warp's grid; e.g. shared with
    the scorer's RGB warp, which uses the same one).
    affine_inverse: both window inverses in closed form (:func:`_scale_shift_inverse`, capturable in a CUDA graph;
    the LU's values on the CPU, possibly an ulp apart on CUDA), as :func:`crop_sampling_grid`'s flag.
    Returns (N, S, S, 3) float32 camera-frame metres, bit-identical to
    :func:`foundationpose._reference.scorer_real_xyz_reference`, the literal
    ``warp_nearest(backproject(warp_nearest(warp_nearest(depth, F), F^-1 -> H x W)), F)`` (back-projection
    on the full-resolution integer pixel grid in float32, zero where the back-warped depth < ``min_depth``),
    but evaluated only at the S x S crop pixels instead of N x H x W:

    the last nearest warp copies, for crop pixel ``c``, the full-resolution pixel ``p(c) = (u*, v*)`` that the
    first warp picks too (same grid, same source size), or 0 when it is outside the image. So one nearest
    warp of ``[depth, x_n, y_n, 1, u, v]`` gives ``depth_B``, the back-warp's grid point at ``p(c)`` and
    ``(u*, v*)``; the back-warp grid is then evaluated at those points only (same ``bmm`` + dehomogenisation
    as the full grid) and sampled from ``depth_B``, giving ``D(p(c))``; the back-projection of
    ``(u*, v*, D)`` uses the same float32 operations as :func:`foundationpose.sampling.depth_to_xyz`.
    """
    assert depth.ndim == 2, depth.shape
    assert crop_from_img.ndim == 3 and crop_from_img.shape[1:] == (3, 3), crop_from_img.shape
    assert depth.device == crop_from_img.device, (depth.device, crop_from_img.device)
    n = crop_from_img.shape[0]
    h, w = depth.shape
    device = depth.device
    if out is None:  # channels-first storage: the writes below are per plane (an (N, S, S, 3) view is returned)
        out = torch.empty((n, 3, S, S), dtype=torch.float32, device=device).permute(0, 2, 3, 1)
    assert out.shape == (n, S, S, 3), out.shape
    if n == 0:
        return out
    if grid is None:
        fwd_grid = crop_sampling_grid(crop_from_img, (h, w), S, constants=constants, affine_inverse=affine_inverse)
    else:
        fwd_grid = grid
    assert fwd_grid.shape == (n, S, S, 2), fwd_grid.shape
    planes = torch.cat([depth[None], _pick_planes(h, w, device, constants)], dim=0)  # (6, H, W)
    picked = _grid_sample(planes[None], fwd_grid, "nearest")  # (N, 6, S, S): depth_B, x_n, y_n, 1, u*, v*
    # (N, 3, 3) float32 (reference: F.inverse())
    img_from_crop = _scale_shift_inverse(crop_from_img) if affine_inverse else torch.linalg.inv_ex(crop_from_img)[0]
    back_norm = _normalised_inverse(img_from_crop, (S, S), (h, w), constants, affine=affine_inverse)  # (N, 3, 3)
    points_h = picked[:, 1:4].permute(0, 2, 3, 1).reshape(n * S, S, 3)  # back-warp grid points at p(c)
    back_grid = _map_points(points_h, back_norm, S).reshape(n, S, S, 2)
    depth_back = _grid_sample(picked[:, 0:1], back_grid, "nearest")  # (N, 1, S, S) = D(p(c))
    centre, focal = _k_float32_pairs(K, device, constants)  # (1, 2, 1, 1): (cx, cy), (fx, fy)
    out_nchw = out.permute(0, 3, 1, 2)  # (N, 3, S, S) view
    torch.div((picked[:, 4:6] - centre) * depth_back, focal, out=out_nchw[:, 0:2])
    out_nchw[:, 2:3].copy_(depth_back)
    invalid = (depth_back < min_depth) | (picked[:, 3:4] == 0)  # no depth, or p(c) outside the image
    out_nchw.masked_fill_(invalid, 0.0)
    return out
