"""Readable reference twins of the FP8 layers, in float64; each docstring names the function it mirrors.

Nothing here is fast. The tests compare the CPU emulation (:mod:`foundationpose.quant.modules`) and, on a GPU, the
library kernels (:mod:`foundationpose.quant._kernels`) against these functions.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch.nn import functional as F

from foundationpose.quant.fp8 import E4M3_MAX, FP8_DTYPE

__all__ = ["e4m3_grid", "round_to_e4m3", "fp8_linear_reference", "fp8_conv2d_reference"]


@functools.cache
def e4m3_grid() -> tuple[Tensor, Tensor]:
    """Every finite E4M3 value, ascending, as float64 (253 values: +-0 merged), and each value's code (uint8).

    Decoded from the 256 bit patterns through ``torch.float8_e4m3fn`` (the format's own definition:
    bias 7, 3 mantissa bits, subnormals, no infinities, 0x7F / 0xFF are NaN).
    """
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = codes.view(FP8_DTYPE).to(torch.float64)
    finite = torch.isfinite(values) & ~((values == 0) & (codes >= 128))  # drop NaNs and -0
    order = torch.argsort(values[finite])
    return values[finite][order], codes[finite][order]


def round_to_e4m3(x: Tensor) -> Tensor:
    """The E4M3 value nearest to each element of ``x`` (float64 result), ties to the even code; clamps to +-448.

    Mirrors the float32 -> ``float8_e4m3fn`` cast inside :func:`foundationpose.quant.fp8.quantize_e4m3`,
    written as a search over the enumerated grid instead of bit manipulation.
    """
    grid, codes = e4m3_grid()
    v = x.to(torch.float64).clamp(-E4M3_MAX, E4M3_MAX).flatten()
    hi = torch.searchsorted(grid, v).clamp(1, grid.numel() - 1)  # grid[hi - 1] <= v <= grid[hi]
    lo = hi - 1
    d_lo, d_hi = v - grid[lo], grid[hi] - v
    even_hi = (codes[hi].to(torch.int32) & 1) == 0
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & even_hi)
    return torch.where(pick_hi, grid[hi], grid[lo]).reshape(x.shape)


def _fake_quant(x: Tensor, scale: Tensor) -> Tensor:
    """float64 ``round_to_e4m3(x / scale) * scale``."""
    scale = scale.to(torch.float64)
    return round_to_e4m3(x.to(torch.float64) * (1.0 / scale)) * scale


@torch.no_grad()
def fp8_linear_reference(x: Tensor, weight: Tensor, weight_scale: Tensor, input_scale: Tensor,
                         bias: Tensor | None) -> Tensor:
    """float64 ``F.linear`` of the E4M3-rounded input and weight; mirrors ``Fp8Linear.forward``.

    x: (..., K) float; weight: (N, K) float (the full-precision weight); weight_scale: (N,); input_scale: 0-d.
    The input is quantised with the float32 ``inv_scale`` the module uses, so both round the same products.
    """
    inv = (1.0 / input_scale.to(torch.float32)).to(torch.float64)
    xq = round_to_e4m3(x.to(torch.float32).to(torch.float64) * inv) * input_scale.to(torch.float64)
    wq = _fake_quant(weight, weight_scale.to(torch.float64)[:, None])
    b = None if bias is None else bias.to(torch.float64)
    return F.linear(xq, wq, b)


@torch.no_grad()
def fp8_conv2d_reference(x: Tensor, weight: Tensor, weight_scale: Tensor, input_scale: Tensor,
                         bias: Tensor | None, stride: tuple[int, int], padding: tuple[int, int]) -> Tensor:
    """float64 ``F.conv2d`` of the E4M3-rounded input and weight; mirrors ``Fp8Conv2d.forward``.

    x: (N, C, H, W) float; weight: (K, C, r, s) float; weight_scale: (K,); input_scale: 0-d.
    """
    inv = (1.0 / input_scale.to(torch.float32)).to(torch.float64)
    xq = round_to_e4m3(x.to(torch.float32).to(torch.float64) * inv) * input_scale.to(torch.float64)
    wq = _fake_quant(weight, weight_scale.to(torch.float64)[:, None, None, None])
    b = None if bias is None else bias.to(torch.float64)
    return F.conv2d(xq, wq, b, stride=stride, padding=padding)
