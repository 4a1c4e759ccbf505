"""Initial translation of the register hypotheses from depth and mask (spec §2.2).

Everything stays on the inputs' device and no value is read back to the host (no GPU sync),
except in :func:`count_valid_masked_depth`, whose result the caller needs as a Python int
(tests/foundationpose/test_no_host_sync.py checks :func:`guess_translation`).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from foundationpose.constants import MIN_VALID_DEPTH_M  # re-exported (spec §2.8 "valid depth")
from foundationpose.render._cache import GeometryConstants, cached, host_key

__all__ = ["MIN_VALID_DEPTH_M", "count_valid_masked_depth", "guess_translation"]


def _as_bool_mask(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask > 0


def _valid_masked_depth(depth: Tensor, mask: Tensor, constants: GeometryConstants | None = None) -> Tensor:
    """(H, W) bool: mask > 0 and depth >= float32(0.001)."""
    min_depth = cached(
        None if constants is None else constants.shapes,
        ("translation min_depth", depth.dtype, depth.device),
        lambda: torch.tensor(MIN_VALID_DEPTH_M, dtype=depth.dtype, device=depth.device),
        depth.device,
    )
    return _as_bool_mask(mask) & (depth >= min_depth)


def _k_inverse(K: Tensor | np.ndarray, device: torch.device, constants: GeometryConstants | None) -> Tensor:
    """(3, 3) float64 ``K^-1`` on ``device``: memoised per host K in ``constants``; without the error check
    (a host sync)."""

    def make() -> Tensor:
        K64 = torch.as_tensor(K, dtype=torch.float64, device=device).reshape(3, 3)
        return torch.linalg.inv_ex(K64).inverse  # the same LAPACK/cuSOLVER result as linalg.inv

    key = host_key(K)
    return cached(None if constants is None else constants.intrinsics, key and ("K_inv", key, device), make, device)


def count_valid_masked_depth(depth: Tensor, mask: Tensor) -> int:
    """Number of object pixels with usable depth (the register early exit, spec §1.2 step 3).

    Args:
        depth: (H, W) float32 metres (the filtered depth ``depth_f``), 0 = invalid.
        mask: (H, W) bool (or numeric, > 0 = object), same device.
    Returns:
        count of pixels with ``mask > 0`` and ``depth >= 0.001`` (register bails out below 4).
        Reads one value back from the device (a sync on CUDA).
    """
    assert depth.shape == mask.shape and depth.ndim == 2, (depth.shape, mask.shape)
    return int(_valid_masked_depth(depth, mask).sum().item())


def guess_translation(
    depth: Tensor, mask: Tensor, K: Tensor | np.ndarray, *, constants: GeometryConstants | None = None
) -> Tensor:
    """Translation placing the centred-mesh origin on the visible surface at the mask-box centre.

    ``(u_c, v_c)`` = centre of the mask's bounding box (integer pixel centres, may be a
    half-integer); ``z_c`` = median of ``depth`` over ``mask > 0 & depth >= 0.001`` (even count:
    mean of the two middle values, in float32); ``t0 = K^-1 (u_c, v_c, 1)^T z_c`` evaluated in
    float64 as the reference does, then rounded to float32.

    An empty mask, or a mask without valid depth, gives (0, 0, 0). The estimator validates the mask
    and checks :func:`count_valid_masked_depth` before calling this, so that case is reached only
    through the register early exit (spec §1.2 step 3).

    Args:
        depth: (H, W) float32 metres, camera frame depth (``depth_f``), 0 = invalid.
        mask: (H, W) bool (or numeric, > 0 = object), same device.
        K: (3, 3) intrinsics, pixels (float64 recommended for parity; any device or NumPy).
        constants: the owner's memo of ``K^-1`` per camera and the threshold (None: built per call).
    Returns:
        (3,) float32 tensor on ``depth.device``: ``cam`` frame translation in metres.
    """
    assert depth.ndim == 2 and mask.shape == depth.shape, (depth.shape, mask.shape)
    device = depth.device
    height, width = depth.shape
    obj = _as_bool_mask(mask)

    # Bounding box of the mask, without host reads: empty rows/columns are pushed out of the min/max.
    cols = torch.arange(width, device=device)
    rows = torch.arange(height, device=device)
    col_hit, row_hit = obj.any(dim=0), obj.any(dim=1)  # (W,), (H,)
    u_min = torch.where(col_hit, cols, width).min()
    u_max = torch.where(col_hit, cols, -1).max()
    v_min = torch.where(row_hit, rows, height).min()
    v_max = torch.where(row_hit, rows, -1).max()
    u_c = (u_min + u_max).to(torch.float64) / 2.0
    v_c = (v_min + v_max).to(torch.float64) / 2.0

    # True median over the valid masked depths: sort with invalid pixels pushed to +inf at the end.
    valid = _valid_masked_depth(depth, obj, constants).reshape(-1)
    count = valid.sum()
    values = torch.where(valid, depth.reshape(-1), torch.full_like(depth.reshape(-1), float("inf")))
    ordered = torch.sort(values).values
    # gather at device indices (indexing with a 0-d tensor would read it back to the host)
    middle = torch.stack([torch.clamp((count - 1) // 2, min=0), torch.clamp(count // 2, min=0)])  # (2,)
    lower, upper = ordered.index_select(0, middle).unbind()
    z_c = torch.where(count % 2 == 1, upper, (lower + upper) / 2)  # float32, like NumPy's median

    ray = torch.stack([u_c, v_c, torch.ones((), dtype=torch.float64, device=device)])  # (3,)
    t0 = (_k_inverse(K, device, constants) @ ray) * z_c.to(torch.float64)  # (3,) float64
    ok = obj.any() & (count > 0)
    return torch.where(ok, t0, torch.zeros_like(t0)).to(torch.float32)
