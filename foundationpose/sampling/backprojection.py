"""Depth map -> camera-frame points: the one back-projection of the package (spec §1.2 step 5, §1.3 step 3).

Register, track, the batched track lane and the scorer's double-warp reference all call
:func:`depth_to_xyz`; the Triton bilateral kernel fuses the same float32/float64 operations
(:mod:`._depth_filters_triton`) and the fast scorer path (:func:`foundationpose.crop.scorer_real_xyz`)
evaluates them at the crop pixels only, both with parity tests against this function.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from foundationpose.constants import MIN_VALID_DEPTH_M

__all__ = ["depth_to_xyz"]


def _intrinsics(K: Tensor | np.ndarray, depth: Tensor, work: torch.dtype) -> tuple[Tensor, ...]:
    """``fx, fy, cx, cy`` as ``work`` tensors on ``depth``'s device that broadcast against ``depth``:
    0-d for one (3, 3) K, (B, 1, 1) for per-image (B, 3, 3) Ks of a (B, H, W) batch.

    Device tensors, never Python scalars: CUDA turns division by a CPU scalar into multiplication by
    its reciprocal, which is not bit-identical.
    """
    K_work = torch.as_tensor(K, device=depth.device).to(work)
    if K_work.shape == (3, 3):
        return K_work[0, 0], K_work[1, 1], K_work[0, 2], K_work[1, 2]
    if depth.ndim == 3 and K_work.shape == (depth.shape[0], 3, 3):
        return (K_work[:, 0, 0, None, None], K_work[:, 1, 1, None, None],
                K_work[:, 0, 2, None, None], K_work[:, 1, 2, None, None])  # (B, 1, 1) each
    raise ValueError(
        f"K must be (3, 3), or (B, 3, 3) with B = the depth batch; got K {tuple(K_work.shape)} "
        f"for depth {tuple(depth.shape)}"
    )


def depth_to_xyz(
    depth: Tensor,
    K: Tensor | np.ndarray,
    min_depth: float = MIN_VALID_DEPTH_M,
    float64: bool = False,
) -> Tensor:
    """Back-project depth maps to camera-frame points at integer pixel centres (spec §1.2 step 5).

    ``x = ((u - cx) * z) / fx``, ``y = ((v - cy) * z) / fy``, ``z``; skew ignored (spec §0); pixels with
    ``z < float32(min_depth)`` give (0, 0, 0) (no upper bound: the reference's zfar is infinite here).

    Args:
        depth: (H, W) or (B, H, W) float32 metres (filtered depth), 0 = invalid; any device.
        K: (3, 3) intrinsics in pixels shared by every image, or (B, 3, 3) one per image of a
            (B, H, W) batch; tensor or NumPy (pass float64 for register parity).
        min_depth: validity threshold in metres (spec §2.8 "valid depth").
        float64: False -> the track path (§1.3 step 3): float32 K, float32 pixel indices, float32
            arithmetic. True -> the register path (§1.2 step 5): float64 K and arithmetic on the
            float32 depth, rounded to float32 at the end.
    Returns:
        ``xyz_cam`` (H, W, 3) or (B, H, W, 3) float32 metres on ``depth.device``; image ``i`` of a batch is
        bit-identical to ``depth_to_xyz(depth[i], K or K[i])``.
    """
    if depth.dtype != torch.float32 or depth.ndim not in (2, 3):
        raise ValueError(f"depth must be float32 (H, W) or (B, H, W), got {depth.dtype} {tuple(depth.shape)}")
    work = torch.float64 if float64 else torch.float32
    device = depth.device
    fx, fy, cx, cy = _intrinsics(K, depth, work)
    height, width = depth.shape[-2:]
    u = torch.arange(width, device=device, dtype=work)  # (W,) pixel columns
    v = torch.arange(height, device=device, dtype=work)[:, None]  # (H, 1) pixel rows
    z = depth.to(work)
    x = ((u - cx) * z) / fx
    y = ((v - cy) * z) / fy
    xyz_cam = torch.stack([x, y, z], dim=-1).to(torch.float32)  # (..., H, W, 3)
    invalid = depth < torch.tensor(np.float32(min_depth), dtype=torch.float32, device=device)
    return torch.where(invalid[..., None], torch.zeros((), dtype=torch.float32, device=device), xyz_cam)
