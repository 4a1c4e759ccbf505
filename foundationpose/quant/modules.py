"""FP8 (E4M3) linear and convolution layers for inference; conventions in :mod:`foundationpose.quant.fp8`.

Each layer holds its weight quantised once (``weight_fp8``, per-output-channel ``weight_scale``) and a per-tensor
input scale from calibration (``input_scale``). ``forward`` quantises the input, multiplies in FP8 with float32
accumulation, applies ``input_scale * weight_scale`` per output channel after the accumulation, adds the bias and
returns the input's dtype. Two backends compute that same function:

* ``"emulate"`` (the CPU path; any device): the quantise-dequantise goes through real ``torch.float8_e4m3fn``
  casts and the products of E4M3 values are exact in float32, so the only difference from the hardware is the
  order of the float32 sums. Its readable twin is :mod:`foundationpose.quant._reference`.
* ``"kernels"`` (CUDA, compute capability >= 8.9): ``torch._scaled_mm`` for linear layers and the cuDNN
  frontend's FP8 convolution for convolutions (:mod:`foundationpose.quant._kernels`). No host synchronisation;
  capturable in CUDA graphs once each input shape has run eagerly (warm-up).

The quantised buffers keep their dtypes through ``module.to(torch.float16)`` (an inference core casting its
model): only their device follows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from foundationpose.quant.fp8 import quantize_e4m3, weight_scales

__all__ = ["BACKENDS", "Fp8Conv2d", "Fp8Linear", "Fp8Module"]

BACKENDS = ("emulate", "kernels")


class Fp8Module(nn.Module):
    """Shared state of the FP8 layers: quantised weight, scales, bias, backend choice."""

    # Buffers whose dtype is part of the format: ``module.to(dtype)`` moves them but never casts them.
    _FIXED_DTYPE = ("weight_fp8", "weight_scale", "input_scale", "inv_input_scale", "out_scale", "bias")

    weight_fp8: Tensor
    weight_scale: Tensor
    input_scale: Tensor
    inv_input_scale: Tensor
    out_scale: Tensor
    bias: Tensor | None

    def _init_quantised(self, weight: Tensor, bias: Tensor | None, input_scale: float, backend: str) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
        if not input_scale > 0:
            raise ValueError(f"input_scale must be > 0; got {input_scale}")
        w = weight.detach().to(torch.float32)
        w_scale = weight_scales(w)  # (C_out,)
        view = (-1,) + (1,) * (w.ndim - 1)
        self.register_buffer("weight_fp8", quantize_e4m3(w, 1.0 / w_scale.view(view)))
        self.register_buffer("weight_scale", w_scale)
        s_in = torch.tensor(float(input_scale), dtype=torch.float32, device=w.device)
        self.register_buffer("input_scale", s_in)
        self.register_buffer("inv_input_scale", 1.0 / s_in)  # float32: both backends multiply by this
        self.register_buffer("out_scale", s_in * w_scale)  # applied after the float32 accumulation
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.float32).clone())
        self.backend = backend

    def _apply(self, fn: Any, recurse: bool = True) -> Fp8Module:
        before = {name: self._buffers[name] for name in self._FIXED_DTYPE if self._buffers.get(name) is not None}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if new.dtype != old.dtype:  # a dtype cast: keep the format, follow the device only
                self._buffers[name] = old.to(new.device)
        return self

    def dequantized_weight(self) -> Tensor:
        """The weight the layer multiplies by, float32: ``weight_fp8 * weight_scale``."""
        view = (-1,) + (1,) * (self.weight_fp8.ndim - 1)
        return self.weight_fp8.to(torch.float32) * self.weight_scale.view(view)

    def _use_kernels(self, x: Tensor) -> bool:
        if self.backend == "emulate":
            return False
        if x.device.type != "cuda":
            raise RuntimeError(f"{type(self).__name__}: backend 'kernels' needs CUDA tensors; got {x.device} "
                               "(use backend='emulate' off the GPU)")
        return True


class Fp8Linear(Fp8Module):
    """FP8 ``nn.Linear``: x (..., in_features) float -> (..., out_features) in x's dtype."""

    def __init__(self, linear: nn.Linear, input_scale: float, backend: str = "emulate") -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._init_quantised(linear.weight, linear.bias, input_scale, backend)

    def forward(self, x: Tensor) -> Tensor:
        if self._use_kernels(x):
            from foundationpose.quant import _kernels

            return _kernels.fp8_linear(x, self)
        return self.forward_emulated(x)

    def forward_emulated(self, x: Tensor) -> Tensor:
        """The CPU path (mirrored by ``fp8_linear_reference``; the kernels compute the same function)."""
        xq = quantize_e4m3(x, self.inv_input_scale)  # (..., K) float8_e4m3fn
        y = F.linear(xq.to(torch.float32), self.weight_fp8.to(torch.float32))  # exact products, float32 sums
        y = y * self.out_scale
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"input_scale={float(self.input_scale):.4g}, backend={self.backend}")


class Fp8Conv2d(Fp8Module):
    """FP8 ``nn.Conv2d`` (groups 1, dilation 1, zero padding): x (N, C, H, W) float -> (N, K, H', W') in x's dtype."""

    def __init__(self, conv: nn.Conv2d, input_scale: float, backend: str = "emulate") -> None:
        super().__init__()
        if conv.groups != 1 or conv.dilation != (1, 1) or conv.padding_mode != "zeros" or isinstance(conv.padding, str):
            raise ValueError(f"Fp8Conv2d: only groups=1, dilation=1, numeric zero padding; got {conv}")
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.kernel_size = tuple(conv.kernel_size)
        self.stride, self.padding = tuple(conv.stride), tuple(conv.padding)
        self._init_quantised(conv.weight, conv.bias, input_scale, backend)

    def forward(self, x: Tensor) -> Tensor:
        if self._use_kernels(x):
            from foundationpose.quant import _kernels

            return _kernels.fp8_conv2d(x, self)
        return self.forward_emulated(x)

    def forward_emulated(self, x: Tensor) -> Tensor:
        """The CPU path (mirrored by ``fp8_conv2d_reference``; the kernels compute the same function)."""
        xq = quantize_e4m3(x, self.inv_input_scale)  # (N, C, H, W) float8_e4m3fn, memory format kept
        y = F.conv2d(xq.to(torch.float32), self.weight_fp8.to(torch.float32), None, self.stride, self.padding)
        y = y * self.out_scale.view(1, -1, 1, 1)
        if self.bias is not None:
            y = y + self.bias.view(1, -1, 1, 1)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, input_scale={float(self.input_scale):.4g}, backend={self.backend}")

