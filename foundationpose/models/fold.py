"""Inference copies of the networks: batch norms folded into their convolutions, input channels padded.

In eval mode ``bn(conv(x)) = conv'(x)`` with ``W' = W * g / sqrt(var + eps)`` and
``b' = (b - mean) * g / sqrt(var + eps) + beta``: the same function with one kernel (and one pass over the
activations) less per convolution. The values differ from the unfolded network by rounding only (the fold is
computed in the weights' float32, before any cast to half); the fast path on CUDA uses it
(:func:`foundationpose.networks.load_networks`), the CPU reference path does not. Checkpoints are untouched:
weights load into the official modules first, and the folded copy exists only for inference.

:func:`pad_input_channels` gives the first convolution 8 input channels instead of 6 (two zero input planes,
two zero weight planes): the same sums plus exact zeros. With 6 channels cuDNN runs that 7x7 convolution with a
slow sm80 fallback kernel (1.47 ms of a 12 ms refiner call at 252 on the H200); with 8 it still picks that kernel
family but takes 1.24 ms (about 1.4 ms less per register). Part of the CUDA fast path: the kernel's summation
order may change.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.utils.fusion import fuse_conv_bn_eval

from foundationpose.models.blocks import ConvBNReLU, ResBlock

__all__ = ["PaddedInputConv", "fold_batchnorm", "pad_input_channels"]


def fold_batchnorm(model: nn.Module) -> nn.Module:
    """An eval-mode deep copy of ``model`` with each ConvBNReLU / ResBlock batch norm folded into its conv.

    Raises ValueError if a BatchNorm that is not part of those blocks remains (its fold would be unknown).
    """
    folded = copy.deepcopy(model).eval()
    for module in folded.modules():
        if isinstance(module, ConvBNReLU):
            conv, bn = module.net[0], module.net[1]
            module.net[0], module.net[1] = fuse_conv_bn_eval(conv, bn), nn.Identity()
        elif isinstance(module, ResBlock):
            module.conv1, module.bn1 = fuse_conv_bn_eval(module.conv1, module.bn1), nn.Identity()
            module.conv2, module.bn2 = fuse_conv_bn_eval(module.conv2, module.bn2), nn.Identity()
    left = [name for name, m in folded.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if left:
        raise ValueError(f"fold_batchnorm: batch norms outside ConvBNReLU/ResBlock remain: {left}")
    return folded


class PaddedInputConv(nn.Module):
    """``conv`` on its input padded with zero channels up to ``conv.in_channels`` (the weights already padded)."""

    def __init__(self, conv: nn.Conv2d, extra: int) -> None:
        super().__init__()
        self.conv, self.extra = conv, int(extra)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.pad(x, (0, 0, 0, 0, 0, self.extra)))  # (N, C + extra, H, W), memory format kept


def pad_input_channels(model: nn.Module, multiple: int = 8) -> nn.Module:
    """An eval-mode deep copy of ``model`` whose first-encoder convolution takes ``multiple``-aligned channels.

    The network's input convolution is the first ConvBNReLU of ``encodeA`` / ``encoderA`` (RefineNet /
    ScoreNetMultiPair); its weight gets zero planes for the padded channels, so the function is unchanged.
    """
    padded = copy.deepcopy(model).eval()
    encoder = getattr(padded, "encodeA", None) or getattr(padded, "encoderA", None)
    if encoder is None or not isinstance(encoder[0], ConvBNReLU):
        raise ValueError(f"pad_input_channels: {type(model).__name__} has no encodeA/encoderA starting with ConvBNReLU")
    conv = encoder[0].net[0]
    extra = -conv.in_channels % multiple
    if extra == 0:
        return padded
    wide = nn.Conv2d(conv.in_channels + extra, conv.out_channels, conv.kernel_size, stride=conv.stride,
                     padding=conv.padding, bias=conv.bias is not None).to(conv.weight.device, conv.weight.dtype)
    with torch.no_grad():
        wide.weight.zero_()
        wide.weight[:, : conv.in_channels].copy_(conv.weight)
        if conv.bias is not None:
            wide.bias.copy_(conv.bias)
    encoder[0].net[0] = PaddedInputConv(wide, extra)
    return padded
