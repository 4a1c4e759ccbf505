"""Triton kernel writing the refiner's and scorer's NHWC network inputs (private to :mod:`network_inputs`).

:func:`foundationpose.network_inputs.write_network_input` imports this module lazily (triton is optional; CPU CI
runs the kernel through the Triton interpreter on small inputs, in NumPy float32). One launch per branch replaces
the ~7 elementwise torch ops per branch of the eager twin,
:func:`foundationpose.network_inputs.write_network_input_reference` (``rgb_to_unit`` and ``normalize_xyz`` into
the two channel slices), which stays the reference:

- one program per (block of ``BLOCK`` pixels, hypothesis); ``RENDERED`` picks branch A (rendered) or B (real);
  each works on a (pixels, 8 channels) tile (it evaluates both formulas on every lane and keeps the one of its
  channel: a select, no change to a value);
- R, G, B: ``(rgb * 255) * float32(1/255)`` for A (two separately rounded products, in that order), and
  ``rgb_255 * float32(1/255)`` for B;
- X, Y, Z: ``(xyz - t) * r`` (``r`` = float32(1 / (float32(d) / 2)), or row i's own ``r`` read from a (N,) table
  for the rows of an object group, ``SCALE_ROWS``); all three 0 where the *input* z is below
  ``invalid_z``, a single component 0 where ``|x'| >= XYZ_CLIP``. A subtraction then a product: nothing an FMA
  could contract, and the kernels are compiled with ``enable_fp_fusion=False`` anyway (as the depth filters);
- every scalar is a float32 kernel argument rounded on the host (``np.float32``), so comparisons and products
  see the same float32 constants as the torch ops (which convert a Python scalar to the tensor's float32).

Every tensor is addressed through its strides (views of a pose batch, warp outputs, channel slices of a pool
buffer), offsets in int64. Nothing is allocated and nothing is read back, so a CUDA graph can capture the
launch; its scalars are arguments, not device constants, so nothing needs caching either.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from foundationpose._triton_optional import InterpretedFunction

__all__ = ["BLOCK_PIXELS", "interpreter_available", "write_network_input_triton"]

BLOCK_PIXELS = 512  # pixels per program (compiled): 4 per thread at 4 warps
_NUM_WARPS = 4
_INTERPRETER_BLOCK = 4096  # the interpreter runs programs one by one: few large ones are faster


def _network_input_kernel(
    rgb_ptr, xyz_ptr, t_ptr, out_ptr,
    height, width,
    rgb_sn, rgb_sh, rgb_sw, rgb_sc,
    xyz_sn, xyz_sh, xyz_sw, xyz_sc,
    out_sn, out_sh, out_sw, out_sc,
    t_sn, t_sc,
    rgb_unit_scale, xyz_scale, invalid_z, xyz_clip,
    scale_rows_ptr,
    RENDERED: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One (BLOCK pixels, 8 channels) tile: neighbouring lanes hold neighbouring channels of a pixel, so each store
    of the interleaved NHWC output writes whole runs of 6 values (3x faster at N = 252 on the H200 than one value
    per lane and store, which wrote every 6th value)."""
    q = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    img = tl.program_id(1).to(tl.int64)
    valid = (q < height * width)[:, None]  # (BLOCK, 1)
    row = (q // width).to(tl.int64)[:, None]
    col = (q % width).to(tl.int64)[:, None]
    c = tl.arange(0, 8)[None, :]  # (1, 8): R G B X Y Z and two unused lanes
    is_rgb = c < 3
    is_xyz = (c >= 3) & (c < 6)
    k = tl.where(is_rgb, c, c - 3).to(tl.int64)  # the input channel of each output lane

    rgb = rgb_ptr + img * rgb_sn + row * rgb_sh + col * rgb_sw
    colour = tl.load(rgb + k * rgb_sc, mask=valid & is_rgb, other=0.0)
    if RENDERED:  # the rendered colour in [0, 1] goes through x255 first, as refine did (spec §1.4 step 2)
        colour = colour * 255.0
    colour = colour * rgb_unit_scale

    xyz = xyz_ptr + img * xyz_sn + row * xyz_sh + col * xyz_sw
    point = tl.load(xyz + k * xyz_sc, mask=valid & is_xyz, other=0.0)
    z = tl.load(xyz + 2 * xyz_sc, mask=valid, other=0.0)  # (BLOCK, 1): the pixel's z for its three lanes
    invalid = z < invalid_z  # on the metres, before shifting
    shift = tl.load(t_ptr + img * t_sn + k * t_sc, mask=is_xyz, other=0.0)  # (1, 8)
    if SCALE_ROWS:  # rows of an object group: each row's own float32 factor
        point = (point - shift) * tl.load(scale_rows_ptr + img)
    else:
        point = (point - shift) * xyz_scale
    point = tl.where(invalid | (tl.abs(point) >= xyz_clip), 0.0, point)

    out = out_ptr + img * out_sn + row * out_sh + col * out_sw + c.to(tl.int64) * out_sc
    tl.store(out, tl.where(is_rgb, colour, point), mask=valid & (c < 6))


_JIT = triton.jit(_network_input_kernel)
_INTERPRETED = InterpretedFunction(_network_input_kernel) if InterpretedFunction is not None else None


def _compile_options() -> dict[str, bool]:
    """No FMA contraction (the torch twin rounds every product), where this triton version has the option."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except Exception:  # noqa: BLE001 - no NVIDIA backend: the option is moot
        return {}
    return {"enable_fp_fusion": False} if "enable_fp_fusion" in CUDAOptions.__dataclass_fields__ else {}


_COMPILE_OPTIONS = _compile_options()


def interpreter_available() -> bool:
    """Whether the kernel can run on CPU tensors through the Triton interpreter."""
    return _INTERPRETED is not None


def _is_interpreted(kernel: object) -> bool:
    return InterpretedFunction is not None and isinstance(kernel, InterpretedFunction)


def _pick(device: torch.device) -> tuple[object, bool]:
    """(kernel, interpreted): compiled for CUDA tensors (interpreted too under TRITON_INTERPRET=1), the
    interpreter for CPU ones."""
    if device.type == "cuda":
        return _JIT, _is_interpreted(_JIT)
    if _INTERPRETED is None:
        raise RuntimeError(f"the triton network-input kernel needs a CUDA tensor or the triton interpreter; got {device}")
    return _INTERPRETED, True


@contextlib.contextmanager
def _launch_context(device: torch.device, interpreted: bool) -> Iterator[None]:
    """Launch on the tensors' GPU (triton uses the current device and stream)."""
    if device.type == "cuda" and not interpreted:
        with torch.cuda.device(device):
            yield
    else:
        yield


def _check(name: str, x: Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    if x.dtype != torch.float32:
        raise TypeError(f"{name}: expected float32; got {x.dtype}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}; got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}; got {x.device}")


def write_network_input_triton(
    rgb: Tensor,
    xyz: Tensor,
    t: Tensor,
    out: Tensor,
    *,
    rendered: bool,
    xyz_scale: float,
    invalid_z: float,
    rgb_unit_scale: float,
    xyz_clip: float,
    xyz_scale_rows: Tensor | None = None,
) -> None:
    """Fill ``out`` (N, S, S, 6) float32, channels R G B X Y Z, from one branch in one launch.

    rgb: (N, S, S, 3), in [0, 1] when ``rendered`` (branch A: multiplied by 255 first), else 0..255 (B).
    xyz: (N, S, S, 3) camera-frame metres. t: (N, 3) the hypotheses' translations. All float32 on one device,
    any strides (a pose batch's column, warp outputs; ``out`` may be a row range of a pool buffer). ``out`` may
    be the same memory as ``rgb`` / ``xyz`` pixel for pixel (each pixel is read before it is written) but must
    not partly overlap them. The scalars are :mod:`foundationpose.network_inputs`' float32 constants.
    xyz_scale_rows: (N,) float32 on the same device, one xyz factor per row (rows of an object group), read by
    the kernel in place of ``xyz_scale``.
    Raises TypeError (dtype) or ValueError (shape, device) naming the argument.
    """
    if rgb.ndim != 4 or rgb.shape[-1] != 3:
        raise ValueError(f"rgb: expected (N, S, S, 3); got {tuple(rgb.shape)}")
    n, h, w = (int(v) for v in rgb.shape[:3])
    device = rgb.device
    _check("rgb", rgb, (n, h, w, 3), device)
    _check("xyz", xyz, (n, h, w, 3), device)
    _check("t", t, (n, 3), device)
    _check("out", out, (n, h, w, 6), device)
    if h * w >= 2**31 or n >= 2**16:
        raise ValueError(f"out: {n} crops of {h} x {w} exceed the launch grid (< 2**16 crops, < 2**31 pixels each)")
    if xyz_scale_rows is not None:
        _check("xyz_scale_rows", xyz_scale_rows, (n,), device)
    if n == 0 or h * w == 0:
        return
    kernel, interpreted = _pick(device)
    block = _INTERPRETER_BLOCK if interpreted else BLOCK_PIXELS
    options = {} if interpreted else {"num_warps": _NUM_WARPS, **_COMPILE_OPTIONS}
    f32 = np.float32
    with _launch_context(device, interpreted):
        kernel[(triton.cdiv(h * w, block), n)](
            rgb, xyz, t, out,
            h, w,
            *rgb.stride(), *xyz.stride(), *out.stride(), *t.stride(),
            float(f32(rgb_unit_scale)), float(f32(xyz_scale)), float(f32(invalid_z)), float(f32(xyz_clip)),
            xyz_scale_rows if xyz_scale_rows is not None else t,  # unused without SCALE_ROWS
            RENDERED=rendered,
            SCALE_ROWS=xyz_scale_rows is not None,
            BLOCK=block,
            **options,
        )
