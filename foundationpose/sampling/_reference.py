"""Torch reference twins of the Triton depth filters (spec §2.3); also the CPU path of :mod:`.depth_filters`.

The 5x5 window filters are written as 25 shifted views of a padded image, visited in the reference order
(outer loop over column offsets du = -2..2, inner loop over row offsets dv = -2..2), so the float32 running
sums are accumulated in the same order as the reference CUDA kernels. Window positions outside the image are
*skipped*, not treated as zeros: each shifted view comes with an in-image mask. Everything runs on the input's
device with batched tensor ops; there is no per-pixel Python loop and no host read-back. With the owner's
``constants`` the float32 constants are uploaded once per device (a tensor literal per call is a blocking
host-to-device copy on CUDA); without, per call.

Callers go through :func:`foundationpose.sampling.erode_depth` / :func:`~foundationpose.sampling.bilateral_filter_depth`
(which check the input and pick this code or the kernels); these functions take a checked (B, H, W) batch.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from foundationpose.constants import MIN_VALID_DEPTH_M  # spec §2.8, §2.3 valid depth lower bound
from foundationpose.render._cache import GeometryConstants, cached

__all__ = ["BILATERAL_MEAN_GATE_M", "bilateral_filter_depth_reference", "erode_depth_reference"]

BILATERAL_MEAN_GATE_M = 0.01  # spec §2.3 step 2


def _f32(value: float, like: Tensor, constants: GeometryConstants | None) -> Tensor:
    """A 0-d float32 tensor on ``like``'s device: a float32 constant for comparisons and arithmetic.

    A device tensor rather than a Python scalar: CUDA kernels replace division by a CPU scalar
    with multiplication by its reciprocal, which is not bit-identical.
    """
    value32, device = float(np.float32(value)), like.device
    return cached(None if constants is None else constants.shapes, ("filter f32", value32, device),
                  lambda: torch.tensor(np.float32(value), dtype=torch.float32, device=device), device)


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


def erode_depth_reference(
    batch: Tensor, radius: int, depth_diff_thres: float, ratio_thres: float, zfar: float,
    constants: GeometryConstants | None = None,
) -> Tensor:
    """Mirrors ``_depth_filters_triton._erode_kernel`` (:func:`foundationpose.sampling.erode_depth` semantics).

    batch: (B, H, W) float32 metres. Returns a new (B, H, W) float32 tensor on the same device.
    """
    min_depth, far = _f32(MIN_VALID_DEPTH_M, batch, constants), _f32(zfar, batch, constants)
    thres = _f32(depth_diff_thres, batch, constants)
    bad = torch.zeros(batch.shape, dtype=torch.int32, device=batch.device)  # (B, H, W)
    total = torch.zeros(batch.shape[1:], dtype=torch.int32, device=batch.device)  # (H, W)
    for _, _, z, inside in _window(batch, radius):
        is_bad = ~_is_valid(z, min_depth, far) | ((z - batch).abs() > thres)  # (B, H, W)
        bad += is_bad & inside
        total += inside
    eroded = bad.to(torch.float32) / total.to(torch.float32) > _f32(ratio_thres, batch, constants)
    return torch.where(eroded, torch.zeros_like(batch), batch)


def bilateral_filter_depth_reference(
    batch: Tensor, radius: int, sigma_d: float, sigma_r: float, zfar: float,
    constants: GeometryConstants | None = None,
) -> Tensor:
    """Mirrors ``_depth_filters_triton._bilateral_kernel`` without the fused back-projection
    (:func:`foundationpose.sampling.bilateral_filter_depth` semantics).

    batch: (B, H, W) float32 metres (the eroded depth). Returns a new (B, H, W) float32 tensor.
    """
    min_depth, far = _f32(MIN_VALID_DEPTH_M, batch, constants), _f32(zfar, batch, constants)
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
    gate = _f32(BILATERAL_MEAN_GATE_M, batch, constants)
    two_sd2 = _f32(np.float32(2.0) * np.float32(sigma_d) * np.float32(sigma_d), batch, constants)  # float32 products
    two_sr2 = _f32(np.float32(2.0) * np.float32(sigma_r) * np.float32(sigma_r), batch, constants)
    offsets_sq = [
        float(du * du + dv * dv) for du in range(-radius, radius + 1) for dv in range(-radius, radius + 1)
    ]
    # One upload for all window offsets; device tensors keep CUDA from turning "/" into "* (1/x)".
    offsets = cached(None if constants is None else constants.shapes, ("filter offsets_sq", radius, batch.device),
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
    return torch.where(weight_sum > zero, weighted_depth_sum / weight_sum, zero)
