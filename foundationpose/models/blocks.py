"""Building blocks shared by RefineNet and ScoreNetMultiPair (spec section 4.1 and 4.2).

Submodule names are part of the checkpoint format: ``ConvBNReLU.net.{0,1}`` and
``ResBlock.{conv1,bn1,conv2,bn2}`` must stay exactly as they are so that the official
``model_best.pth`` files load strictly (spec section 4.6).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "C_IN",
    "D_MODEL",
    "CROP_SIZE",
    "N_HEADS",
    "MAX_TOKENS",
    "ConvBNReLU",
    "ResBlock",
    "PositionalEmbedding",
    "ScaledDotProductAttention",
    "SelfAttention",
    "make_encoder_a",
    "make_encoder_ab",
    "siamese_tokens",
    "self_attention",
]

C_IN = 6  # channels per branch: R, G, B in [0, 1], X, Y, Z normalised (spec 2.9 c_in)
CROP_SIZE = 160  # S: network crop side in pixels, the one home of 160 (spec §0 S, §2.8/§2.9 input_resize)
_ENCODER_STRIDE = 8  # encoder + ViT tokeniser: 160 -> 20 x 20 tokens (spec §4.2)
D_MODEL = 512  # token width
N_HEADS = 4  # attention heads (head dim 128)
MAX_TOKENS = (CROP_SIZE // _ENCODER_STRIDE) ** 2  # 400 = 20 x 20 feature map of a 160 x 160 crop (the checkpoints' pe)


class ConvBNReLU(nn.Module):
    """Conv2d(k x k, stride, padding (k-1)//2, bias) -> BatchNorm2d -> ReLU.

    Keys: ``net.0`` (conv), ``net.1`` (batch norm); ``net.2`` is the parameter-free ReLU.
    """

    def __init__(self, c_in: int, c_out: int, kernel_size: int, stride: int = 1) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(c_in, c_out, kernel_size, stride=stride, padding=(kernel_size - 1) // 2, bias=True),
            nn.BatchNorm2d(c_out, eps=1e-5, momentum=0.1),
            nn.ReLU(inplace=True),
        )

    def forward(self, x: Tensor) -> Tensor:
        """x: (N, c_in, H, W) -> (N, c_out, ceil(H/stride), ceil(W/stride))."""
        return self.net(x)


class ResBlock(nn.Module):
    """Basic ResNet block without downsampling: relu(x + bn2(conv2(relu(bn1(conv1(x)))))).

    Both convolutions are 3 x 3, padding 1, with bias. Shape-preserving: (N, C, H, W) -> same.
    """

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=True)
        self.bn1 = nn.BatchNorm2d(channels, eps=1e-5, momentum=0.1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=True)
        self.bn2 = nn.BatchNorm2d(channels, eps=1e-5, momentum=0.1)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.relu(y + x)


def sinusoid_table(max_len: int = MAX_TOKENS, d_model: int = D_MODEL) -> Tensor:
    """The fixed positional table (1, max_len, d_model) float32.

    ``pe[p, 2i] = sin(p * 10000^(-2i/d))``, ``pe[p, 2i+1] = cos(p * 10000^(-2i/d))``; evaluated in
    float64 and rounded once to float32 (the checkpoint stores its own copy, which wins on load).
    """
    position = torch.arange(max_len, dtype=torch.float64)[:, None]  # (T, 1)
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    angle = position * inv_freq[None, :]  # (T, d/2)
    pe = torch.empty(max_len, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle)
    return pe.to(torch.float32)[None]  # (1, T, d)


class PositionalEmbedding(nn.Module):
    """Adds the sinusoidal table (persistent buffer ``pe`` (1, 400, 512)) to a token sequence."""

    def __init__(self, d_model: int = D_MODEL, max_len: int = MAX_TOKENS) -> None:
        super().__init__()
        self.register_buffer("pe", sinusoid_table(max_len, d_model), persistent=True)

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens: (N, T, d) with T <= 400 -> tokens + pe[:, :T] (N, T, d)."""
        n_tokens = tokens.shape[1]
        if not torch.jit.is_tracing() and n_tokens > self.pe.shape[1]:
            raise ValueError(
                f"{n_tokens} tokens exceed the positional table ({self.pe.shape[1]}); "
                f"the networks take {CROP_SIZE}x{CROP_SIZE} crops only"
            )
        return tokens + self.pe[:, :n_tokens]


def make_encoder_a(c_in: int = C_IN) -> nn.Sequential:
    """Per-image encoder (spec 4.2 encA): (2N, 6, 160, 160) -> (2N, 128, 40, 40)."""
    return nn.Sequential(
        ConvBNReLU(c_in, 64, kernel_size=7, stride=2),
        ConvBNReLU(64, 128, kernel_size=3, stride=2),
        ResBlock(128),
        ResBlock(128),
    )


def make_encoder_ab() -> nn.Sequential:
    """Pair encoder (spec 4.2 encAB): (N, 256, 40, 40) -> (N, 512, 20, 20)."""
    return nn.Sequential(
        ResBlock(256),
        ResBlock(256),
        ConvBNReLU(256, D_MODEL, kernel_size=3, stride=2),
        ResBlock(D_MODEL),
        ResBlock(D_MODEL),
    )


def siamese_tokens(
    encoder_a: nn.Module, encoder_ab: nn.Module, pos_embed: PositionalEmbedding, a: Tensor, b: Tensor
) -> Tensor:
    """Shared ("Siamese") encoder of spec 4.2, returning position-embedded tokens.

    a: (N, 6, 160, 160) rendered crops, b: (N, 6, 160, 160) real crops, same dtype/device.
    Both are stacked along the batch ([a; b], 2N images) through ``encoder_a``, split, and
    concatenated along channels with a first (channels 0-127 rendered, 128-255 real).
    Returns (N, 400, 512), token index = row * 20 + col.
    """
    n = a.shape[0]
    x = encoder_a(torch.cat([a, b], dim=0))  # (2N, 128, 40, 40)
    x = torch.cat([x[:n], x[n:]], dim=1)  # (N, 256, 40, 40)
    x = encoder_ab(x)  # (N, 512, 20, 20)
    tokens = x.flatten(2).transpose(1, 2)  # (N, 400, 512)
    return pos_embed(tokens)


def self_attention(mha: nn.Module, x: Tensor) -> Tensor:
    """Self-attention with the parameters of a batch-first ``nn.MultiheadAttention`` (eval, no mask).

    x: (B, T, E) -> (B, T, E); equals ``mha(x, x, x, need_weights=False)[0]`` up to rounding.
    Standard scaled dot-product attention: heads of E / num_heads channels, scale
    1/sqrt(head dim), softmax over keys (spec 4.4). Written with shape-agnostic ops
    (``unflatten``/``flatten``) so that ONNX export keeps both B and T dynamic, which
    ``nn.MultiheadAttention``'s own forward does not when T is the dynamic axis.

    ``mha`` may also be a :class:`SelfAttention` (the inference copies of
    :mod:`foundationpose.models.unrolled`), which computes the same function itself.
    """
    if isinstance(mha, SelfAttention):
        return mha(x)
    n_heads = mha.num_heads
    qkv = F.linear(x, mha.in_proj_weight, mha.in_proj_bias)  # (B, T, 3E): [q | k | v]
    q, k, v = (t.unflatten(-1, (n_heads, -1)).transpose(1, 2) for t in qkv.chunk(3, dim=-1))  # (B, h, T, d)
    out = F.scaled_dot_product_attention(q, k, v, scale=mha.head_dim**-0.5)  # (B, h, T, d)
    out = out.transpose(1, 2).flatten(-2)  # (B, T, E)
    return F.linear(out, mha.out_proj.weight, mha.out_proj.bias)


class ScaledDotProductAttention(nn.Module):
    """``F.scaled_dot_product_attention(q, k, v, scale=scale)`` as a module (so hooks and profilers see it).

    q: (B, h, T, d), k, v: (B, h, S, d) -> (B, h, T, d); no mask, no dropout.
    """

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = float(scale)

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, scale=self.scale)

    def extra_repr(self) -> str:
        return f"scale={self.scale:.6g}"


class SelfAttention(nn.Module):
    """The function of :func:`self_attention` with each matrix product in a module of its own.

    ``in_proj`` (E -> 3E, rows [q | k | v]) and ``out_proj`` (E -> E) are ``nn.Linear`` children, so they can
    be hooked or replaced one by one (the roofline). Build it from a trained ``nn.MultiheadAttention``
    with :meth:`from_mha`; x: (B, T, E) -> (B, T, E).
    """

    def __init__(self, embed_dim: int = D_MODEL, num_heads: int = N_HEADS) -> None:
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} is not a multiple of num_heads {num_heads}")
        self.num_heads = num_heads
        self.in_proj = nn.Linear(embed_dim, 3 * embed_dim)
        self.attend = ScaledDotProductAttention((embed_dim // num_heads) ** -0.5)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    @classmethod
    @torch.no_grad()
    def from_mha(cls, mha: nn.MultiheadAttention) -> SelfAttention:
        """A copy of ``mha``'s parameters (batch-first, packed in-projection with bias, no k/v bias terms)."""
        if not mha.batch_first or not mha._qkv_same_embed_dim or mha.in_proj_bias is None or mha.bias_k is not None:
            raise ValueError("SelfAttention.from_mha: needs a batch-first nn.MultiheadAttention with a packed, "
                             "biased in-projection and no add_bias_kv")
        ref = mha.in_proj_weight
        out = cls(mha.embed_dim, mha.num_heads).to(ref.device, ref.dtype)
        out.in_proj.weight.copy_(mha.in_proj_weight)
        out.in_proj.bias.copy_(mha.in_proj_bias)
        out.out_proj.weight.copy_(mha.out_proj.weight)
        out.out_proj.bias.copy_(mha.out_proj.bias)
        return out.train(mha.training)

    def forward(self, x: Tensor) -> Tensor:
        qkv = self.in_proj(x)  # (B, T, 3E): [q | k | v]
        q, k, v = (t.unflatten(-1, (self.num_heads, -1)).transpose(1, 2) for t in qkv.chunk(3, dim=-1))  # (B, h, T, d)
        out = self.attend(q, k, v)  # (B, h, T, d)
        return self.out_proj(out.transpose(1, 2).flatten(-2))  # (B, T, E)
