"""Deterministic random initialisation that behaves like trained weights numerically.

Used when the official checkpoints are not available (tests, benchmarks, demos): the
compute is the real one, the poses are meaningless.

Every value is drawn from one ``torch.Generator`` seeded with ``seed`` (CPU generator, so
the same seed gives the same tensors on every machine and never touches the global RNG):

* Conv2d / Linear weights and biases: PyTorch's default distributions
  (kaiming-uniform with a = sqrt(5); bias U(+-1/sqrt(fan_in))).
* MultiheadAttention ``in_proj_weight``: xavier-uniform (PyTorch's default); the biases that
  PyTorch zero-initialises get small random values so every parameter is exercised.
* LayerNorm / BatchNorm affine parameters: around 1 / 0 with a small random spread.
* BatchNorm running statistics: the moments of the preceding convolution's output (float64),
  computed from its weights and an analytic estimate of its input's per-channel mean and
  variance, propagated through the encoder (network input: RGB ~ U(0, 1), XYZ ~ N(0, 0.1);
  after a ConvBNReLU: relu of a unit normal; after a ResBlock: relu(x + unit normal) with a
  Gaussian approximation), times a random factor in [0.75, 1.25]. Batch-normalised activations
  are then roughly unit-scale, as with trained weights, so fp16 neither overflows nor flushes
  features to zero, and the image features are not drowned by the positional table.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from foundationpose.models.blocks import C_IN, ConvBNReLU, ResBlock

__all__ = ["randomize_"]

# Assumed per-channel statistics of the network input (RGB in [0, 1]; normalised XYZ about 0).
_INPUT_MEAN = (0.5, 0.5, 0.5, 0.0, 0.0, 0.0)
_INPUT_VAR = (1.0 / 12.0,) * 3 + (0.1,) * 3
# Mean and variance of relu(z), z ~ N(0, 1).
_RELU_MEAN = 1.0 / math.sqrt(2.0 * math.pi)
_RELU_VAR = 0.5 - 1.0 / (2.0 * math.pi)


def _uniform(t: Tensor, low: float, high: float, g: torch.Generator) -> None:
    t.copy_(torch.empty(t.shape, dtype=torch.float32).uniform_(low, high, generator=g))


def _default_dense_init(weight: Tensor, bias: Tensor | None, g: torch.Generator) -> None:
    """PyTorch's default Conv/Linear init, drawn from ``g``."""
    w = torch.empty(weight.shape, dtype=torch.float32)
    nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=g)
    weight.copy_(w)
    if bias is not None:
        fan_in = weight[0].numel()
        bound = 1.0 / math.sqrt(fan_in)
        _uniform(bias, -bound, bound, g)


def _bn_stats_from_conv(
    conv: nn.Conv2d, bn: nn.BatchNorm2d, in_mean: Tensor, in_var: Tensor, g: torch.Generator
) -> None:
    """Running mean/var of ``bn`` = moments of ``conv``'s output for independent inputs.

    in_mean, in_var: (C_in,) float64 estimated moments of ``conv``'s input.
    """
    w = conv.weight.detach().to(torch.float64)  # (C_out, C_in, k, k)
    mean = (w * in_mean[None, :, None, None]).sum(dim=(1, 2, 3)) + conv.bias.detach().to(torch.float64)
    var = (w.square() * in_var[None, :, None, None]).sum(dim=(1, 2, 3))
    factor = torch.empty(var.shape, dtype=torch.float64).uniform_(0.75, 1.25, generator=g)
    bn.running_mean.copy_(mean.to(torch.float32))
    bn.running_var.copy_((var * factor).to(torch.float32))


def _relu_moments(mean: Tensor, var: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and variance of relu(z) for z ~ N(mean, var) (elementwise, float64)."""
    std = var.sqrt()
    alpha = mean / std
    cdf = 0.5 * (1.0 + torch.erf(alpha / math.sqrt(2.0)))
    pdf = torch.exp(-0.5 * alpha.square()) / math.sqrt(2.0 * math.pi)
    out_mean = mean * cdf + std * pdf
    second = (mean.square() + var) * cdf + mean * std * pdf
    return out_mean, (second - out_mean.square()).clamp_min(1e-6)


def _init_bn_statistics(model: nn.Module, g: torch.Generator) -> None:
    """Second pass: BatchNorm statistics, walking the encoder blocks in forward order.

    Registration order of ConvBNReLU / ResBlock modules equals their forward order in both
    networks (encoder A, then encoder AB; the channel concat keeps per-channel moments).
    """
    if len(_INPUT_MEAN) != C_IN:
        raise ValueError(f"input moments are given for {len(_INPUT_MEAN)} channels, expected {C_IN}")
    f64 = torch.float64
    unit_mean, unit_var = torch.zeros(1, dtype=f64), torch.ones(1, dtype=f64)
    relu_mean, relu_var = _relu_moments(unit_mean, unit_var)  # of relu(bn(...))
    mean, var = torch.tensor(_INPUT_MEAN, dtype=f64), torch.tensor(_INPUT_VAR, dtype=f64)
    for module in model.modules():
        if isinstance(module, ConvBNReLU):
            conv, bn = module.net[0], module.net[1]
            _bn_stats_from_conv(conv, bn, _expand(mean, conv.in_channels), _expand(var, conv.in_channels), g)
            mean, var = relu_mean, relu_var
        elif isinstance(module, ResBlock):
            c = module.conv1.in_channels
            _bn_stats_from_conv(module.conv1, module.bn1, _expand(mean, c), _expand(var, c), g)
            _bn_stats_from_conv(module.conv2, module.bn2, _expand(relu_mean, c), _expand(relu_var, c), g)
            mean, var = _relu_moments(mean, var + unit_var)  # relu(x + roughly unit-normal branch)


def _expand(moment: Tensor, channels: int) -> Tensor:
    """A (1,) or (channels,) moment as (channels,)."""
    if moment.numel() == 1:
        return moment.expand(channels)
    if moment.numel() != channels:
        raise ValueError(f"moment of {moment.numel()} channels for a layer of {channels}")
    return moment


@torch.no_grad()
def randomize_(model: nn.Module, seed: int = 0) -> nn.Module:
    """Overwrite every parameter and BatchNorm statistic of ``model`` in place; returns it.

    Deterministic for a given ``seed`` and architecture (visits modules in registration order).
    The positional table ``pe`` is left as built (it is a fixed function, spec 4.1).
    """
    g = torch.Generator(device="cpu").manual_seed(int(seed))
    for module in model.modules():
        if isinstance(module, nn.MultiheadAttention):
            w = torch.empty(module.in_proj_weight.shape, dtype=torch.float32)
            nn.init.xavier_uniform_(w, generator=g)
            module.in_proj_weight.copy_(w)
            _uniform(module.in_proj_bias, -0.02, 0.02, g)
            # out_proj is a Linear child: initialised when the loop reaches it.
        elif isinstance(module, (nn.Conv2d, nn.Linear)):
            _default_dense_init(module.weight, module.bias, g)
        elif isinstance(module, nn.LayerNorm):
            _uniform(module.weight, 0.9, 1.1, g)
            _uniform(module.bias, -0.05, 0.05, g)
        elif isinstance(module, nn.BatchNorm2d):
            _uniform(module.weight, 0.8, 1.2, g)
            _uniform(module.bias, -0.1, 0.1, g)
    _init_bn_statistics(model, g)
    return model
