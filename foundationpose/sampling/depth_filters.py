"""Depth pre-filters (erosion, bilateral) and back-projection to an xyz map (spec §2.3, §1.2-§1.3).

A depth value is *valid* iff ``0.001 <= z < zfar``; all comparisons are made in float32 on the
float32 depths, which decides which neighbours exactly 1 mm apart count as "similar".
Inputs are expected to be finite (NaN compares as invalid, but a NaN centre is not zeroed by
erosion); the API's validation maps bad depth to 0 before this point.

Implementations: the torch twins in :mod:`._reference` are the reference and the CPU path. On CUDA the
filters run as two Triton kernels (:mod:`._depth_filters_triton`, same float32 operations in the same
order) when triton imports; ``impl="torch"`` forces the reference, ``impl="triton"`` forces the kernels
(on a CPU tensor they run under the Triton interpreter: slow, for tests).
:func:`filter_depth_and_backproject` runs erosion, bilateral filter and back-projection in two launches
on that path. The choice comes in as an argument ("auto" wherever the estimator and the service call these);
this module reads no environment.
``constants``: the owner's memo (the estimator's GeometryConstants) of the torch path's float32 constants
and of the back-projection's K, so that a steady-state call uploads nothing (None: uploaded per call).
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from foundationpose.constants import MIN_VALID_DEPTH_M  # spec §2.8, §2.3 valid depth lower bound
from foundationpose.render._cache import GeometryConstants

from ._reference import BILATERAL_MEAN_GATE_M, bilateral_filter_depth_reference, erode_depth_reference
from .backprojection import depth_to_xyz

__all__ = [
    "FILTER_IMPLS",
    "bilateral_filter_depth",
    "erode_depth",
    "filter_depth_and_backproject",
    "import_triton_module",
    "pick_triton_module",
]

logger = logging.getLogger(__name__)


FilterImpl = Literal["auto", "torch", "triton"]
FILTER_IMPLS: tuple[FilterImpl, ...] = ("auto", "torch", "triton")


def import_triton_module(name: str, what: str) -> ModuleType | None:
    """Import the Triton kernel module ``name``, or None where triton does not import (an ImportError, or a broken
    triton install: logged once per caller's cache, the torch twin runs). what: the kernels' name for the log."""
    try:
        return importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken triton install
        logger.info("triton %s unavailable (%s: %s); using torch", what, type(exc).__name__, exc)
        return None


@functools.cache
def _triton_filters() -> ModuleType | None:
    """The Triton kernels module, or None where triton does not import (probed once per process)."""
    return import_triton_module("foundationpose.sampling._depth_filters_triton", "depth filters")


def pick_triton_module(load: Callable[[], ModuleType | None], on_cuda: bool, impl: FilterImpl,
                       what: str) -> ModuleType | None:
    """The Triton kernel module ``load()`` gives when ``impl`` selects it, else None (the torch twin runs).

    "auto" = Triton for CUDA tensors (``on_cuda``) when triton imports; "torch" never loads it; "triton" raises
    RuntimeError when it does not import. what: the kernels' name for the messages (e.g. "depth filter").
    """
    if impl == "torch":
        return None
    if impl == "auto":
        return load() if on_cuda else None
    if impl == "triton":
        module = load()
        if module is None:
            raise RuntimeError(f"{what} impl='triton' requested but triton does not import")
        return module
    raise ValueError(f"{what} impl must be one of {', '.join(FILTER_IMPLS)}; got {impl!r}")


def _triton_for(depth: Tensor, impl: FilterImpl) -> ModuleType | None:
    return pick_triton_module(_triton_filters, depth.is_cuda, impl, "depth filter")


def _as_batch(depth: Tensor) -> tuple[Tensor, bool]:
    """(H, W) or (B, H, W) float32 -> (B, H, W), and whether a batch dim was added."""
    if depth.dtype != torch.float32:
        raise TypeError(f"depth must be float32, got {depth.dtype}")
    if depth.ndim == 2:
        return depth.unsqueeze(0), True
    if depth.ndim == 3:
        return depth, False
    raise ValueError(f"depth must be (H, W) or (B, H, W), got {tuple(depth.shape)}")


def erode_depth(
    depth: Tensor,
    radius: int = 2,
    depth_diff_thres: float = 0.001,
    ratio_thres: float = 0.8,
    zfar: float = 100.0,
    impl: FilterImpl = "auto",
    constants: GeometryConstants | None = None,
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
        impl: "torch" (reference), "triton" (kernel) or "auto" (Triton for CUDA tensors when it imports).
        constants: the owner's memo of the torch path's float32 constants (None: uploaded per call).
    Returns:
        float32 tensor of the input's shape and device.
    """
    batch, squeezed = _as_batch(depth)
    kernels = _triton_for(batch, impl)
    if kernels is not None:
        out = kernels.erode_depth_triton(
            batch, radius, depth_diff_thres, ratio_thres, zfar, min_depth=MIN_VALID_DEPTH_M
        )
        return out[0] if squeezed else out
    out = erode_depth_reference(batch, radius, depth_diff_thres, ratio_thres, zfar, constants)
    return out[0] if squeezed else out


def bilateral_filter_depth(
    depth: Tensor,
    radius: int = 2,
    sigma_d: float = 2.0,
    sigma_r: float = 100000.0,
    zfar: float = 100.0,
    impl: FilterImpl = "auto",
    constants: GeometryConstants | None = None,
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
        impl: "torch" (reference), "triton" (kernel) or "auto" (Triton for CUDA tensors when it imports).
        constants: the owner's memo of the torch path's float32 constants (None: uploaded per call).
    Returns:
        float32 tensor of the input's shape and device.
    """
    batch, squeezed = _as_batch(depth)
    kernels = _triton_for(batch, impl)
    if kernels is not None:
        out, _ = kernels.bilateral_filter_depth_triton(
            batch, radius, sigma_d, sigma_r, zfar, min_depth=MIN_VALID_DEPTH_M, gate=BILATERAL_MEAN_GATE_M
        )
        return out[0] if squeezed else out
    out = bilateral_filter_depth_reference(batch, radius, sigma_d, sigma_r, zfar, constants)
    return out[0] if squeezed else out


def filter_depth_and_backproject(
    depth: Tensor,
    K: Tensor | np.ndarray,
    *,
    xyz_float64: bool = False,
    min_depth: float = MIN_VALID_DEPTH_M,
    impl: FilterImpl = "auto",
    constants: GeometryConstants | None = None,
) -> tuple[Tensor, Tensor]:
    """Erosion, bilateral filter and back-projection with the default parameters (spec §2.3, §1.2-§1.3).

    Equals ``f = bilateral_filter_depth(erode_depth(depth))`` and ``depth_to_xyz(f, K, min_depth,
    xyz_float64)``; on the Triton path the back-projection is fused into the bilateral kernel.

    Args:
        depth: (H, W) or (B, H, W) float32 metres, 0 = invalid; any device.
        K: (3, 3) intrinsics in pixels (float64 for register parity).
        xyz_float64: True -> register's float64 back-projection (§1.2 step 5), False -> track's float32.
        min_depth: xyz validity threshold in metres.
        impl: "torch", "triton" or "auto" (Triton for CUDA tensors when it imports).
        constants: the owner's memo of the device constants and K (None: uploaded per call).
    Returns:
        ``(depth_filtered, xyz_cam)``: (H, W) / (B, H, W) float32 metres and (..., H, W, 3) float32
        camera-frame metres ((0, 0, 0) where the filtered z < min_depth), on ``depth.device``.
    """
    batch, squeezed = _as_batch(depth)
    kernels = _triton_for(batch, impl)
    if kernels is None:
        eroded = erode_depth(depth, impl="torch", constants=constants)
        filtered = bilateral_filter_depth(eroded, impl="torch", constants=constants)
        return filtered, depth_to_xyz(filtered, K, min_depth=min_depth, float64=xyz_float64, constants=constants)
    eroded = erode_depth(batch, impl="triton")
    filtered, xyz = kernels.bilateral_filter_depth_triton(
        eroded,
        radius=2,  # bilateral_filter_depth's defaults
        sigma_d=2.0,
        sigma_r=100000.0,
        zfar=100.0,
        min_depth=MIN_VALID_DEPTH_M,
        gate=BILATERAL_MEAN_GATE_M,
        K=K,
        xyz_float64=xyz_float64,
        xyz_min_depth=min_depth,
        constants=constants,
    )
    return (filtered[0], xyz[0]) if squeezed else (filtered, xyz)
