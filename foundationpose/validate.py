"""Checks of user input, shared by the three ways in: the Python API, the HTTP server and the demo loader.

Each function takes what a user may pass (NumPy arrays, or tensors, which are copied to the host),
checks it once on the host, and returns it in the one form the pipeline uses. Failures raise
``InputError`` whose message reads ``"<field>: expected <X>; got <Y>[. <hint>]"``.

Conventions checked here: RGB is uint8 (H, W, 3) in **RGB** order; depth is float metres (H, W) with
0 = no reading; the mask is (H, W), non-zero = object; ``K`` is a 3x3 pinhole matrix in pixels; poses
are 4x4 rigid object-to-camera transforms in metres.

Decisions: NaN and +inf depth (what many sensors report for "no reading") become 0 = invalid;
negative or -inf depth is rejected. Integer depth is rejected (millimetre PNGs: pass ``depth / 1000``),
as is float depth whose median valid value exceeds ``MAX_MEDIAN_DEPTH_M`` (likely millimetres).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from .constants import MIN_VALID_DEPTH_M  # re-exported: "no reading" below it (spec §2.8)
from .errors import InputError

__all__ = [
    "MIN_VALID_DEPTH_M",
    "MIN_MASKED_DEPTH_PIXELS",
    "MAX_MEDIAN_DEPTH_M",
    "validate_rgb",
    "validate_depth",
    "validate_mask",
    "validate_K",
    "validate_pose",
    "check_masked_depth",
    "validate_frame",
    "require_masked_depth_count",
]

logger = logging.getLogger(__name__)

MIN_MASKED_DEPTH_PIXELS = (
    4  # register needs at least this many valid depth pixels under the mask (spec §1.2.3)
)
MAX_MEDIAN_DEPTH_M = 50.0  # a larger median of valid depth almost surely means millimetres
_ROTATION_ATOL = 1e-4  # |R^T R - I| and |det R - 1| tolerance for user poses (float32 round trips are ~1e-7)


def _describe(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.dtype} {tuple(value.shape)}"
    return type(value).__name__


def _to_numpy(value: Any, field: str, expected: str) -> np.ndarray:
    """NumPy view/copy of arrays and tensors (tensors are detached and copied to the host)."""
    if isinstance(value, np.ndarray):
        return value
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        torch = None
    if torch is not None and isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if value is None or isinstance(value, (str, bytes, dict)):
        raise InputError(field, expected, _describe(value))
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as exc:
        raise InputError(field, expected, f"{type(value).__name__} that is not an array") from exc
    if arr.dtype == object:
        raise InputError(field, expected, "a ragged or non-numeric array")
    return arr


def _check_hw(arr: np.ndarray, field: str, expected: str, hw: tuple[int, int] | None) -> None:
    if hw is not None and tuple(arr.shape[:2]) != tuple(hw):
        raise InputError(field, f"{expected} {tuple(hw)} to match rgb", _describe(arr))


def validate_rgb(rgb: Any) -> np.ndarray:
    """Colour image -> uint8 (H, W, 3), RGB order (not checked: it cannot be; OpenCV readers give BGR).

    Accepts uint8 (H, W, 3) with H, W >= 2. Rejects other dtypes (with a hint for [0, 1] floats), alpha channels and
    grey images.
    """
    expected = "uint8 (H, W, 3) RGB"
    arr = _to_numpy(rgb, "rgb", expected)
    if arr.ndim == 3 and arr.shape[2] == 4:
        raise InputError("rgb", expected, _describe(arr), "Drop the alpha channel: rgb[..., :3]")
    if arr.ndim != 3 or arr.shape[2] != 3 or min(arr.shape[:2]) < 2:
        raise InputError("rgb", expected, _describe(arr))
    if arr.dtype != np.uint8:
        hint = None
        if arr.dtype.kind == "f":
            hint = "Float image in [0, 1]? Pass (rgb * 255).round().astype(np.uint8)"
        raise InputError("rgb", expected, _describe(arr), hint)
    return np.ascontiguousarray(arr)


def validate_depth(depth: Any, hw: tuple[int, int] | None = None) -> np.ndarray:
    """Depth map -> float32 (H, W) metres, 0 = no reading (a new array; the input is not modified).

    Accepts float16/32/64 (H, W) or (H, W, 1). NaN and +inf become 0. Rejects integer dtypes
    (millimetre PNGs), negative values, a shape that differs from ``hw`` (the rgb's (H, W)), and a
    median valid depth above ``MAX_MEDIAN_DEPTH_M`` (millimetres passed as floats).
    """
    expected = "float32 metres (H, W)"
    arr = _to_numpy(depth, "depth", expected)
    if arr.ndim == 3 and arr.shape[2] == 1:
        arr = arr[..., 0]
    if arr.dtype.kind in "iub":
        hint = "Millimetre depth? Pass depth / 1000" if arr.dtype.kind in "iu" else None
        raise InputError("depth", expected, _describe(arr), hint)
    if arr.dtype.kind != "f" or arr.ndim != 2 or min(arr.shape) < 2:
        raise InputError("depth", expected, _describe(arr))
    _check_hw(arr, "depth", expected, hw)
    out = arr.astype(np.float32, copy=True)
    if np.any(out == -np.inf) or np.any(out < 0):
        n_bad = int(np.count_nonzero(out < 0))
        raise InputError("depth", "non-negative metres (0 = no reading)", f"{n_bad} negative values")
    not_finite = ~np.isfinite(out)
    if not_finite.any():
        out[not_finite] = 0.0  # NaN / +inf: no reading
    # A unit check, not a statistic: the median of every 7th row and column is as telling and
    # costs ~1/50 of the full one (the full median was 4 ms of a 640x480 track call).
    sample = out[::7, ::7]
    valid = sample[sample >= MIN_VALID_DEPTH_M]
    if not valid.size:
        valid = out[out >= MIN_VALID_DEPTH_M]
    median = float(np.median(valid)) if valid.size else 0.0
    if median > MAX_MEDIAN_DEPTH_M:
        raise InputError(
            "depth",
            f"metres (median valid depth <= {MAX_MEDIAN_DEPTH_M:g} m)",
            f"median {median:.4g}",
            "Millimetre depth? Pass depth / 1000",
        )
    return out


def validate_mask(mask: Any, hw: tuple[int, int] | None = None) -> np.ndarray:
    """Object mask -> bool (H, W), non-zero = object. Accepts bool / integer / float (H, W) or (H, W, 1).

    Rejects multi-channel masks, a shape that differs from ``hw`` and an empty mask.
    """
    expected = "bool (H, W), non-zero = object"
    arr = _to_numpy(mask, "mask", expected)
    if arr.ndim == 3 and arr.shape[2] == 1:
        arr = arr[..., 0]
    if arr.ndim == 3:
        raise InputError("mask", expected, _describe(arr), "Pass one channel, e.g. mask[..., 0]")
    if arr.ndim != 2 or arr.dtype.kind not in "biuf":
        raise InputError("mask", expected, _describe(arr))
    _check_hw(arr, "mask", "(H, W)", hw)
    out = np.ascontiguousarray(arr > 0) if arr.dtype != np.bool_ else np.ascontiguousarray(arr)
    if not out.any():
        raise InputError("mask", "at least one object pixel", "an empty mask")
    return out


def validate_K(K: Any) -> np.ndarray:
    """Intrinsics -> float64 (3, 3) ``[[fx, s, cx], [0, fy, cy], [0, 0, 1]]`` in pixels.

    Checks shape, finiteness, ``fx, fy > 0`` and the last two rows' zeros/one. A non-zero skew ``s`` is
    accepted with a warning: the render and crop use it but back-projection ignores it (spec §0).
    """
    expected = "float (3, 3) [[fx, 0, cx], [0, fy, cy], [0, 0, 1]]"
    arr = _to_numpy(K, "K", expected)
    if arr.shape == (9,):
        raise InputError("K", expected, _describe(arr), "Row-major flat K? Pass K.reshape(3, 3)")
    if arr.shape != (3, 3) or arr.dtype.kind not in "iuf":
        raise InputError("K", expected, _describe(arr))
    out = arr.astype(np.float64)
    if not np.isfinite(out).all():
        raise InputError("K", "finite values", "NaN or inf")
    if not (out[0, 0] > 0 and out[1, 1] > 0):
        raise InputError(
            "K", "positive focal lengths fx = K[0, 0], fy = K[1, 1]", f"fx={out[0, 0]:g}, fy={out[1, 1]:g}"
        )
    if out[1, 0] != 0 or out[2, 0] != 0 or out[2, 1] != 0 or out[2, 2] != 1:
        raise InputError(
            "K",
            "last rows [0, fy, cy], [0, 0, 1]",
            f"rows {out[1].tolist()}, {out[2].tolist()}",
            "Transposed K? Pass K.T",
        )
    if out[0, 1] != 0:
        logger.warning("K has non-zero skew %g: back-projection ignores it (spec §0)", out[0, 1])
    return out


def validate_pose(pose: Any, field: str = "pose") -> np.ndarray:
    """Rigid 4x4 transform (object -> camera, metres) -> float64 (4, 4).

    Checks shape, finiteness, bottom row ``0 0 0 1`` and that ``R`` is a rotation
    (``|R^T R - I| <= 1e-4``, ``det R`` within 1e-4 of +1).
    """
    expected = "a rigid (4, 4) transform [[R, t], [0, 0, 0, 1]]"
    arr = _to_numpy(pose, field, expected)
    if arr.shape != (4, 4) or arr.dtype.kind not in "iuf":
        raise InputError(field, expected, _describe(arr))
    out = arr.astype(np.float64)
    if not np.isfinite(out).all():
        raise InputError(field, "finite values", "NaN or inf")
    if not np.array_equal(out[3], [0.0, 0.0, 0.0, 1.0]):
        raise InputError(field, "bottom row [0, 0, 0, 1]", str(out[3].tolist()))
    rot = out[:3, :3]
    ortho_err = float(np.abs(rot.T @ rot - np.eye(3)).max())
    det = float(np.linalg.det(rot))
    if ortho_err > _ROTATION_ATOL or abs(det - 1.0) > _ROTATION_ATOL:
        raise InputError(
            field,
            "a rotation in the top-left 3x3 (orthonormal, det +1)",
            f"max |R^T R - I| = {ortho_err:.3g}, det = {det:.6g}",
        )
    return out


def check_masked_depth(
    depth: np.ndarray,
    mask: np.ndarray,
    min_count: int = MIN_MASKED_DEPTH_PIXELS,
    min_depth_m: float = MIN_VALID_DEPTH_M,
) -> int:
    """Require ``min_count`` pixels with ``depth >= min_depth_m`` under the mask; return their count.

    depth: (H, W) float32 metres (validated; the reference applies this test to the *filtered* depth,
    spec §1.2 step 3, where it returns an unrefined pose instead of raising). mask: (H, W) bool.
    """
    assert depth.shape == mask.shape, (depth.shape, mask.shape)
    count = int(np.count_nonzero((depth >= np.float32(min_depth_m)) & mask))
    return require_masked_depth_count(count, min_count, min_depth_m)


def require_masked_depth_count(
    count: int,
    min_count: int = MIN_MASKED_DEPTH_PIXELS,
    min_depth_m: float = MIN_VALID_DEPTH_M,
) -> int:
    """The rule of :func:`check_masked_depth` for a count computed elsewhere (e.g. on the GPU)."""
    if count < min_count:
        raise InputError(
            "depth",
            f"at least {min_count} valid depth pixels (>= {min_depth_m:g} m) under the mask",
            f"{count}",
            "Check that depth and mask are aligned and depth is in metres",
        )
    return count


def validate_frame(rgb: Any, depth: Any, K: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The checks every register/track call makes: rgb uint8 (H, W, 3), depth float32 metres of the
    same (H, W), K float64 (3, 3). Returns the validated (rgb, depth, K)."""
    rgb = validate_rgb(rgb)
    depth = validate_depth(depth, rgb.shape[:2])
    return rgb, depth, validate_K(K)
