"""Upload one RGB-D frame and build what every refine/score step reads from it.

The stage runs the two depth filters (spec §2.3) and the back-projection (spec §1.2 step 5,
§1.3 step 3) on the frame's device. Inputs must already be validated
(:mod:`foundationpose.validate`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from foundationpose.render._cache import ConstantCache, host_key
from foundationpose.sampling import (
    bilateral_filter_depth,
    erode_depth,
    filter_depth_and_backproject,
)

__all__ = [
    "FrameBatch",
    "PreparedFrame",
    "depth_to_xyz_per_k",
    "filter_and_backproject",
    "filter_and_backproject_stacked",
    "prepare_frame",
]


# Device constants per (value, device) and per (host K, device), filled by the first call (no eviction).
_CONSTANTS = ConstantCache(64)


@dataclass(slots=True)
class PreparedFrame:
    """One frame on the compute device.

    rgb: (H, W, 3) float32, RGB order, 0..255 (the real crops are warped from it).
    depth: (H, W) float32 metres after erosion + bilateral filtering, 0 = invalid.
    xyz: (H, W, 3) float32 camera-frame points of ``depth``; (0, 0, 0) where z < 0.001.
    K: (3, 3) float64 numpy intrinsics (pixels); the crop windows use them in float64.
    """

    rgb: Tensor
    depth: Tensor
    xyz: Tensor
    K: np.ndarray

    @property
    def hw(self) -> tuple[int, int]:
        return int(self.depth.shape[0]), int(self.depth.shape[1])

    @property
    def device(self) -> torch.device:
        return self.depth.device


def prepare_frame(
    rgb: np.ndarray | Tensor,
    depth: np.ndarray | Tensor,
    K: np.ndarray,
    device: torch.device | str,
    *,
    xyz_float64: bool,
) -> PreparedFrame:
    """Upload and filter one frame.

    rgb: (H, W, 3) uint8 RGB.  depth: (H, W) float32 metres (0 = invalid).  K: (3, 3) float64.
    xyz_float64: True reproduces register's float64 back-projection (spec §1.2 step 5),
        False track's float32 one (spec §1.3 step 3).
    """
    device = torch.device(device)
    rgb_t = torch.as_tensor(rgb).to(device)
    depth_t = torch.as_tensor(depth).to(device)
    return filter_and_backproject(rgb_t, depth_t, K, xyz_float64=xyz_float64)


def filter_and_backproject(rgb: Tensor, depth: Tensor, K: np.ndarray, *, xyz_float64: bool) -> PreparedFrame:
    """Depth filters + back-projection on tensors already on the compute device.

    rgb: (H, W, 3) uint8 or float32 RGB.  depth: (H, W) float32 metres.  K: (3, 3) float64.
    """
    depth_f, xyz = filter_depth_and_backproject(depth.to(torch.float32), K, xyz_float64=xyz_float64)
    return PreparedFrame(rgb=rgb.to(torch.float32), depth=depth_f, xyz=xyz, K=np.asarray(K, dtype=np.float64))


@dataclass(slots=True)
class FrameBatch:
    """B frames of one size on the compute device, stacked, plus one :class:`PreparedFrame` (views) per frame.

    rgb: (B, H, W, 3) float32 0..255.  depth: (B, H, W) float32 metres, filtered.  xyz: (B, H, W, 3) float32.
    Ks: (B, 3, 3) float64 numpy.  frames[i] views row i of each (``frames[i].K`` = ``Ks[i]``).
    """

    rgb: Tensor
    depth: Tensor
    xyz: Tensor
    Ks: np.ndarray
    frames: list[PreparedFrame]


def _k32(K: np.ndarray, device: torch.device) -> Tensor:
    """(3, 3) float32 K on ``device``, cast as ``torch.as_tensor(K).to(float32)`` does (cached per camera)."""
    return _CONSTANTS.get(("K32", host_key(K), device),
                          lambda: torch.as_tensor(K, device=device).to(torch.float32).reshape(3, 3), device)


def depth_to_xyz_per_k(depth: Tensor, Ks: np.ndarray | Tensor, min_depth: float = 0.001) -> Tensor:
    """Track's float32 back-projection (spec §1.3 step 3) of B depth maps, each with its own K, in one pass.

    depth: (B, H, W) float32 metres.  Ks: (B, 3, 3) intrinsics (cast to float32, skew ignored).
    Returns (B, H, W, 3) float32, row i bit-identical to ``depth_to_xyz(depth[i], Ks[i], min_depth)``: the same
    element-wise float32 operations ``x = ((u - cx) * z) / fx``, ``y = ((v - cy) * z) / fy`` with per-row K
    (device tensors, never CPU scalars), all three 0 where ``z < float32(min_depth)``.
    """
    if depth.dtype != torch.float32 or depth.ndim != 3:
        raise ValueError(f"depth must be float32 (B, H, W), got {depth.dtype} {tuple(depth.shape)}")
    b, height, width = depth.shape
    device = depth.device
    if isinstance(Ks, Tensor) and Ks.device.type != "cpu":
        k32 = Ks.to(torch.float32).reshape(b, 3, 3)
    else:  # one cached device K per camera, stacked on the device: no host-to-device copy per call
        host = np.asarray(Ks.cpu().numpy() if isinstance(Ks, Tensor) else Ks).reshape(b, 3, 3)
        k32 = torch.stack([_k32(k, device) for k in host]) if b else torch.zeros((0, 3, 3), device=device)
    fx, fy = k32[:, 0, 0, None, None], k32[:, 1, 1, None, None]  # (B, 1, 1)
    cx, cy = k32[:, 0, 2, None, None], k32[:, 1, 2, None, None]
    u = torch.arange(width, device=device, dtype=torch.float32)  # (W,)
    v = torch.arange(height, device=device, dtype=torch.float32)[:, None]  # (H, 1)
    x = ((u - cx) * depth) / fx
    y = ((v - cy) * depth) / fy
    xyz = torch.stack([x, y, depth], dim=-1)
    min_z = _CONSTANTS.get(("min_z", float(np.float32(min_depth)), device),
                           lambda: torch.tensor(np.float32(min_depth), dtype=torch.float32, device=device), device)
    invalid = depth < min_z
    return torch.where(invalid[..., None], torch.zeros((), dtype=torch.float32, device=device), xyz)


def filter_and_backproject_stacked(rgb: Tensor, depth: Tensor, Ks: list[np.ndarray]) -> FrameBatch:
    """Track frames (float32 back-projection) of one size: filters and back-projection each in one batched call.

    rgb: (B, H, W, 3) uint8 or float32.  depth: (B, H, W) float32 metres.  Ks: B (3, 3) float64.
    Every frame equals ``filter_and_backproject(rgb[i], depth[i], Ks[i], xyz_float64=False)``.
    """
    assert depth.ndim == 3 and rgb.shape[:3] == depth.shape and len(Ks) == depth.shape[0], (rgb.shape, depth.shape)
    depth_f = bilateral_filter_depth(erode_depth(depth.to(torch.float32)))  # (B, H, W)
    rgb_f = rgb.to(torch.float32)
    Ks64 = np.stack([np.asarray(K, dtype=np.float64) for K in Ks]) if Ks else np.zeros((0, 3, 3))
    xyz = depth_to_xyz_per_k(depth_f, Ks64)
    frames = [PreparedFrame(rgb=rgb_f[i], depth=depth_f[i], xyz=xyz[i], K=Ks64[i]) for i in range(len(Ks))]
    return FrameBatch(rgb=rgb_f, depth=depth_f, xyz=xyz, Ks=Ks64, frames=frames)


