"""The FP8 format used for inference: E4M3 (``torch.float8_e4m3fn``) with float32 scales.

Conventions (one place, every module follows them):

* ``real = fp8 * scale``: a scale is the *dequantisation* factor, float32; quantising divides by it. The
  division is written as a multiplication by ``inv_scale = 1 / scale`` (float32, computed once when a layer is
  built), so the CPU emulation and the CUDA kernels round the same products.
* Quantising: ``fp8 = cast_e4m3(clamp(x * inv_scale, -448, 448))``, computed in float32 whatever the dtype of
  ``x``; the cast rounds to the nearest E4M3 value, ties to even (the clamp keeps out-of-range values at +-448:
  ``float8_e4m3fn`` has no infinity and a plain cast would give NaN).
* Weights: one scale per output channel (row of a linear weight, filter of a convolution): ``amax / 448``.
* Activations: one scale per tensor, from the largest magnitude seen on calibration data: ``amax / 448``.

E4M3 keeps 3 mantissa bits (relative spacing 2^-3 between neighbours, rounding error <= 2^-4 of the value) over
magnitudes from 2^-6 (normal) down to 2^-9 (subnormal) times the scale, up to 448: about 18 binades, so a
per-tensor amax scale loses little to the activations' dynamic range.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "E4M3_MAX",
    "FP8_DTYPE",
    "dequantize",
    "quantize_e4m3",
    "scale_from_amax",
    "weight_scales",
]

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_MIN_AMAX = 1e-12  # an all-zero channel or tensor gets scale 1 (any scale represents zeros exactly)


def scale_from_amax(amax: Tensor) -> Tensor:
    """Dequantisation scale(s) ``amax / 448`` as float32; zeros (an all-zero channel) give 1."""
    amax = amax.to(torch.float32)
    return torch.where(amax > _MIN_AMAX, amax / E4M3_MAX, torch.ones_like(amax))


def weight_scales(weight: Tensor) -> Tensor:
    """Per-output-channel scales (C_out,) float32 of a linear (C_out, C_in) or conv (C_out, C_in, k, k) weight."""
    return scale_from_amax(weight.detach().to(torch.float32).abs().flatten(1).amax(dim=1))


def quantize_e4m3(x: Tensor, inv_scale: Tensor) -> Tensor:
    """``x`` (any shape and float dtype) -> ``float8_e4m3fn`` of the same shape and memory format.

    inv_scale: ``1 / scale`` float32, a 0-d tensor (per tensor) or broadcastable to ``x`` (per channel), on
    ``x``'s device. Pure tensor ops: no host synchronisation, capturable in CUDA graphs.
    """
    return (x.to(torch.float32) * inv_scale).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def dequantize(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``q.float() * scale`` in ``dtype``; scale broadcastable to ``q`` (per tensor or per channel)."""
    return (q.to(torch.float32) * scale).to(dtype)
