"""Upload one RGB-D frame and build what every refine/score step reads from it.

The stage runs the two depth filters (spec §2.3) and the back-projection (spec §1.2 step 5,
§1.3 step 3) on the frame's device. Inputs must already be validated
(:mod:`foundationpose.validate`). ``constants`` is the owner's memo (the estimator's
GeometryConstants) of the device constants and Ks, so a steady-state frame uploads only its pixels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from foundationpose.render._cache import GeometryConstants
from foundationpose.sampling import (
    FilterImpl,
    bilateral_filter_depth,
    depth_to_xyz,
    erode_depth,
    filter_depth_and_backproject,
)

__all__ = [
    "FrameBatch",
    "PreparedFrame",
    "filter_and_backproject",
    "filter_and_backproject_stacked",
    "prepare_frame",
]


@dataclass(slots=True)
class PreparedFrame:
    """One frame on the compute device.

    rgb: (H, W, 3) float32, RGB order, 0..255 (the real crops are warped from it).
    depth: (H, W) float32 metres after erosion + bilateral filtering, 0 = invalid.
    xyz_cam: (H, W, 3) float32 camera-frame points of ``depth``; (0, 0, 0) where z < 0.001.
    K: (3, 3) float64 numpy intrinsics (pixels); the crop windows use them in float64.
    """

    rgb: Tensor
    depth: Tensor
    xyz_cam: Tensor
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
    impl: FilterImpl = "auto",
    constants: GeometryConstants | None = None,
) -> PreparedFrame:
    """Upload and filter one frame.

    rgb: (H, W, 3) uint8 RGB.  depth: (H, W) float32 metres (0 = invalid).  K: (3, 3) float64.
    xyz_float64: True reproduces register's float64 back-projection (spec §1.2 step 5),
        False track's float32 one (spec §1.3 step 3).
    impl: depth-filter implementation (``EstimatorConfig.depth_filter_impl``).
    constants: the estimator's memo of device constants (None: uploaded per call).
    """
    device = torch.device(device)
    rgb_t = torch.as_tensor(rgb).to(device)
    depth_t = torch.as_tensor(depth).to(device)
    return filter_and_backproject(rgb_t, depth_t, K, xyz_float64=xyz_float64, impl=impl, constants=constants)


def filter_and_backproject(
    rgb: Tensor, depth: Tensor, K: np.ndarray, *, xyz_float64: bool, impl: FilterImpl = "auto",
    constants: GeometryConstants | None = None,
) -> PreparedFrame:
    """Depth filters + back-projection on tensors already on the compute device.

    rgb: (H, W, 3) uint8 or float32 RGB.  depth: (H, W) float32 metres.  K: (3, 3) float64.
    """
    depth_f, xyz = filter_depth_and_backproject(
        depth.to(torch.float32), K, xyz_float64=xyz_float64, impl=impl, constants=constants
    )
    return PreparedFrame(rgb=rgb.to(torch.float32), depth=depth_f, xyz_cam=xyz, K=np.asarray(K, dtype=np.float64))


@dataclass(slots=True)
class FrameBatch:
    """B frames of one size on the compute device, stacked, plus one :class:`PreparedFrame` (views) per frame.

    rgb: (B, H, W, 3) float32 0..255.  depth: (B, H, W) float32 metres, filtered.  xyz_cam: (B, H, W, 3) float32.
    Ks: (B, 3, 3) float64 numpy.  frames[i] views row i of each (``frames[i].K`` = ``Ks[i]``).
    """

    rgb: Tensor
    depth: Tensor
    xyz_cam: Tensor
    Ks: np.ndarray
    frames: list[PreparedFrame]


def filter_and_backproject_stacked(
    rgb: Tensor, depth: Tensor, Ks: list[np.ndarray], impl: FilterImpl = "auto",
    constants: GeometryConstants | None = None,
) -> FrameBatch:
    """Track frames (float32 back-projection) of one size: filters and back-projection each in one batched call.

    rgb: (B, H, W, 3) uint8 or float32.  depth: (B, H, W) float32 metres.  Ks: B (3, 3) float64.
    Every frame equals ``filter_and_backproject(rgb[i], depth[i], Ks[i], xyz_float64=False)``.
    """
    assert depth.ndim == 3 and rgb.shape[:3] == depth.shape and len(Ks) == depth.shape[0], (rgb.shape, depth.shape)
    eroded = erode_depth(depth.to(torch.float32), impl=impl, constants=constants)
    depth_f = bilateral_filter_depth(eroded, impl=impl, constants=constants)  # (B, H, W)
    rgb_f = rgb.to(torch.float32)
    Ks64 = np.stack([np.asarray(K, dtype=np.float64) for K in Ks]) if Ks else np.zeros((0, 3, 3))
    xyz = depth_to_xyz(depth_f, Ks64, constants=constants)  # (B, H, W, 3): float32, one K per frame
    frames = [PreparedFrame(rgb=rgb_f[i], depth=depth_f[i], xyz_cam=xyz[i], K=Ks64[i]) for i in range(len(Ks))]
    return FrameBatch(rgb=rgb_f, depth=depth_f, xyz_cam=xyz, Ks=Ks64, frames=frames)


