"""Build the FP8 inference copy of a network from its calibrated scales.

``quantize_for_inference(net, scales)`` = :func:`inference_copy` (batch norms folded into the convolutions,
attention unrolled into modules) with every layer the scales mark ``fp8`` replaced by an
:class:`~foundationpose.quant.modules.Fp8Conv2d` / :class:`~foundationpose.quant.modules.Fp8Linear`. The other
layers are untouched: the inference core runs them at its own precision (fp16 on CUDA, fp32 on CPU). The copy has
the network's forward signature, so the NHWC adapters (``RefinerHWC`` / ``ScorerHWC``) wrap it unchanged.
"""

from __future__ import annotations

import copy
import os

import torch
from torch import nn

from foundationpose.quant.modules import BACKENDS, Fp8Conv2d, Fp8Linear, Fp8Module
from foundationpose.quant.scales import Fp8Scales, check_layers, inference_copy, load_scales

__all__ = [
    "fp8_backend_for",
    "fp8_core_precision",
    "inference_copy",
    "load_fp8_networks",
    "quantize_for_inference",
    "swap_layer",
]


def fp8_backend_for(device: torch.device | str, backend: str = "auto") -> str:
    """``auto`` -> ``kernels`` on CUDA, ``emulate`` elsewhere; ``kernels`` is checked against the device.

    Raises RuntimeError naming the missing piece (compute capability, cuDNN frontend) when kernels cannot run.
    """
    device = torch.device(device)
    if backend not in ("auto", *BACKENDS):
        raise ValueError(f"backend must be auto, emulate or kernels; got {backend!r}")
    if backend == "auto":
        backend = "kernels" if device.type == "cuda" else "emulate"
    if backend == "kernels":
        from foundationpose.quant._kernels import cudnn_frontend_unavailable_reason, fp8_unavailable_reason

        reason = fp8_unavailable_reason(device) or cudnn_frontend_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"precision fp8 cannot run its kernels here: {reason}")
    return backend


def swap_layer(model: nn.Module, name: str, module: nn.Module) -> nn.Module:
    """Replace the submodule ``name`` of ``model`` by ``module``; returns the one it replaced."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, child)
    setattr(parent, child, module)
    return old


def to_fp8(module: nn.Module, input_scale: float, backend: str) -> Fp8Module:
    """The FP8 twin of one eligible Conv2d / Linear layer."""
    if isinstance(module, nn.Conv2d):
        return Fp8Conv2d(module, input_scale, backend)
    if isinstance(module, nn.Linear):
        return Fp8Linear(module, input_scale, backend)
    raise TypeError(f"no FP8 layer for {type(module).__name__}")


@torch.no_grad()
def quantize_for_inference(net: nn.Module, scales: Fp8Scales, *, backend: str = "auto",
                           inference: nn.Module | None = None) -> nn.Module:
    """The FP8 inference copy of ``net`` (eval mode, on ``net``'s device); ``net`` itself is not modified.

    scales: from :func:`foundationpose.quant.scales.load_scales` (which checks them against the weights).
    backend: ``auto`` (kernels on CUDA, emulation elsewhere), ``emulate`` or ``kernels``.
    inference: an :func:`inference_copy` of ``net`` already made (it is modified in place and returned).
    Raises WeightsError when the scales do not list this network's layers.
    """
    model = inference if inference is not None else inference_copy(net)
    check_layers(scales, model, f"FP8 scales of the {scales.network}")
    device = next(model.parameters()).device
    backend = fp8_backend_for(device, backend)
    for layer in scales.fp8_layers:
        swap_layer(model, layer.name, to_fp8(model.get_submodule(layer.name), layer.input_scale, backend))
    return model.eval()


def load_fp8_networks(root: str | os.PathLike[str], refiner: nn.Module, scorer: nn.Module, *,
                      backend: str = "auto") -> tuple[nn.Module, nn.Module]:
    """The FP8 inference copies of both loaded networks, from the scales beside their checkpoints under ``root``.

    Raises WeightsError when a scales file is missing (naming the calibrate command), stale or mismatched, and
    RuntimeError when ``backend`` (``auto``: kernels on CUDA) cannot run on the networks' device.
    The copies' other layers are float32: the inference core casts them (:func:`fp8_core_precision`).
    """
    return (quantize_for_inference(refiner, load_scales(root, "refiner", refiner), backend=backend),
            quantize_for_inference(scorer, load_scales(root, "scorer", scorer), backend=backend))


def fp8_core_precision(device: torch.device | str) -> str:
    """The inference-core precision around the FP8 layers: fp16 on CUDA (the layers that stay 16-bit), fp32 on CPU."""
    return "fp16" if torch.device(device).type == "cuda" else "fp32"


def copy_with_fp8(model: nn.Module, layers: dict[str, float], backend: str = "emulate") -> nn.Module:
    """A deep copy of an inference copy with the named layers in FP8 (name -> input scale); for studies."""
    out = copy.deepcopy(model)
    for name, input_scale in layers.items():
        swap_layer(out, name, to_fp8(out.get_submodule(name), input_scale, backend))
    return out
