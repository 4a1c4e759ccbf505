"""Inference copies of the networks with every BatchNorm folded into the convolution before it.

In eval mode ``bn(conv(x)) = conv'(x)`` with ``W' = W * g / sqrt(var + eps)`` and
``b' = (b - mean) * g / sqrt(var + eps) + beta``: the same function with one kernel (and one pass over the
activations) less per convolution. The values differ from the unfolded network by rounding only (the fold is
computed in the weights' float32, before any cast to half); :func:`fold_batchnorm` is opt-in
(``NetworkConfig.fold_batchnorm``) so that change of rounding is never silent. Checkpoints are untouched:
weights load into the official modules first, and the folded copy exists only for inference.
"""

from __future__ import annotations

import copy

from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval

from foundationpose.models.blocks import ConvBNReLU, ResBlock

__all__ = ["fold_batchnorm"]


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
