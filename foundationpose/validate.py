"""Checks of user input, shared by the three ways in: the Python API, the HTTP server and the demo loader.

(One module of ~600 lines on purpose: every rule and its message lives here once, so the ways in cannot disagree.)

Each function takes what a user may pass (NumPy arrays, or tensors, which are copied to the host),
checks it once on the host, and returns it in the one form the pipeline uses. Failures raise
``InputError`` whose message reads ``"<field>: expected <X>; got <Y>[. <hint>]"``.

Conventions checked here: RGB is uint8 (H, W, 3) in **RGB** order; depth is float metres (H, W) with
0 = no reading; the mask is (H, W), non-zero = object; ``K`` is a 3x3 pinhole matrix in pixels; poses
are 4x4 rigid object-to-camera transforms in metres.

Decisions: NaN and +inf depth (what many sensors report for "no reading") become 0 = invalid;
negative or -inf depth is rejected. Integer depth is rejected (millimetre PNGs: pass ``depth / 1000``),
as is float depth whose median valid value exceeds ``MAX_MEDIAN_DEPTH_M`` (likely millimetres) and a map whose
every reading is nearer than ``MIN_FARTHEST_DEPTH_M`` (metres written as millimetres).
``K`` must be plausible for the image it comes with (focal lengths within ``K_FOCAL_RANGE``, the principal point
inside the image, see :func:`validate_K`); user poses must lie within the working
range (``InputLimits.max_translation_m``).

A request is validated once, by :func:`register_request` or :func:`track_request`, into a frozen
:class:`RegisterRequest` / :class:`TrackRequest` in the pipeline's form; the estimator, the service, the
server and the demo all consume those. The one rule that needs the *filtered* depth (valid masked depth,
spec §1.2 step 3) is applied where the filtered depth exists, by :func:`masked_depth_count` (on the
device) and :func:`require_masked_depth_count` (on the host).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from .constants import MIN_VALID_DEPTH_M  # re-exported: "no reading" below it (spec §2.8)
from .errors import InputError

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "K_FOCAL_RANGE",
    "MAX_MEDIAN_DEPTH_M",
    "MAX_TRANSLATION_M",
    "MIN_FARTHEST_DEPTH_M",
    "MIN_MASKED_DEPTH_PIXELS",
    "MIN_VALID_DEPTH_M",
    "InputLimits",
    "RegisterRequest",
    "TrackRequest",
    "check_image_sizes",
    "depth_in_range",
    "frame_images",
    "masked_depth_count",
    "register_request",
    "require_masked_depth_count",
    "track_request",
    "validate_K",
    "validate_depth",
    "validate_iterations",
    "validate_mask",
    "validate_pose",
    "validate_rgb",
]

logger = logging.getLogger(__name__)

MIN_MASKED_DEPTH_PIXELS = (
    4  # register needs at least this many valid depth pixels under the mask (spec §1.2.3)
)
MAX_MEDIAN_DEPTH_M = 50.0  # a larger median of valid depth almost surely means millimetres
MAX_TRANSLATION_M = 50.0  # default working range of user poses: |t| beyond the farthest plausible depth reading
# A map whose farthest reading is nearer than this is metres written as millimetres (a 16-bit PNG of 1-2 "mm"):
# no RGB-D sensor reads within 2 cm, and such a frame ends in a pose behind the camera, not in an error.
MIN_FARTHEST_DEPTH_M = 0.02
# Plausible intrinsics relative to the image's longer side L: L / 100 <= fx, fy <= 100 L spans fields of view
# from ~178 deg down to ~0.6 deg; the principal point lies inside the image (a K of another image size does not).
K_FOCAL_RANGE = (0.01, 100.0)
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


def _hw_of(value: Any) -> tuple[int, int] | None:
    """(H, W) of an array or tensor of at least two dimensions; None for anything else (its own check reports it)."""
    shape = getattr(value, "shape", None)
    if shape is None or len(shape) < 2:
        return None
    return int(shape[0]), int(shape[1])


def _dtype_name(value: Any) -> str:
    return str(getattr(value, "dtype", type(value).__name__)).removeprefix("torch.")


def _centre_offset(K: Any, hw: tuple[int, int]) -> float | None:
    """How far K's principal point lies from the centre of an image of ``hw``, as a share of its sides (0: the
    centre; 0.5: an edge); None for a K that is no finite 3x3 (validate_K reports it)."""
    try:
        arr = np.asarray(K.detach().cpu() if hasattr(K, "detach") else K, dtype=np.float64)
    except (TypeError, ValueError):
        return None
    if arr.shape != (3, 3) or not np.isfinite(arr).all():
        return None
    h, w = hw
    return max(abs(arr[0, 2] - (w - 1) / 2) / w, abs(arr[1, 2] - (h - 1) / 2) / h)


def _names(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _hw_text(hw: tuple[int, int]) -> str:
    return f"{hw[0]}x{hw[1]}"


def check_image_sizes(rgb: Any, depth: Any, mask: Any = None, K: Any = None, *,
                      received: Mapping[str, str] | None = None) -> None:
    """InputError unless rgb, depth and mask (when given) are of one (H, W): it names the image whose size disagrees
    with the others and with the size K's principal point implies (the rgb's, when nothing tells them apart) and
    says plainly which image is which size.

    received: how each image came, for the message (e.g. ``{"depth": "16-bit PNG (uint16 millimetres)"}``: the
    server's decoded arrays are no longer what the client sent); default: the array's dtype.
    """
    images = {name: value for name, value in (("rgb", rgb), ("depth", depth), ("mask", mask)) if value is not None}
    sizes = {name: hw for name, value in images.items() if (hw := _hw_of(value)) is not None}
    distinct = list(dict.fromkeys(sizes.values()))
    if len(distinct) < 2:
        return
    votes = {hw: sum(1 for size in sizes.values() if size == hw) for hw in distinct}
    offsets = {hw: off for hw in distinct if (off := _centre_offset(K, hw)) is not None}
    k_size = None
    if offsets:
        nearest = min(offsets, key=offsets.__getitem__)
        if offsets[nearest] < 0.15 and all(offsets[hw] >= 0.25 for hw in offsets if hw != nearest):
            k_size = nearest  # K's principal point is near this size's centre, outside the others' middle half
            votes[nearest] += 1
    top = max(votes.values())
    winners = [hw for hw in distinct if votes[hw] == top]
    agreed = sizes["rgb"] if sizes.get("rgb") in winners else winners[0]  # a tie: the rgb's size, as before
    odd = next(name for name in ("rgb", "depth", "mask") if name in sizes and sizes[name] != agreed)
    backers = [name for name, hw in sizes.items() if hw == agreed] + (["K"] if k_size == agreed else [])
    what = (received or {}).get(odd) or f"{_dtype_name(images[odd])} array"
    others = [name for name in sizes if name != odd]
    by_size: dict[tuple[int, int], list[str]] = {}
    for name in others:
        by_size.setdefault(sizes[name], []).append(name)
    rest = "; ".join(f"{_names(names)} {'is' if len(names) == 1 else 'are'} {_hw_text(hw)}"
                     for hw, names in by_size.items())
    raise InputError(
        odd,
        f"the size of {_names(backers)}, {_hw_text(agreed)} (HxW)",
        f"a {_hw_text(sizes[odd])} {what}",
        f"{odd} is {_hw_text(sizes[odd])} while {rest}: send every image at one size (resize them together, and "
        "scale K with them)",
    )


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


def depth_in_range(depth: np.ndarray) -> bool:
    """Whether a float depth map is finite, non-negative, at most ``MAX_MEDIAN_DEPTH_M`` everywhere and (unless it
    has no reading) reaches ``MIN_FARTHEST_DEPTH_M`` somewhere: the common case, which :func:`validate_depth`
    accepts as it is. float32: one reduction (:func:`_float32_in_range`, with the
    two-reduction rule where it says no); other dtypes: two reductions without temporaries (a NaN fails both)."""
    if depth.dtype == np.float32 and _float32_in_range(depth):
        return True
    return _bounds_in_range(depth.min(), depth.max())


# The bits of the largest accepted depth: for float32, +0 <= x <= MAX (finite) exactly when x's bits, read as an
# unsigned int, are at most these (positive floats order like their bits; a sign bit, NaN or inf reads larger).
_MAX_DEPTH_BITS = int(np.array(MAX_MEDIAN_DEPTH_M, dtype=np.float32).view(np.uint32))


_MIN_FARTHEST_BITS = int(np.array(MIN_FARTHEST_DEPTH_M, dtype=np.float32).view(np.uint32))


def _float32_in_range(depth: np.ndarray) -> bool:
    """A one-reduction sufficient test of :func:`_bounds_in_range` for a float32 map: its largest bit pattern (for
    non-negative floats, the largest value). One pass instead of min and max, and one GIL release and retake instead
    of two (NumPy drops the GIL for each large reduction; under many busy threads each retake can wait a whole switch
    interval). False also for -0.0, which the two-reduction rule accepts: callers fall back to it."""
    bits = int(depth.view(np.uint32).max())
    return bits <= _MAX_DEPTH_BITS and (bits == 0 or bits >= _MIN_FARTHEST_BITS)


def _bounds_in_range(lo: Any, hi: Any) -> bool:
    """:func:`depth_in_range`'s rule on a map's minimum and maximum (a NaN fails both comparisons): non-negative,
    no farther than ``MAX_MEDIAN_DEPTH_M``, and either empty or reaching ``MIN_FARTHEST_DEPTH_M``."""
    return bool(lo >= 0 and hi <= MAX_MEDIAN_DEPTH_M and (hi == 0 or hi >= MIN_FARTHEST_DEPTH_M))


def validate_depth(depth: Any, hw: tuple[int, int] | None = None, *, owned: bool = False,
                   in_range: bool = False, borrow: bool = False) -> np.ndarray:
    """Depth map -> float32 (H, W) metres, 0 = no reading (a new array; the input is not modified).

    Accepts float16/32/64 (H, W) or (H, W, 1). NaN and +inf become 0. Rejects integer dtypes
    (millimetre PNGs), negative values, a shape that differs from ``hw`` (the rgb's (H, W)), and a
    median valid depth above ``MAX_MEDIAN_DEPTH_M`` (millimetres passed as floats), and a map whose every reading
    is nearer than ``MIN_FARTHEST_DEPTH_M`` (metres written to a millimetre PNG).
    owned: the caller hands the array over (e.g. the server's own decode): a writeable C-contiguous float32
    array is then checked and returned itself, without the copy (NaN / +inf are zeroed in it).
    in_range: the caller found :func:`depth_in_range` true for exactly this array (an ingest worker, before
    handing the frame over): only its type and shape are checked here, and an owned float32 array is returned
    as it is.
    borrow: the caller copies the result before it returns and never writes it (a track request staged in its own
    thread): a float32 map in range is returned as it is, without the copy; anything else is copied as usual, so
    zeroing NaN never touches the caller's array.
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
    reuse = owned and arr.dtype == np.float32 and arr.flags.writeable and arr.flags.c_contiguous
    if in_range and reuse:
        return arr
    # One reduction decides the common case (on the input: a float32 copy has the same bits); anything else takes
    # the exact element-wise path (the per-element passes were most of a track's host time).
    fast = arr.dtype == np.float32 and _float32_in_range(arr)
    if fast and (reuse or borrow):
        return arr  # owned, or read once by the caller's own copy: nothing to fix, nothing to copy
    out = arr if reuse else arr.astype(np.float32, copy=True)
    if fast or (arr.dtype != np.float32 and _float32_in_range(out)):
        return out
    lo, hi = out.min(), out.max()
    if _bounds_in_range(lo, hi):
        return out
    if not (lo >= 0 and hi < np.inf):
        if np.any(out == -np.inf) or np.any(out < 0):
            n_bad = int(np.count_nonzero(out < 0))
            raise InputError("depth", "non-negative metres (0 = no reading)", f"{n_bad} negative values")
        not_finite = ~np.isfinite(out)
        if not_finite.any():
            out[not_finite] = 0.0  # NaN / +inf: no reading
            hi = out.max()
    if 0 < hi < MIN_FARTHEST_DEPTH_M:
        raise InputError(
            "depth",
            f"metres, the farthest reading at least {MIN_FARTHEST_DEPTH_M:g} m",
            f"every reading within {float(hi) * 1000:.3g} mm of the camera",
            "Depth in metres saved as millimetres? A 16-bit depth PNG holds millimetres: write round(depth_m * 1000)",
        )
    if hi <= MAX_MEDIAN_DEPTH_M:  # no median can exceed the maximum (NaN / inf compare False and go on)
        return out
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


def validate_K(K: Any, hw: tuple[int, int] | None = None) -> np.ndarray:
    """Intrinsics -> float64 (3, 3) ``[[fx, s, cx], [0, fy, cy], [0, 0, 1]]`` in pixels.

    Checks shape, finiteness, ``fx, fy > 0`` and the last two rows' zeros/one. With ``hw`` (the image's
    (H, W)) also plausibility for that image: ``fx, fy`` within ``K_FOCAL_RANGE`` times its longer side, the
    principal point inside the image. A non-zero
    skew ``s`` is accepted with a warning: the render and crop use it but back-projection ignores it (spec §0).
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
    fx, fy, cx, cy = out[0, 0], out[1, 1], out[0, 2], out[1, 2]
    if not (fx > 0 and fy > 0):
        raise InputError("K", "positive focal lengths fx = K[0, 0], fy = K[1, 1]", f"fx={fx:g}, fy={fy:g}")
    if out[1, 0] != 0 or out[2, 0] != 0 or out[2, 1] != 0 or out[2, 2] != 1:
        raise InputError(
            "K",
            "last rows [0, fy, cy], [0, 0, 1]",
            f"rows {out[1].tolist()}, {out[2].tolist()}",
            "Transposed K? Pass K.T",
        )
    if hw is not None:
        _check_K_plausible(fx, fy, cx, cy, hw)
    if out[0, 1] != 0:
        logger.warning("K has non-zero skew %g: back-projection ignores it", out[0, 1])  # spec §0
    return out


def _check_K_plausible(fx: float, fy: float, cx: float, cy: float, hw: tuple[int, int]) -> None:
    """Refuse intrinsics no camera of this image size has (they end in NaN poses, not in an answer)."""
    h, w = hw
    side = max(h, w)
    lo, hi = K_FOCAL_RANGE[0] * side, K_FOCAL_RANGE[1] * side
    if not (lo <= fx <= hi and lo <= fy <= hi):
        raise InputError(
            "K",
            f"focal lengths fx, fy in pixels between {lo:g} and {hi:g} for a {w}x{h} image",
            f"fx={fx:g}, fy={fy:g}",
            "K in pixels of this image? Scale K with the image when resizing",
        )
    if not (0 < cx < w and 0 < cy < h):
        hint = "K for another image size?"
        if 0 < cx < 5e5 and 0 < cy < 5e5:
            hint += f" (cx, cy) is the centre of a {2 * cx:.0f}x{2 * cy:.0f} image"
        raise InputError(
            "K",
            f"the principal point (cx, cy) inside the {w}x{h} image (0 < cx < {w}, 0 < cy < {h})",
            f"cx={cx:g}, cy={cy:g}",
            hint,
        )


def validate_pose(pose: Any, field: str = "pose", max_translation_m: float | None = MAX_TRANSLATION_M) -> np.ndarray:
    """Rigid 4x4 transform (object -> camera, metres) -> float64 (4, 4).

    Checks shape, finiteness, bottom row ``0 0 0 1``, that ``R`` is a rotation
    (``|R^T R - I| <= 1e-4``, ``det R`` within 1e-4 of +1) and that ``|t| <= max_translation_m``
    (the working range; None = no limit).
    """
    expected = "a rigid (4, 4) transform [[R, t], [0, 0, 0, 1]]"
    arr = _to_numpy(pose, field, expected)
    if arr.shape != (4, 4) or arr.dtype.kind not in "iuf":
        raise InputError(field, expected, _describe(arr))
    out = arr.astype(np.float64)
    ortho_err, det, distance, finite = _rigid_numbers(out)
    if not finite:
        raise InputError(field, "finite values", "NaN or inf")
    if out[3].tolist() != [0.0, 0.0, 0.0, 1.0]:
        raise InputError(field, "bottom row [0, 0, 0, 1]", str(out[3].tolist()))
    if ortho_err > _ROTATION_ATOL or abs(det - 1.0) > _ROTATION_ATOL:
        raise InputError(
            field,
            "a rotation in the top-left 3x3 (orthonormal, det +1)",
            f"max |R^T R - I| = {ortho_err:.3g}, det = {det:.6g}",
        )
    if max_translation_m is not None and distance > max_translation_m:
        raise InputError(
            field,
            f"a translation within the working range |t| <= {max_translation_m:g} m",
            f"|t| = {distance:.4g} m",
            "Translation in millimetres? Poses are in metres",
        )
    return out


def _rigid_numbers(pose: np.ndarray) -> tuple[float, float, float, bool]:
    """(max |R^T R - I|, det R, |t|, all 16 entries finite) of a float64 (4, 4) pose, in Python floats.

    Every track of a session re-checks its pose, and NumPy's per-call overhead on 3x3 arrays (~10 us for these
    four numbers) is paid on the server's busiest thread; the same arithmetic on 16 floats costs ~2 us.
    :func:`_rigid_numbers_reference` is the NumPy twin (a parity test holds them together).
    """
    values = pose.ravel().tolist()
    if not all(map(math.isfinite, values)):
        return math.inf, math.nan, math.inf, False
    r00, r01, r02, t0, r10, r11, r12, t1, r20, r21, r22, t2 = values[:12]
    cols = ((r00, r10, r20), (r01, r11, r21), (r02, r12, r22))
    ortho_err = max(abs(a[0] * b[0] + a[1] * b[1] + a[2] * b[2] - (1.0 if i == j else 0.0))
                    for i, a in enumerate(cols) for j, b in enumerate(cols))
    det = r00 * (r11 * r22 - r12 * r21) - r01 * (r10 * r22 - r12 * r20) + r02 * (r10 * r21 - r11 * r20)
    return ortho_err, det, math.sqrt(t0 * t0 + t1 * t1 + t2 * t2), True


def _rigid_numbers_reference(pose: np.ndarray) -> tuple[float, float, float, bool]:
    """:func:`_rigid_numbers` in NumPy: the readable twin its parity test compares with."""
    if not np.isfinite(pose).all():
        return math.inf, math.nan, math.inf, False
    rot = pose[:3, :3]
    ortho_err = float(np.abs(rot.T @ rot - np.eye(3)).max())
    return ortho_err, float(np.linalg.det(rot)), float(np.linalg.norm(pose[:3, 3])), True


def masked_depth_count(depth: Tensor, mask: Tensor, min_depth_m: float = MIN_VALID_DEPTH_M) -> Tensor:
    """Pixels with ``depth >= min_depth_m`` under the mask, as a 0-d int64 tensor on the depth's device
    (no host sync; CPU tensors work the same).

    depth: (H, W) float32 metres, the *filtered* depth: the reference applies the rule after the depth
    filters (spec §1.2 step 3), which fill small holes, so the raw depth may have fewer valid pixels.
    mask: (H, W) bool, same device. The comparison is in float32. Read the count where the host reads
    anyway (one sync) and pass it to :func:`require_masked_depth_count`.
    """
    assert depth.shape == mask.shape, (tuple(depth.shape), tuple(mask.shape))
    return ((depth >= min_depth_m) & mask).sum()


def require_masked_depth_count(
    count: int,
    min_count: int = MIN_MASKED_DEPTH_PIXELS,
    min_depth_m: float = MIN_VALID_DEPTH_M,
) -> int:
    """The valid-masked-depth rule (spec §1.2 step 3) on a count from :func:`masked_depth_count`."""
    if count < min_count:
        raise InputError(
            "depth",
            f"at least {min_count} valid depth pixels (>= {min_depth_m:g} m) under the mask",
            f"{count}",
            "Check that depth and mask are aligned and depth is in metres",
        )
    return count


def validate_iterations(iterations: Any) -> int | None:
    """Refine iterations of one call: None (the configured default) or an int >= 1."""
    if iterations is None:
        return None
    if isinstance(iterations, bool) or not isinstance(iterations, (int, np.integer)):
        raise InputError("iterations", "an int >= 1, or None", type(iterations).__name__)
    if iterations < 1:
        raise InputError("iterations", "an int >= 1, or None", str(int(iterations)))
    return int(iterations)


# -- requests: validated once, consumed by the estimator, the service, the server and the demo --------------


@dataclass(frozen=True, slots=True, kw_only=True)
class InputLimits:
    """Limits a way in applies on top of the value rules.

    max_image_hw: largest (H, W) (the service's pool capacity); None = any size.
    max_translation_m: working range of user poses, ``|t|`` in metres; None = no limit.
    """

    max_image_hw: tuple[int, int] | None = None
    max_translation_m: float | None = MAX_TRANSLATION_M

    def __post_init__(self) -> None:
        if self.max_translation_m is not None and not self.max_translation_m > 0:
            raise ValueError(f"max_translation_m must be > 0 or None, got {self.max_translation_m!r}")


def _check_normalised(rgb: np.ndarray, depth: np.ndarray, K: np.ndarray) -> None:
    """Programmer-error checks of a request's invariants (O(1): the values were validated by the builders)."""
    assert rgb.dtype == np.uint8 and rgb.ndim == 3 and rgb.shape[2] == 3 and rgb.flags.c_contiguous, rgb.shape
    assert depth.dtype == np.float32 and depth.shape == rgb.shape[:2] and depth.flags.c_contiguous, depth.shape
    assert K.dtype == np.float64 and K.shape == (3, 3), K.shape


@dataclass(frozen=True, slots=True, kw_only=True)
class RegisterRequest:
    """A validated register call (build it with :func:`register_request`).

    rgb: (H, W, 3) uint8 RGB, C-contiguous.  depth: (H, W) float32 metres, 0 = no reading (raw: the
    filters run on the device).  mask: (H, W) bool.  K: (3, 3) float64 pixels, plausible for (H, W).
    iterations: refine iterations (None = the configured default). The object's symmetries are the object's own
    (``ObjectModel.symmetry``).
    """

    rgb: np.ndarray
    depth: np.ndarray
    mask: np.ndarray
    K: np.ndarray
    iterations: int | None = None

    def __post_init__(self) -> None:
        _check_normalised(self.rgb, self.depth, self.K)
        assert self.mask.dtype == np.bool_ and self.mask.shape == self.depth.shape, self.mask.shape

    @property
    def hw(self) -> tuple[int, int]:
        return int(self.depth.shape[0]), int(self.depth.shape[1])


@dataclass(frozen=True, slots=True, kw_only=True)
class TrackRequest:
    """A validated track call (build it with :func:`track_request`).

    rgb, depth, K: as in :class:`RegisterRequest`.  prev_pose: (4, 4) float64, ``cam_from_mesh`` or, with
    ``prev_frame="centred"``, ``cam_from_centred`` (the float32 tracking state of a previous result).
    iterations: refine iterations (None = the configured default).
    """

    rgb: np.ndarray
    depth: np.ndarray
    K: np.ndarray
    prev_pose: np.ndarray
    prev_frame: Literal["mesh", "centred"] = "mesh"
    iterations: int | None = None

    def __post_init__(self) -> None:
        _check_normalised(self.rgb, self.depth, self.K)
        assert self.prev_pose.dtype == np.float64 and self.prev_pose.shape == (4, 4), self.prev_pose.shape
        assert self.prev_frame in ("mesh", "centred"), self.prev_frame

    @property
    def hw(self) -> tuple[int, int]:
        return int(self.depth.shape[0]), int(self.depth.shape[1])


_NO_LIMITS = InputLimits()


def _rgb_within(rgb: Any, max_image_hw: tuple[int, int] | None) -> np.ndarray:
    rgb = validate_rgb(rgb)
    h, w = rgb.shape[:2]
    if max_image_hw is not None and (h > max_image_hw[0] or w > max_image_hw[1]):
        raise InputError("rgb", f"an image of at most {max_image_hw[0]}x{max_image_hw[1]} pixels (HxW)", f"{h}x{w}")
    return rgb


def frame_images(rgb: Any, depth: Any, *, limits: InputLimits = _NO_LIMITS,
                 depth_borrowed: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The rgb and depth of one frame, checked as :func:`track_request` checks them (rgb, the images' sizes, depth;
    depth_borrowed: :func:`validate_depth`'s ``borrow``): for a frame several requests read, validated once."""
    rgb = _rgb_within(rgb, limits.max_image_hw)
    check_image_sizes(rgb, depth)
    return rgb, validate_depth(depth, rgb.shape[:2], borrow=depth_borrowed)


def register_request(
    rgb: Any,
    depth: Any,
    mask: Any,
    K: Any,
    *,
    iterations: int | None = None,
    limits: InputLimits = _NO_LIMITS,
    depth_owned: bool = False,
    received: Mapping[str, str] | None = None,
) -> RegisterRequest:
    """Validate the inputs of one register call into a :class:`RegisterRequest`.

    Fields are checked in the order rgb, the images' sizes (:func:`check_image_sizes`), depth, mask, K,
    iterations; the first bad one raises :class:`InputError`. The masked-depth rule is left to the pipeline (it
    needs the filtered depth). depth_owned: see :func:`validate_depth`'s ``owned``. received: see
    :func:`check_image_sizes`.
    """
    rgb = _rgb_within(rgb, limits.max_image_hw)
    check_image_sizes(rgb, depth, mask, K, received=received)
    hw = rgb.shape[:2]
    depth = validate_depth(depth, hw, owned=depth_owned)
    mask = validate_mask(mask, hw)
    return RegisterRequest(
        rgb=rgb,
        depth=depth,
        mask=mask,
        K=validate_K(K, hw),
        iterations=validate_iterations(iterations),
    )


def track_request(
    rgb: Any,
    depth: Any,
    K: Any,
    prev_pose: Any,
    *,
    prev_frame: str = "mesh",
    iterations: int | None = None,
    limits: InputLimits = _NO_LIMITS,
    depth_owned: bool = False,
    depth_checked: bool = False,
    depth_borrowed: bool = False,
    received: Mapping[str, str] | None = None,
) -> TrackRequest:
    """Validate the inputs of one track call into a :class:`TrackRequest`.

    Fields are checked in the order rgb, the images' sizes, depth, K, prev_pose (reported as ``pose``), prev_frame,
    iterations. depth_owned, depth_checked, depth_borrowed: see :func:`validate_depth`'s ``owned``, ``in_range``
    and ``borrow``; received: see :func:`check_image_sizes`.
    """
    rgb = _rgb_within(rgb, limits.max_image_hw)
    check_image_sizes(rgb, depth, None, K, received=received)
    hw = rgb.shape[:2]
    depth = validate_depth(depth, hw, owned=depth_owned, in_range=depth_checked, borrow=depth_borrowed)
    K = validate_K(K, hw)
    prev = validate_pose(prev_pose, "pose", limits.max_translation_m)
    if prev_frame not in ("mesh", "centred"):
        raise InputError("prev_frame", "'mesh' or 'centred'", repr(prev_frame))
    return TrackRequest(
        rgb=rgb,
        depth=depth,
        K=K,
        prev_pose=prev,
        prev_frame=prev_frame,  # type: ignore[arg-type]
        iterations=validate_iterations(iterations),
    )
