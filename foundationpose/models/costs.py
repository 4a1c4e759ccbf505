"""Analytic FLOPs and bytes moved by one call of a network layer, from its shapes (the roofline's cost model).

Counting rules (spec 4.5 counts the same matrix FLOPs):

* Matrix products (convolution, linear, attention) count 2 FLOPs per multiply-add and run on tensor cores
  (``math="tensor"``). Bias adds, batch / layer norms, ReLU and the positional add count their elementwise
  operations and run on the vector units (``math="vector"``); they are memory-bound at any realistic peak.
* Bytes are the minimum DRAM traffic of the call: every input read once, every output written once, weights and
  buffers read once (caches ignored). Attention counts Q, K, V and the output only (a fused, flash-style kernel;
  the T x S score matrix never reaches memory). An in-place ReLU still reads and writes its tensor.

``dtype`` names the precision of the math, which selects the peak the roofline compares against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from foundationpose.models.blocks import PositionalEmbedding, ScaledDotProductAttention

__all__ = ["KINDS", "LayerCost", "dtype_name", "layer_cost", "layer_kind"]

KINDS = ("convolution", "linear", "attention", "normalisation", "elementwise", "other")
_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}


@dataclass(frozen=True, slots=True)
class LayerCost:
    """One call of one layer: ``flops`` (float), ``bytes`` (float), on ``math`` units in ``dtype``."""

    kind: str
    flops: float
    bytes: float
    math: str  # "tensor" | "vector"
    dtype: str  # "fp16" | "bf16" | "fp32" | "fp64"

    @property
    def intensity(self) -> float:
        """FLOPs per byte (arithmetic intensity); inf for a call that moves nothing."""
        return self.flops / self.bytes if self.bytes else math.inf


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def layer_kind(module: nn.Module) -> str:
    """The roofline's class of a layer (one of :data:`KINDS`)."""
    if isinstance(module, nn.Conv2d):
        return "convolution"
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, (ScaledDotProductAttention, nn.MultiheadAttention)):
        return "attention"
    if isinstance(module, (nn.modules.batchnorm._BatchNorm, nn.LayerNorm)):
        return "normalisation"
    if isinstance(module, (nn.ReLU, nn.Identity, nn.Dropout, PositionalEmbedding)):
        return "elementwise"
    return "other"


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _param_bytes(module: nn.Module) -> int:
    return sum(_nbytes(t) for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
               if t is not None)


def layer_cost(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> LayerCost | None:
    """Cost of one call ``output = module(*inputs)``; None for a module this model does not know (a container)."""
    if not isinstance(output, Tensor) or not inputs or not isinstance(inputs[0], Tensor):
        return None
    x, out = inputs[0], output
    kind = layer_kind(module)
    io_bytes = _nbytes(x) + _nbytes(out)
    if kind in ("convolution", "linear"):
        fan_in = module.weight[0].numel()  # C_in*k*k | K
        flops = 2.0 * out.numel() * fan_in
        return LayerCost(kind, flops, io_bytes + _param_bytes(module), "tensor", dtype_name(module.weight.dtype))
    if isinstance(module, ScaledDotProductAttention):
        q, k, v = inputs[:3]
        b_h = q.numel() // (q.shape[-2] * q.shape[-1])
        flops = 4.0 * b_h * q.shape[-2] * k.shape[-2] * q.shape[-1]  # Q K^T and P V
        return LayerCost(kind, flops, float(_nbytes(q) + _nbytes(k) + _nbytes(v) + _nbytes(out)), "tensor",
                         dtype_name(q.dtype))
    if isinstance(module, nn.modules.batchnorm._BatchNorm):  # eval: y = x * a + b per channel
        return LayerCost(kind, 2.0 * out.numel(), float(io_bytes + _param_bytes(module)), "vector", dtype_name(x.dtype))
    if isinstance(module, nn.LayerNorm):  # mean, variance, normalise, affine: ~8 operations per element
        return LayerCost(kind, 8.0 * out.numel(), float(io_bytes + _param_bytes(module)), "vector", dtype_name(x.dtype))
    if isinstance(module, nn.Identity) or (isinstance(module, nn.Dropout) and not module.training):
        return LayerCost("elementwise", 0.0, 0.0, "vector", dtype_name(x.dtype))
    if isinstance(module, nn.ReLU):
        return LayerCost(kind, float(out.numel()), float(io_bytes), "vector", dtype_name(x.dtype))
    if isinstance(module, PositionalEmbedding):
        table = out.shape[-2] * out.shape[-1] * module.pe.element_size()
        return LayerCost(kind, float(out.numel()), float(io_bytes + table), "vector", dtype_name(out.dtype))
    return None
