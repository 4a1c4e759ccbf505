"""Depth map -> camera-frame points: the one back-projection of the package (spec §1.2 step 5, §1.3 step 3).

Register, track, the batched track lane and the scorer's double-warp reference all call
:func:`depth_to_xyz`; the Triton bilateral kernel fuses the same float32/float64 operations
(:mod:`._depth_filters_triton`) and the fast scorer path (:func:`foundationpose.crop.scorer_real_xyz`)
evaluates them at the crop pixels only, both with parity tests against this function.

No host synchronisation in steady state: with the owner's ``constants`` (the estimator's
:class:`~foundationpose.render._cache.GeometryConstants`) a host K is uploaded once per camera and the
depth threshold once per device (tests/foundationpose/test_no_host_sync.py); without, both per call.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from foundationpose.constants import MIN_VALID_DEPTH_M
from foundationpose.render._cache import GeometryConstants, cached, host_key

__all__ = ["depth_to_xyz"]


def _k_work(K: np.ndarray, work: torch.dtype, device: torch.device, constants: GeometryConstants | None) -> Tensor:
    """One host (3, 3) K as ``torch.as_tensor(K).to(work)`` on ``device``, memoised per camera in ``constants``."""
    key = host_key(K)
    return cached(None if constants is None else constants.intrinsics, key and ("backproject K", work, key, device),
                  lambda: torch.as_tensor(K, device=device).to(work).clone(), device)  # never K's own memory


def _intrinsics(
    K: Tensor | np.ndarray, depth: Tensor, work: torch.dtype, constants: GeometryConstants | None
) -> tuple[Tensor, ...]:
    """``fx, fy, cx, cy`` as ``work`` tensors on ``depth``'s device that broadcast against ``depth``:
    0-d for one (3, 3) K, (B, 1, 1) for per-image (B, 3, 3) Ks of a (B, H, W) batch.

    Device tensors, never Python scalars: CUDA turns division by a CPU scalar into multiplication by
    its reciprocal, which is not bit-identical. Host Ks come from ``constants`` (one upload per camera;
    a batch stacks its cameras' device Ks, the same values as casting the stacked host array).
    """
    device = depth.device
    if isinstance(K, Tensor) and K.device.type != "cpu":
        K_work = K.to(work)
    else:
        host = K.numpy() if isinstance(K, Tensor) else np.asarray(K)
        if host.ndim == 3 and host.shape[0] > 0 and host.shape[1:] == (3, 3):
            K_work = torch.stack([_k_work(k, work, device, constants) for k in host])
        elif host.shape == (3, 3):
            K_work = _k_work(host, work, device, constants)
        else:
            K_work = torch.as_tensor(host, device=device).to(work)
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
    *,
    constants: GeometryConstants | None = None,
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
        constants: the owner's memo of the device K per camera and the threshold (None: uploaded per call).
    Returns:
        ``xyz_cam`` (H, W, 3) or (B, H, W, 3) float32 metres on ``depth.device``; image ``i`` of a batch is
        bit-identical to ``depth_to_xyz(depth[i], K or K[i])``.
    """
    if depth.dtype != torch.float32 or depth.ndim not in (2, 3):
        raise ValueError(f"depth must be float32 (H, W) or (B, H, W), got {depth.dtype} {tuple(depth.shape)}")
    work = torch.float64 if float64 else torch.float32
    device = depth.device
    fx, fy, cx, cy = _intrinsics(K, depth, work, constants)
    height, width = depth.shape[-2:]
    u = torch.arange(width, device=device, dtype=work)  # (W,) pixel columns
    v = torch.arange(height, device=device, dtype=work)[:, None]  # (H, 1) pixel rows
    z = depth.to(work)
    x = ((u - cx) * z) / fx
    y = ((v - cy) * z) / fy
    xyz_cam = torch.stack([x, y, z], dim=-1).to(torch.float32)  # (..., H, W, 3)
    # a fill, not a host-to-device copy (capturable in a CUDA graph): the same float32 threshold
    invalid = depth < torch.full((), float(np.float32(min_depth)), dtype=torch.float32, device=device)
    return torch.where(invalid[..., None], torch.zeros((), dtype=torch.float32, device=device), xyz_cam)
