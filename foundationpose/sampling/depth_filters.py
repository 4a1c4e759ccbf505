"""Depth pre-filters (erosion, bilateral) and back-projection to an xyz map (spec §2.3, §1.2-§1.3).

The 5x5 window filters are written as 25 shifted views of a padded image, visited in the
reference order (outer loop over column offsets du = -2..2, inner loop over row offsets
dv = -2..2), so the float32 running sums are accumulated in the same order as the reference
CUDA kernels. Window positions outside the image are *skipped*, not treated as zeros: each
shifted view comes with an in-image mask. Everything runs on the input's device (CPU or CUDA)
with batched tensor ops; there is no per-pixel Python loop and no host read-back.

A depth value is *valid* iff ``0.001 <= z < zfar``; all comparisons are made in float32 on the
float32 depths, which decides which neighbours exactly 1 mm apart count as "similar".
Inputs are expected to be finite (NaN compares as invalid, but a NaN centre is not zeroed by
erosion); the API's validation maps bad depth to 0 before this point.

Implementations: the torch code below is the reference and the CPU path. On CUDA the filters run
as two Triton kernels (:mod:`._depth_filters_triton`, same float32 operations in the same order)
when triton imports; ``impl="torch"`` (or the environment variable ``FP_DEPTH_FILTER_IMPL=torch``)
forces the reference, ``impl="triton"`` forces the kernels (on a CPU tensor they run under the Triton
interpreter: slow, for tests). :func:`filter_depth_and_backproject` runs erosion, bilateral filter
and back-projection in two launches on that path.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator
from types import ModuleType
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from foundationpose.render._cache import ConstantCache, host_key
from torch import Tensor

__all__ = [
    "IMPL_ENV_VAR",
    "bilateral_filter_depth",
    "depth_to_xyz",
    "erode_depth",
    "filter_depth_and_backproject",
]

logger = logging.getLogger(__name__)
# Constant tensors per (value, device) and per (host K, device): filled by the first call (no eviction).
_CONSTANTS = ConstantCache(64)

_MIN_VALID_DEPTH_M = 0.001  # spec §2.3 valid depth lower bound
_BILATERAL_MEAN_GATE_M = 0.01  # spec §2.3 step 2

FilterImpl = Literal["auto", "torch", "triton"]
IMPL_ENV_VAR = "FP_DEPTH_FILTER_IMPL"  # default for impl=None: "auto" | "torch" | "triton"


@functools.cache
def _triton_filters() -> ModuleType | None:
    """The Triton kernels module, or None where triton does not import (probed once per process)."""
    try:
        from . import _depth_filters_triton
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken triton install
        logger.info("triton depth filters unavailable (%s: %s); using torch", type(exc).__name__, exc)
        return None
    return _depth_filters_triton


def _triton_for(depth: Tensor, impl: FilterImpl | None) -> ModuleType | None:
    """The Triton module when ``impl`` (default: $FP_DEPTH_FILTER_IMPL, else "auto") selects it for
    ``depth``, else None (torch reference). "auto" = Triton for CUDA tensors when triton imports."""
    choice = impl if impl is not None else os.environ.get(IMPL_ENV_VAR, "auto")
    if choice == "torch":
        return None
    if choice == "auto":
        return _triton_filters() if depth.is_cuda else None
    if choice == "triton":
        module = _triton_filters()
        if module is None:
            raise RuntimeError("impl='triton' requested but triton does not import")
        return module
    raise ValueError(f"depth filter impl must be 'auto', 'torch' or 'triton', got {choice!r}")


def _as_batch(depth: Tensor) -> tuple[Tensor, bool]:
    """(H, W) or (B, H, W) float32 -> (B, H, W), and whether a batch dim was added."""
    if depth.dtype != torch.float32:
        raise TypeError(f"depth must be float32, got {depth.dtype}")
    if depth.ndim == 2:
        return depth.unsqueeze(0), True
    if depth.ndim == 3:
        return depth, False
    raise ValueError(f"depth must be (H, W) or (B, H, W), got {tuple(depth.shape)}")


def _f32(value: float, like: Tensor) -> Tensor:
    """A 0-d float32 tensor on ``like``'s device: a float32 constant for comparisons and arithmetic.

    A device tensor rather than a Python scalar: CUDA kernels replace division by a CPU scalar
    with multiplication by its reciprocal, which is not bit-identical. Cached per (value, device):
    a tensor literal per call would be a blocking host-to-device copy on CUDA.
    """
    value32 = float(np.float32(value))
    return _CONSTANTS.get(
        ("f32", value32, like.device),
        lambda: torch.tensor(np.float32(value), dtype=torch.float32, device=like.device),
        like.device,
    )


def _window(depth: Tensor, radius: int) -> Iterator[tuple[int, int, Tensor, Tensor]]:
    """The window neighbours of every pixel, one offset at a time, in the reference order.

    Args:
        depth: (B, H, W) float32.
    Yields:
        ``(du, dv, neighbour, inside)`` for du = -r..r (outer), dv = -r..r (inner):
        ``neighbour`` (B, H, W) float32 = depth[b, v + dv, u + du] (0 where outside the image) and
        ``inside`` (H, W) bool = whether (v + dv, u + du) lies in the image.
    """
    _, height, width = depth.shape
    padded = F.pad(depth, (radius, radius, radius, radius))  # (B, H+2r, W+2r), pad value unused
    rows = torch.arange(height, device=depth.device)
    cols = torch.arange(width, device=depth.device)
    for du in range(-radius, radius + 1):
        col_inside = (cols + du >= 0) & (cols + du < width)  # (W,)
        for dv in range(-radius, radius + 1):
            row_inside = (rows + dv >= 0) & (rows + dv < height)  # (H,)
            inside = row_inside[:, None] & col_inside[None, :]  # (H, W)
            neighbour = padded[:, radius + dv : radius + dv + height, radius + du : radius + du + width]
            yield du, dv, neighbour, inside


def _is_valid(z: Tensor, min_depth: Tensor, zfar: Tensor) -> Tensor:
    return (z >= min_depth) & (z < zfar)


def erode_depth(
    depth: Tensor,
    radius: int = 2,
    depth_diff_thres: float = 0.001,
    ratio_thres: float = 0.8,
    zfar: float = 100.0,
    impl: FilterImpl | None = None,
) -> Tensor:
    """Zero out depth pixels that disagree with most of their window (spec §2.3, ref ``erode_depth``).

    For a pixel with depth ``z0``: ``total`` = in-image window pixels (centre included),
    ``bad`` = those that are invalid or have ``|z - z0| > depth_diff_thres``. The output is 0 where
    ``float32(bad) / float32(total) > float32(ratio_thres)``, else ``z0`` unchanged (an invalid centre
    is not zeroed by itself). All comparisons in float32.

    Args:
        depth: (H, W) or (B, H, W) float32 metres, 0 = invalid; any device.
        radius: window half-size in pixels (2 -> 5x5).
        depth_diff_thres: similarity threshold in metres (compared as float32).
        ratio_thres: bad-fraction threshold (compared as float32).
        zfar: depths >= zfar (metres) are invalid.
        impl: "torch" (reference), "triton" (kernel) or "auto"; None reads $FP_DEPTH_FILTER_IMPL.
    Returns:
        float32 tensor of the input's shape and device.
    """
    batch, squeezed = _as_batch(depth)
    kernels = _triton_for(batch, impl)
    if kernels is not None:
        out = kernels.erode_depth_triton(
            batch, radius, depth_diff_thres, ratio_thres, zfar, min_depth=_MIN_VALID_DEPTH_M
        )
        return out[0] if squeezed else out
    min_depth, far = _f32(_MIN_VALID_DEPTH_M, batch), _f32(zfar, batch)
    thres = _f32(depth_diff_thres, batch)
    bad = torch.zeros(batch.shape, dtype=torch.int32, device=batch.device)  # (B, H, W)
    total = torch.zeros(batch.shape[1:], dtype=torch.int32, device=batch.device)  # (H, W)
    for _, _, z, inside in _window(batch, radius):
        is_bad = ~_is_valid(z, min_depth, far) | ((z - batch).abs() > thres)  # (B, H, W)
        bad += is_bad & inside
        total += inside
    eroded = bad.to(torch.float32) / total.to(torch.float32) > _f32(ratio_thres, batch)
    out = torch.where(eroded, torch.zeros_like(batch), batch)
    return out[0] if squeezed else out


def bilateral_filter_depth(
    depth: Tensor,
    radius: int = 2,
    sigma_d: float = 2.0,
    sigma_r: float = 100000.0,
    zfar: float = 100.0,
    impl: FilterImpl | None = None,
) -> Tensor:
    """Edge-preserving smoothing that also fills small holes (spec §2.3, ref ``bilateral_filter_depth``).

    Per pixel, in float32: ``m`` = (running sum of the valid window depths) / (their count); the
    output is ``sum(w z) / sum(w)`` over window pixels that are valid and have ``|z - m| < 0.01``,
    with ``w = exp(-(du^2 + dv^2) / (2 sigma_d^2) - (z_centre - z)^2 / (2 sigma_r^2))``; it is 0 where
    no pixel qualifies. The centre need not be valid (holes within ``radius`` px are filled).

    Args:
        depth: (H, W) or (B, H, W) float32 metres (the eroded depth), 0 = invalid; any device.
        radius: window half-size in pixels (2 -> 5x5).
        sigma_d: spatial sigma in pixels.
        sigma_r: range sigma in metres (1e5: the range term is effectively 1).
        zfar: depths >= zfar (metres) are invalid.
        impl: "torch" (reference), "triton" (kernel) or "auto"; None reads $FP_DEPTH_FILTER_IMPL.
    Returns:
        float32 tensor of the input's shape and device.
    """
    batch, squeezed = _as_batch(depth)
    kernels = _triton_for(batch, impl)
    if kernels is not None:
        out, _ = kernels.bilateral_filter_depth_triton(
            batch, radius, sigma_d, sigma_r, zfar, min_depth=_MIN_VALID_DEPTH_M, gate=_BILATERAL_MEAN_GATE_M
        )
        return out[0] if squeezed else out
    min_depth, far = _f32(_MIN_VALID_DEPTH_M, batch), _f32(zfar, batch)
    zero = torch.zeros((), dtype=torch.float32, device=batch.device)

    # Pass 1: mean of the valid window depths (float32 running sum in the reference order).
    depth_sum = torch.zeros_like(batch)  # (B, H, W)
    count = torch.zeros(batch.shape, dtype=torch.int32, device=batch.device)
    for _, _, z, inside in _window(batch, radius):
        use = _is_valid(z, min_depth, far) & inside
        depth_sum = depth_sum + torch.where(use, z, zero)  # adding +0 leaves the sum unchanged
        count += use
    mean = depth_sum / count.to(torch.float32)  # NaN where count == 0; nothing qualifies there

    # Pass 2: Gaussian-weighted mean of the window pixels near that mean.
    gate = _f32(_BILATERAL_MEAN_GATE_M, batch)
    two_sd2 = _f32(np.float32(2.0) * np.float32(sigma_d) * np.float32(sigma_d), batch)  # float32 products
    two_sr2 = _f32(np.float32(2.0) * np.float32(sigma_r) * np.float32(sigma_r), batch)
    offsets_sq = [
        float(du * du + dv * dv) for du in range(-radius, radius + 1) for dv in range(-radius, radius + 1)
    ]
    # One upload for all window offsets; device tensors keep CUDA from turning "/" into "* (1/x)".
    offsets = _CONSTANTS.get(("offsets_sq", radius, batch.device),
                             lambda: torch.tensor(offsets_sq, dtype=torch.float32, device=batch.device), batch.device)
    spatial_all = offsets / two_sd2  # (25,)
    weight_sum = torch.zeros_like(batch)
    weighted_depth_sum = torch.zeros_like(batch)
    for k, (_, _, z, inside) in enumerate(_window(batch, radius)):
        use = _is_valid(z, min_depth, far) & inside & ((z - mean).abs() < gate)
        spatial = spatial_all[k]  # (du^2 + dv^2) / (2 sigma_d^2), same order as _window
        diff = batch - z
        weight = torch.exp(-spatial - diff * diff / two_sr2)  # (B, H, W)
        weight_sum = weight_sum + torch.where(use, weight, zero)
        weighted_depth_sum = weighted_depth_sum + torch.where(use, weight * z, zero)
    out = torch.where(weight_sum > zero, weighted_depth_sum / weight_sum, zero)
    return out[0] if squeezed else out


def depth_to_xyz(
    depth: Tensor,
    K: Tensor | np.ndarray,
    min_depth: float = 0.001,
    float64: bool = False,
) -> Tensor:
    """Back-project a depth map to camera-frame points at integer pixel centres (spec §1.2 step 5).

    ``x = ((u - cx) * z) / fx``, ``y = ((v - cy) * z) / fy``, ``z``; skew ignored; pixels with
    ``z < min_depth`` (float32 comparison) give (0, 0, 0).

    Args:
        depth: (H, W) float32 metres (filtered depth), any device. A leading batch dim (B, H, W)
            is also accepted.
        K: (3, 3) intrinsics in pixels (tensor or NumPy; pass float64 for register parity).
        min_depth: validity threshold in metres.
        float64: False -> the track path (§1.3 step 3): float32 K, float32 pixel indices, float32
            arithmetic. True -> the register path (§1.2 step 5): float64 K and arithmetic on the
            float32 depth, rounded to float32 at the end.
    Returns:
        (H, W, 3) (or (B, H, W, 3)) float32 ``xyz_cam`` in metres on ``depth.device``.
    """
    if depth.dtype != torch.float32 or depth.ndim not in (2, 3):
        raise ValueError(f"depth must be float32 (H, W) or (B, H, W), got {depth.dtype} {tuple(depth.shape)}")
    work = torch.float64 if float64 else torch.float32
    device = depth.device
    key = host_key(K)

    def make_k() -> Tensor:
        return torch.as_tensor(K, device=device).to(work).reshape(3, 3)

    K_work = make_k() if key is None else _CONSTANTS.get(("K", work, key, device), make_k, device)
    fx, fy, cx, cy = K_work[0, 0], K_work[1, 1], K_work[0, 2], K_work[1, 2]
    height, width = depth.shape[-2:]
    u = torch.arange(width, device=device, dtype=work)  # (W,) pixel columns
    v = torch.arange(height, device=device, dtype=work)[:, None]  # (H, 1) pixel rows
    z = depth.to(work)
    x = ((u - cx) * z) / fx
    y = ((v - cy) * z) / fy
    xyz = torch.stack([x, y, z], dim=-1).to(torch.float32)  # (..., H, W, 3)
    invalid = depth < _f32(min_depth, depth)
    return torch.where(invalid[..., None], torch.zeros((), dtype=torch.float32, device=device), xyz)


def filter_depth_and_backproject(
    depth: Tensor,
    K: Tensor | np.ndarray,
    *,
    xyz_float64: bool = False,
    min_depth: float = 0.001,
    impl: FilterImpl | None = None,
) -> tuple[Tensor, Tensor]:
    """Erosion, bilateral filter and back-projection with the default parameters (spec §2.3, §1.2-§1.3).

    Equals ``f = bilateral_filter_depth(erode_depth(depth))`` and ``depth_to_xyz(f, K, min_depth,
    xyz_float64)``; on the Triton path the back-projection is fused into the bilateral kernel.

    Args:
        depth: (H, W) or (B, H, W) float32 metres, 0 = invalid; any device.
        K: (3, 3) intrinsics in pixels (float64 for register parity).
        xyz_float64: True -> register's float64 back-projection (§1.2 step 5), False -> track's float32.
        min_depth: xyz validity threshold in metres.
        impl: "torch", "triton" or "auto"; None reads $FP_DEPTH_FILTER_IMPL.
    Returns:
        ``(depth_filtered, xyz_cam)``: (H, W) / (B, H, W) float32 metres and (..., H, W, 3) float32
        camera-frame metres ((0, 0, 0) where the filtered z < min_depth), on ``depth.device``.
    """
    batch, squeezed = _as_batch(depth)
    kernels = _triton_for(batch, impl)
    if kernels is None:
        filtered = bilateral_filter_depth(erode_depth(depth, impl="torch"), impl="torch")
        return filtered, depth_to_xyz(filtered, K, min_depth=min_depth, float64=xyz_float64)
    eroded = erode_depth(batch, impl="triton")
    filtered, xyz = kernels.bilateral_filter_depth_triton(
        eroded,
        radius=2,  # bilateral_filter_depth's defaults
        sigma_d=2.0,
        sigma_r=100000.0,
        zfar=100.0,
        min_depth=_MIN_VALID_DEPTH_M,
        gate=_BILATERAL_MEAN_GATE_M,
        K=K,
        xyz_float64=xyz_float64,
        xyz_min_depth=min_depth,
    )
    return (filtered[0], xyz[0]) if squeezed else (filtered, xyz)
