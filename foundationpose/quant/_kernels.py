"""CUDA kernels of the FP8 layers: ``torch._scaled_mm`` (linear) and the cuDNN frontend's FP8 convolution.

Both compute the function of ``Fp8Linear.forward_emulated`` / ``Fp8Conv2d.forward_emulated`` (module
:mod:`foundationpose.quant.modules`): E4M3 input and weight, float32 accumulation, ``input_scale * weight_scale``
per output channel applied after the accumulation, bias, output in the input's dtype.

* Linear: ``torch._scaled_mm(x_fp8 (M, K) row-major, w_fp8.t() (K, N) column-major, scale_a (M, 1), scale_b
  (1, N))`` with row-wise scaling (cuBLASLt on compute capability 9.0, CUDA >= 12.9; 16-bit output): scale_a is a
  column of ones and scale_b carries ``input_scale * weight_scale``. K and N must be multiples of 16 (the layers
  that are not stay 16-bit: :func:`foundationpose.quant.scales.eligible_layers`). The bias goes into the kernel
  in the output dtype (torch requires Half bias for Half output); float32 output adds it afterwards.
* Convolution: a cuDNN graph (frontend >= 1.0, ``pip install nvidia-cudnn-frontend``): ``conv_fprop`` of FP8
  E4M3 NHWC input and filter with float32 compute, then ``mul`` by the (1, K, 1, 1) float32 scale and ``bias``
  by the (1, K, 1, 1) float32 bias, written as NHWC 16-bit (if cuDNN refuses that fused epilogue, the conv
  writes float32 and torch applies scale and bias). One graph per input shape (built on the first eager call
  of that shape, e.g. the inference core's warm-up); the call is a ``torch.library`` custom op, so
  ``torch.compile`` keeps it as one opaque node.
* Quantising the activations (read 16-bit, write 8-bit, memory-bound) goes through ``torch.compile`` of
  :func:`foundationpose.quant.fp8.quantize_e4m3` (one fused kernel instead of four passes), eager if that fails.

Everything is stream-ordered with no host synchronisation: scratch buffers (cuDNN workspace, the row of ones)
come from the caching allocator on the current stream, so a forward is capturable in a CUDA graph once each
shape has run eagerly (cuDNN plans and compiled kernels are built outside capture).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
from torch import Tensor

from foundationpose.quant.fp8 import quantize_e4m3

__all__ = [
    "cudnn_frontend_unavailable_reason",
    "fp8_conv2d",
    "fp8_linear",
    "fp8_unavailable_reason",
]

logger = logging.getLogger(__name__)

_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9) and Hopper (9.0)


def fp8_unavailable_reason(device: torch.device | str) -> str | None:
    """Why FP8 tensor-core kernels cannot run on ``device``, or None when they can (a capability probe)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"FP8 kernels need a CUDA device; got {device}"
    if not torch.cuda.is_available():
        return "CUDA is not available in this process"
    capability = torch.cuda.get_device_capability(device)
    if capability < _MIN_CAPABILITY:
        return (f"FP8 tensor cores need compute capability >= 8.9 (Ada or Hopper); "
                f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}")
    return None


def cudnn_frontend_unavailable_reason() -> str | None:
    """Why the cuDNN frontend (FP8 convolutions) cannot be used, or None when it can."""
    try:
        import cudnn  # noqa: F401  (pip install nvidia-cudnn-frontend)
    except ImportError as exc:
        return f"the cuDNN frontend is not installed ({exc}); FP8 convolutions need: pip install nvidia-cudnn-frontend"
    return None


# -- activation quantisation -----------------------------------------------------------------------------------

_quantize_lock = threading.Lock()
_quantize_impl: Any = None


def _quantize(x: Tensor, inv_scale: Tensor) -> Tensor:
    """:func:`quantize_e4m3` as one fused kernel (``torch.compile``), the eager ops when compiling fails."""
    global _quantize_impl
    if _quantize_impl is None:
        with _quantize_lock:
            if _quantize_impl is None:
                compiled = torch.compile(quantize_e4m3, dynamic=True, fullgraph=True)
                try:
                    compiled(x, inv_scale)
                    _quantize_impl = compiled
                except Exception as exc:  # no Triton / inductor problem: correct but unfused
                    logger.warning("FP8 activation quantisation runs unfused (torch.compile failed: %s)", exc)
                    _quantize_impl = quantize_e4m3
    return _quantize_impl(x, inv_scale)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# -- linear: torch._scaled_mm ------------------------------------------------------------------------------------


def _ones_column(layer: Any, rows: int, device: torch.device) -> Tensor:
    """(rows, 1) float32 ones, a view of a buffer kept on the layer (grown outside capture only)."""
    ones = getattr(layer, "_ones_rows", None)
    if ones is None or ones.shape[0] < rows or ones.device != device:
        fresh = torch.ones(rows, 1, dtype=torch.float32, device=device)
        if _capturing():  # a buffer allocated inside capture belongs to the graph: use it, do not keep it
            return fresh
        layer._ones_rows = ones = fresh
    return ones[:rows]


def _bias_as(layer: Any, dtype: torch.dtype) -> Tensor:
    cache = layer.__dict__.setdefault("_bias_by_dtype", {})
    bias = cache.get(dtype)
    if bias is None or bias.device != layer.bias.device:
        bias = layer.bias.to(dtype)
        if not _capturing():
            cache[dtype] = bias
    return bias


def fp8_linear(x: Tensor, layer: Any) -> Tensor:
    """``Fp8Linear`` on CUDA: x (..., K) fp16 / bf16 / fp32 -> (..., N) in x's dtype."""
    k, n = layer.in_features, layer.out_features
    assert x.shape[-1] == k, (x.shape, k)
    x2 = x.reshape(-1, k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    rows = x2.shape[0]
    xq = _quantize(x2, layer.inv_input_scale)  # (M, K) float8_e4m3fn, row-major
    fused_bias = layer.bias is not None and x.dtype in (torch.float16, torch.bfloat16)
    y = torch._scaled_mm(
        xq,
        layer.weight_fp8.t(),  # (K, N) column-major view of the (N, K) row-major weight
        scale_a=_ones_column(layer, rows, x.device),  # (M, 1)
        scale_b=layer.out_scale.view(1, n),  # (1, N): input_scale * weight_scale
        bias=_bias_as(layer, x.dtype) if fused_bias else None,
        out_dtype=x.dtype,
    )
    if layer.bias is not None and not fused_bias:
        y = y + layer.bias
    return y.reshape(*x.shape[:-1], n)


# -- convolution: cuDNN frontend graph -------------------------------------------------------------------------

_plans_lock = threading.Lock()
_plans: dict[tuple, Any] = {}
_handles: dict[int, Any] = {}
_execute_lock = threading.Lock()  # set_stream + execute on a shared handle must not interleave between threads


def _cudnn_type(cudnn: Any, dtype: torch.dtype) -> Any:
    types = {torch.float16: cudnn.data_type.HALF, torch.bfloat16: cudnn.data_type.BFLOAT16,
             torch.float32: cudnn.data_type.FLOAT}
    if dtype not in types:
        raise ValueError(f"FP8 convolution output dtype must be float16, bfloat16 or float32; got {dtype}")
    return types[dtype]


def _nhwc_stride(n: int, c: int, h: int, w: int) -> list[int]:
    return [c * h * w, 1, w * c, c]


class _ConvPlan:
    """One built cuDNN graph for one input shape and output dtype.

    fused: FP8 conv -> ``mul`` by the (1, K, 1, 1) scale -> ``bias``, written as NHWC ``out_dtype`` (one kernel).
    Not fused (when cuDNN does not support that epilogue with FP8 operands): the FP8 conv writes float32 NHWC
    (float32 because E4M3 products summed over C x r x s reach ~1e8, past float16's range) and torch applies the
    scale and bias (one more pass over the output).
    """

    def __init__(self, cudnn: Any, handle: Any, x_shape: tuple[int, ...], w_shape: tuple[int, ...],
                 stride: tuple[int, int], padding: tuple[int, int], out_dtype: torch.dtype, fused: bool) -> None:
        n, c, h, w = x_shape
        k, _, r, s = w_shape
        ho = (h + 2 * padding[0] - r) // stride[0] + 1
        wo = (w + 2 * padding[1] - s) // stride[1] + 1
        self.out_shape, self.fused = (n, k, ho, wo), fused
        self.out_dtype = out_dtype if fused else torch.float32
        io_type = _cudnn_type(cudnn, self.out_dtype)
        graph = cudnn.pygraph(io_data_type=io_type, intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT, handle=handle)
        fp8 = cudnn.data_type.FP8_E4M3
        self.x = graph.tensor(name="x", dim=[n, c, h, w], stride=_nhwc_stride(n, c, h, w), data_type=fp8)
        self.w = graph.tensor(name="w", dim=[k, c, r, s], stride=_nhwc_stride(k, c, r, s), data_type=fp8)
        y = graph.conv_fprop(image=self.x, weight=self.w, padding=list(padding), stride=list(stride),
                             dilation=[1, 1], compute_data_type=cudnn.data_type.FLOAT, name="conv")
        self.scale = self.bias = None
        if fused:
            self.scale = graph.tensor(name="scale", dim=[1, k, 1, 1], stride=[k, 1, k, k],
                                      data_type=cudnn.data_type.FLOAT)
            self.bias = graph.tensor(name="bias", dim=[1, k, 1, 1], stride=[k, 1, k, k], data_type=cudnn.data_type.FLOAT)
            y = graph.bias(input=graph.mul(a=y, b=self.scale, name="descale"), bias=self.bias, name="bias")
        self.y = y
        self.y.set_output(True).set_data_type(io_type)
        self.y.set_dim([n, k, ho, wo]).set_stride(_nhwc_stride(n, k, ho, wo))
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        self.graph = graph
        self.workspace_bytes = int(graph.get_workspace_size())


def _handle(cudnn: Any, device: torch.device) -> Any:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _handles:
        with torch.cuda.device(index):
            _handles[index] = cudnn.create_handle()
    return _handles[index]


def _plan(x_shape: tuple[int, ...], w_shape: tuple[int, ...], stride: tuple[int, int], padding: tuple[int, int],
          out_dtype: torch.dtype, device: torch.device) -> _ConvPlan:
    key = (device.index, x_shape, w_shape, stride, padding, out_dtype)
    plan = _plans.get(key)
    if plan is not None:
        return plan
    if _capturing():
        raise RuntimeError(
            f"FP8 convolution: no cuDNN plan for input {x_shape} -> filter {w_shape} yet, and plans cannot be "
            "built during CUDA-graph capture; run this batch size eagerly once first (warm-up)")
    reason = cudnn_frontend_unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    import cudnn

    with _plans_lock:
        plan = _plans.get(key)
        if plan is None:
            handle = _handle(cudnn, device)
            try:
                plan = _ConvPlan(cudnn, handle, x_shape, w_shape, stride, padding, out_dtype, fused=True)
            except Exception as exc:  # the epilogue is not supported with FP8 operands here: unfused
                logger.warning("cuDNN has no fused FP8 convolution + scale + bias for %s x %s (%s); the scale and "
                               "bias run as a separate pass", x_shape, w_shape, exc)
                try:
                    plan = _ConvPlan(cudnn, handle, x_shape, w_shape, stride, padding, out_dtype, fused=False)
                except Exception as exc2:
                    raise RuntimeError(f"cuDNN cannot run an FP8 convolution of {x_shape} x {w_shape}: {exc2}") from exc2
            _plans[key] = plan
            logger.info("built cuDNN FP8 convolution plan for %s x %s (fused epilogue: %s, workspace %d B)",
                        x_shape, w_shape, plan.fused, plan.workspace_bytes)
    return plan


@torch.library.custom_op("foundationpose::fp8_conv2d", mutates_args=())
def _fp8_conv2d_op(xq: Tensor, w_fp8: Tensor, out_scale: Tensor, bias: Tensor, stride: list[int],
                   padding: list[int], out_dtype: torch.dtype) -> Tensor:
    """cuDNN FP8 convolution. xq: (N, C, H, W) e4m3 channels-last; w_fp8: (K, C, r, s) e4m3 channels-last;
    out_scale, bias: (K,) float32. Returns (N, K, H', W') ``out_dtype`` channels-last."""
    import cudnn

    plan = _plan(tuple(xq.shape), tuple(w_fp8.shape), tuple(stride), tuple(padding), out_dtype, xq.device)
    y = torch.empty(plan.out_shape, dtype=plan.out_dtype, device=xq.device, memory_format=torch.channels_last)
    workspace = torch.empty(max(plan.workspace_bytes, 1), dtype=torch.uint8, device=xq.device)  # stream-ordered
    pack = {plan.x: xq, plan.w: w_fp8, plan.y: y}
    if plan.fused:
        pack.update({plan.scale: out_scale, plan.bias: bias})
    handle = _handle(cudnn, xq.device)
    with _execute_lock:
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(xq.device).cuda_stream)
        plan.graph.execute(pack, workspace, handle=handle)
    if plan.fused:
        return y
    out = torch.addcmul(bias.view(1, -1, 1, 1), y, out_scale.view(1, -1, 1, 1)).to(out_dtype)
    return out.contiguous(memory_format=torch.channels_last)  # the layout the fake implementation promises


@_fp8_conv2d_op.register_fake
def _(xq: Tensor, w_fp8: Tensor, out_scale: Tensor, bias: Tensor, stride: list[int], padding: list[int],
      out_dtype: torch.dtype) -> Tensor:
    n, _, h, w = xq.shape
    k, _, r, s = w_fp8.shape
    ho = (h + 2 * padding[0] - r) // stride[0] + 1
    wo = (w + 2 * padding[1] - s) // stride[1] + 1
    return torch.empty((n, k, ho, wo), dtype=out_dtype, device=xq.device, memory_format=torch.channels_last)


def _channels_last_weight(layer: Any) -> Tensor:
    w = layer.__dict__.get("_weight_nhwc")
    if w is None or w.device != layer.weight_fp8.device:
        # float8 copies are not implemented for every layout change: go through the byte view
        raw = layer.weight_fp8.view(torch.uint8).contiguous(memory_format=torch.channels_last)
        w = raw.view(layer.weight_fp8.dtype)
        if not _capturing():
            layer._weight_nhwc = w
    return w


def fp8_conv2d(x: Tensor, layer: Any) -> Tensor:
    """``Fp8Conv2d`` on CUDA: x (N, C, H, W) 16-bit or float32 (channels-last preferred) -> (N, K, H', W')."""
    xq = _quantize(x, layer.inv_input_scale)  # memory format of x kept
    if not xq.is_contiguous(memory_format=torch.channels_last):
        xq = xq.view(torch.uint8).contiguous(memory_format=torch.channels_last).view(xq.dtype)
    bias = layer.bias if layer.bias is not None else torch.zeros_like(layer.out_scale)
    return _fp8_conv2d_op(xq, _channels_last_weight(layer), layer.out_scale, bias, list(layer.stride),
                          list(layer.padding), x.dtype)
