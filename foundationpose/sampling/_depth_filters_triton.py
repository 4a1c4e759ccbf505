"""Triton kernels for the depth pre-filters and the back-projection (spec §2.3, §1.2 step 5, §1.3 step 3).

Private to :mod:`foundationpose.sampling.depth_filters`, which imports this module lazily: triton is an
optional dependency (it ships with CUDA builds of torch; CPU CI has none).

Two kernels, one program per ``BLOCK_H x BLOCK_W`` tile of one image of the batch:

- ``_erode_kernel``: the 5x5 erosion (one pass, reads the raw depth).
- ``_bilateral_kernel``: the bilateral filter of the *eroded* depth (two passes over the window:
  the valid-mean, then the Gaussian-weighted mean), optionally followed by the back-projection of the
  filtered depth to an (H, W, 3) xyz map in float32 (track) or float64 (register) arithmetic.

Bit parity with the torch reference (``depth_filters.py``) rests on doing the same float32 operations
in the same order:

- window visited with ``du`` (column offset) outer and ``dv`` (row offset) inner, unrolled with
  ``tl.static_range``; running sums start at +0 and add ``where(use, value, 0)`` like the reference;
- every division is ``tl.math.div_rn`` (IEEE round-to-nearest; Triton's ``/`` on float32 is the
  approximate ``div.full.f32``);
- kernels are compiled with ``enable_fp_fusion=False`` (no ``a * b + c`` -> FMA contraction, neither by
  LLVM nor by ptxas ``--fmad``), because the reference rounds ``w * z`` before adding it to the sum;
- ``exp`` is libdevice ``__nv_expf`` (the implementation behind CUDA's ``expf``, which torch's CUDA
  ``exp`` calls; ``tl.exp`` would be a bare ``ex2.approx``), compiled with ``enable_reflect_ftz=False`` like nvcc's
  default. Under the Triton *interpreter* (CPU tensors, or ``TRITON_INTERPRET=1``) libdevice does not
  exist; there the exponential is evaluated in float64 and rounded to float32 (correctly rounded
  almost always, like torch's CPU ``exp``), so interpreter runs match the CPU reference.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from foundationpose._triton_optional import InterpretedFunction, libdevice
from foundationpose.constants import MIN_VALID_DEPTH_M
from foundationpose.render._cache import GeometryConstants, cached, host_key

logger = logging.getLogger(__name__)

__all__ = ["TileConfig", "bilateral_filter_depth_triton", "erode_depth_triton", "interpreter_available"]


@dataclass(frozen=True)
class TileConfig:
    """Launch geometry: one program per ``block_h x block_w`` pixel tile (powers of two).

    The default, one pixel per thread, keeps the unrolled bilateral kernel at ~90 registers with no
    spills on sm_90 (4 pixels per thread reach the 255-register cap and spill).
    """

    block_h: int = 4
    block_w: int = 32
    num_warps: int = 4


_DEFAULT_TILE = TileConfig()
# Large tiles under the interpreter: it runs programs one after another in Python, and a statement
# costs about the same NumPy overhead for any tile size.
_INTERPRETER_TILE = TileConfig(block_h=32, block_w=64, num_warps=1)


# ------------------------------------------------------------------------------------------------
# Kernels (plain functions; wrapped below for the compiler and for the interpreter). Only builtins
# of triton.language are used (tl.full, not the @jit helper tl.zeros): the interpreter can call the
# latter only when TRITON_INTERPRET=1 was set before triton was imported.
# ------------------------------------------------------------------------------------------------


def _erode_kernel(
    src_ptr,
    dst_ptr,
    height,
    width,
    min_depth,
    zfar,
    diff_thres,
    ratio_thres,
    RADIUS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    rows = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]  # (BH, 1)
    cols = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)[None, :]  # (1, BW)
    image = tl.program_id(2).to(tl.int64) * height * width
    src = src_ptr + image
    in_image = (rows < height) & (cols < width)
    z0 = tl.load(src + rows * width + cols, mask=in_image, other=0.0)
    bad = tl.full([BLOCK_H, BLOCK_W], 0, tl.int32)
    total = tl.full([BLOCK_H, BLOCK_W], 0, tl.int32)
    for i in tl.static_range(2 * RADIUS + 1):  # du outer
        c = cols + (i - RADIUS)
        col_inside = (c >= 0) & (c < width)
        for j in tl.static_range(2 * RADIUS + 1):  # dv inner
            r = rows + (j - RADIUS)
            inside = col_inside & (r >= 0) & (r < height)
            z = tl.load(src + r * width + c, mask=inside, other=0.0)
            valid = (z >= min_depth) & (z < zfar)
            is_bad = (~valid) | (tl.abs(z - z0) > diff_thres)
            bad += (is_bad & inside).to(tl.int32)
            total += inside.to(tl.int32)
    ratio = tl.math.div_rn(bad.to(tl.float32), total.to(tl.float32))
    out = tl.where(ratio > ratio_thres, 0.0, z0)
    tl.store(dst_ptr + image + rows * width + cols, out, mask=in_image)


def _bilateral_kernel(
    src_ptr,
    dst_ptr,
    xyz_ptr,
    k_ptr,
    height,
    width,
    min_depth,
    zfar,
    gate,
    two_sd2,
    two_sr2,
    xyz_min_depth,
    RADIUS: tl.constexpr,
    EXP_VIA_F64: tl.constexpr,
    XYZ_MODE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    rows = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]  # (BH, 1)
    cols = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)[None, :]  # (1, BW)
    image = tl.program_id(2).to(tl.int64) * height * width
    src = src_ptr + image
    in_image = (rows < height) & (cols < width)
    z_centre = tl.load(src + rows * width + cols, mask=in_image, other=0.0)

    # Pass 1: mean of the valid window depths (float32 running sum, count).
    depth_sum = tl.full([BLOCK_H, BLOCK_W], 0, tl.float32)
    count = tl.full([BLOCK_H, BLOCK_W], 0, tl.int32)
    for i in tl.static_range(2 * RADIUS + 1):
        c = cols + (i - RADIUS)
        col_inside = (c >= 0) & (c < width)
        for j in tl.static_range(2 * RADIUS + 1):
            r = rows + (j - RADIUS)
            inside = col_inside & (r >= 0) & (r < height)
            z = tl.load(src + r * width + c, mask=inside, other=0.0)
            use = (z >= min_depth) & (z < zfar) & inside
            depth_sum = depth_sum + tl.where(use, z, 0.0)
            count += use.to(tl.int32)
    mean = tl.math.div_rn(depth_sum, count.to(tl.float32))  # NaN where count == 0: nothing passes the gate

    # Pass 2: Gaussian-weighted mean of the window pixels within `gate` of the mean.
    weight_sum = tl.full([BLOCK_H, BLOCK_W], 0, tl.float32)
    weighted_depth_sum = tl.full([BLOCK_H, BLOCK_W], 0, tl.float32)
    for i in tl.static_range(2 * RADIUS + 1):
        c = cols + (i - RADIUS)
        col_inside = (c >= 0) & (c < width)
        for j in tl.static_range(2 * RADIUS + 1):
            r = rows + (j - RADIUS)
            inside = col_inside & (r >= 0) & (r < height)
            z = tl.load(src + r * width + c, mask=inside, other=0.0)
            use = (z >= min_depth) & (z < zfar) & inside & (tl.abs(z - mean) < gate)
            offset_sq = tl.full(
                [BLOCK_H, BLOCK_W], (i - RADIUS) * (i - RADIUS) + (j - RADIUS) * (j - RADIUS), tl.float32
            )
            spatial = tl.math.div_rn(offset_sq, two_sd2)
            diff = z_centre - z
            arg = (-spatial) - tl.math.div_rn(diff * diff, two_sr2)
            if EXP_VIA_F64:  # interpreter: no libdevice; float64 exp rounded once
                weight = tl.exp(arg.to(tl.float64)).to(tl.float32)
            else:
                weight = libdevice.exp(arg)
            weight_sum = weight_sum + tl.where(use, weight, 0.0)
            weighted_depth_sum = weighted_depth_sum + tl.where(use, weight * z, 0.0)
    out = tl.where(weight_sum > 0.0, tl.math.div_rn(weighted_depth_sum, weight_sum), 0.0)
    tl.store(dst_ptr + image + rows * width + cols, out, mask=in_image)

    # Epilogue: back-projection x = ((u - cx) z) / fx, y = ((v - cy) z) / fy; 0 where z < min depth.
    if XYZ_MODE != 0:
        fx = tl.load(k_ptr)
        fy = tl.load(k_ptr + 1)
        cx = tl.load(k_ptr + 2)
        cy = tl.load(k_ptr + 3)
        if XYZ_MODE == 1:  # track: float32 K, float32 pixel indices, float32 arithmetic
            x = tl.math.div_rn((cols.to(tl.float32) - cx) * out, fx)
            y = tl.math.div_rn((rows.to(tl.float32) - cy) * out, fy)
        else:  # register: float64 K and arithmetic on the float32 depth, rounded once
            z64 = out.to(tl.float64)
            # float64 "/" lowers to the IEEE div.rn.f64 (div_rn is float32-only).
            x = (((cols.to(tl.float64) - cx) * z64) / fx).to(tl.float32)
            y = (((rows.to(tl.float64) - cy) * z64) / fy).to(tl.float32)
        invalid = out < xyz_min_depth
        point = xyz_ptr + image * 3 + (rows * width + cols) * 3
        tl.store(point, tl.where(invalid, 0.0, x), mask=in_image)
        tl.store(point + 1, tl.where(invalid, 0.0, y), mask=in_image)
        tl.store(point + 2, tl.where(invalid, 0.0, out), mask=in_image)


_ERODE_JIT = triton.jit(_erode_kernel)
_BILATERAL_JIT = triton.jit(_bilateral_kernel)
_ERODE_INTERPRETED = InterpretedFunction(_erode_kernel) if InterpretedFunction is not None else None
_BILATERAL_INTERPRETED = InterpretedFunction(_bilateral_kernel) if InterpretedFunction is not None else None


def _compile_options() -> dict[str, bool]:
    """Launch options that keep float32 arithmetic IEEE-exact, where this triton version knows them."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions

        known = set(CUDAOptions.__dataclass_fields__)
    except Exception:  # noqa: BLE001 - no NVIDIA backend: the options are moot
        return {}
    wanted = {"enable_fp_fusion": False, "enable_reflect_ftz": False}
    missing = sorted(set(wanted) - known)
    if missing:
        logger.warning("triton lacks launch options %s; depth filters may not be bit-exact", missing)
    return {k: v for k, v in wanted.items() if k in known}


_COMPILE_OPTIONS = _compile_options()


def interpreter_available() -> bool:
    """Whether kernels can run on CPU tensors through the Triton interpreter."""
    return _ERODE_INTERPRETED is not None


def _is_interpreted(kernel: object) -> bool:
    return InterpretedFunction is not None and isinstance(kernel, InterpretedFunction)


def _pick(jit_kernel: object, interpreted_kernel: object | None, depth: Tensor) -> tuple[object, bool]:
    """The compiled kernel for CUDA tensors (interpreted too when TRITON_INTERPRET=1), the interpreter
    for CPU ones; returns (kernel, interpreted)."""
    if depth.is_cuda:
        if libdevice is None and not _is_interpreted(jit_kernel):
            raise RuntimeError("this triton has no triton.language.extra.libdevice (needs triton >= 3.0)")
        return jit_kernel, _is_interpreted(jit_kernel)
    if interpreted_kernel is None:
        raise RuntimeError(
            f"the triton depth filters need a CUDA tensor or the triton interpreter; got {depth.device}"
        )
    return interpreted_kernel, True


def _check(depth: Tensor) -> Tensor:
    if depth.dtype != torch.float32 or depth.ndim != 3:
        raise ValueError(f"depth must be float32 (B, H, W), got {depth.dtype} {tuple(depth.shape)}")
    if depth.shape[1] * depth.shape[2] >= 2**31 // 3:
        raise ValueError(f"image too large for int32 indexing: {tuple(depth.shape)}")
    return depth.contiguous()


@contextlib.contextmanager
def _launch_context(depth: Tensor, interpreted: bool) -> Iterator[None]:
    """Launch on ``depth``'s GPU (triton uses the current device and stream); quiet NumPy under the
    interpreter (0/0 -> NaN is intended where a window has no valid pixel)."""
    if interpreted:
        with np.errstate(invalid="ignore", divide="ignore"):
            yield
    elif depth.is_cuda:
        with torch.cuda.device(depth.device):
            yield
    else:  # pragma: no cover - _pick never returns a compiled kernel for a CPU tensor
        yield


def _grid(depth: Tensor, tile: TileConfig) -> tuple[int, int, int]:
    batch, height, width = depth.shape
    return (triton.cdiv(width, tile.block_w), triton.cdiv(height, tile.block_h), batch)


def _f32(value: float) -> float:
    """``value`` rounded to float32 (kernel scalar arguments are float32)."""
    return float(np.float32(value))


def _intrinsics(
    K: Tensor | np.ndarray, work: torch.dtype, device: torch.device, constants: GeometryConstants | None = None
) -> Tensor:
    """(4,) ``[fx, fy, cx, cy]`` rounded to ``work`` (as the reference's ``K.to(work)``), on ``device``;
    a host K is uploaded once per camera into ``constants`` (the owner's memo; None: per call)."""
    if isinstance(K, Tensor) and K.device.type != "cpu":
        K_t = K.reshape(3, 3)
        return torch.stack([K_t[0, 0], K_t[1, 1], K_t[0, 2], K_t[1, 2]]).to(device=device, dtype=work)

    def make() -> Tensor:
        K_np = (K.numpy() if isinstance(K, Tensor) else np.asarray(K)).reshape(3, 3)
        params = K_np[[0, 1, 0, 1], [0, 1, 2, 2]].astype(np.float64 if work == torch.float64 else np.float32)
        return torch.from_numpy(params).to(device)

    key = host_key(K)
    return cached(None if constants is None else constants.intrinsics, key and ("triton K", work, key, device),
                  make, device)


def erode_depth_triton(
    depth: Tensor,
    radius: int,
    depth_diff_thres: float,
    ratio_thres: float,
    zfar: float,
    min_depth: float,
    tile: TileConfig | None = None,
) -> Tensor:
    """Erosion of a (B, H, W) float32 depth batch (metres); see ``depth_filters.erode_depth``.

    Returns a new (B, H, W) float32 tensor on ``depth.device``.
    """
    depth = _check(depth)
    out = torch.empty_like(depth)
    if depth.numel() == 0:
        return out
    kernel, interpreted = _pick(_ERODE_JIT, _ERODE_INTERPRETED, depth)
    tile = tile or (_INTERPRETER_TILE if interpreted else _DEFAULT_TILE)
    _, height, width = depth.shape
    with _launch_context(depth, interpreted):
        kernel[_grid(depth, tile)](
            depth,
            out,
            height,
            width,
            _f32(min_depth),
            _f32(zfar),
            _f32(depth_diff_thres),
            _f32(ratio_thres),
            RADIUS=radius,
            BLOCK_H=tile.block_h,
            BLOCK_W=tile.block_w,
            num_warps=tile.num_warps,
            **_COMPILE_OPTIONS,
        )
    return out


def bilateral_filter_depth_triton(
    depth: Tensor,
    radius: int,
    sigma_d: float,
    sigma_r: float,
    zfar: float,
    min_depth: float,
    gate: float,
    K: Tensor | np.ndarray | None = None,
    xyz_float64: bool = False,
    xyz_min_depth: float = MIN_VALID_DEPTH_M,
    tile: TileConfig | None = None,
    constants: GeometryConstants | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Bilateral filter of a (B, H, W) float32 eroded depth batch; see ``depth_filters.bilateral_filter_depth``.

    With ``K`` (3, 3) intrinsics (pixels), the filtered depth is also back-projected
    (``depth_filters.depth_to_xyz`` semantics; ``xyz_float64`` picks the register path's float64
    arithmetic over the track path's float32). ``constants``: the owner's memo of the device K per camera.

    Returns:
        ``(filtered (B, H, W) float32, xyz (B, H, W, 3) float32 camera-frame metres or None)``.
    """
    depth = _check(depth)
    out = torch.empty_like(depth)
    xyz = None
    if K is not None:
        xyz = torch.empty((*depth.shape, 3), dtype=torch.float32, device=depth.device)
        k_params = _intrinsics(K, torch.float64 if xyz_float64 else torch.float32, depth.device, constants)
    if depth.numel() == 0:
        return out, xyz
    kernel, interpreted = _pick(_BILATERAL_JIT, _BILATERAL_INTERPRETED, depth)
    tile = tile or (_INTERPRETER_TILE if interpreted else _DEFAULT_TILE)
    two = np.float32(2.0)
    two_sd2 = two * np.float32(sigma_d) * np.float32(sigma_d)  # float32 products, as the reference
    two_sr2 = two * np.float32(sigma_r) * np.float32(sigma_r)
    _, height, width = depth.shape
    with _launch_context(depth, interpreted):
        kernel[_grid(depth, tile)](
            depth,
            out,
            xyz if xyz is not None else out,  # unused when XYZ_MODE == 0
            k_params if xyz is not None else out,
            height,
            width,
            _f32(min_depth),
            _f32(zfar),
            _f32(gate),
            float(two_sd2),
            float(two_sr2),
            _f32(xyz_min_depth),
            RADIUS=radius,
            EXP_VIA_F64=interpreted,
            XYZ_MODE=0 if xyz is None else (2 if xyz_float64 else 1),
            BLOCK_H=tile.block_h,
            BLOCK_W=tile.block_w,
            num_warps=tile.num_warps,
            **_COMPILE_OPTIONS,
        )
    return out, xyz
