"""Inference copies of the networks in which every matrix product is a module of its own.

In eval mode ``nn.TransformerEncoderLayer`` may run as one fused native op, and ScoreNetMultiPair's attention reads
its ``nn.MultiheadAttention`` parameters functionally (:func:`foundationpose.models.blocks.self_attention`): no
forward hook sees their linear layers and no module swap can replace one of them. :func:`unroll` returns a deep
copy in which each ``nn.TransformerEncoderLayer`` is an :class:`EncoderLayer` and each ``nn.MultiheadAttention`` a
:class:`~foundationpose.models.blocks.SelfAttention`, whose projections are ``nn.Linear`` children. The function
is the same (values within rounding: the summation order of the fused op may differ); the copy is what the
roofline times layer by layer.

Layer names of an unrolled network (the roofline's rows): the checkpoint's module names where they exist
(``encodeA.2.conv1``), and for the transformer heads ``trans_head.0.self_attn.in_proj``,
``trans_head.0.self_attn.out_proj``, ``trans_head.0.linear1``, ``trans_head.0.linear2``; the scorer's attention
``att.in_proj``, ``att.out_proj``, ``att_cross.in_proj``, ``att_cross.out_proj``.
Checkpoints are untouched: weights always load into the official modules first.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from foundationpose.models.blocks import SelfAttention

__all__ = ["EncoderLayer", "unroll"]


class EncoderLayer(nn.Module):
    """Post-norm transformer encoder layer (eval): ``x = norm1(x + self_attn(x)); x = norm2(x + ff(x))``.

    ``ff(x) = linear2(relu(linear1(x)))``; dropout is inactive at inference and left out. x: (B, T, E) -> same.
    Mirrors ``nn.TransformerEncoderLayer(norm_first=False, activation="relu", batch_first=True)`` (spec 4.3).
    """

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int, layer_norm_eps: float) -> None:
        super().__init__()
        self.self_attn = SelfAttention(d_model, nhead)
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.activation = nn.ReLU()
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps)

    @classmethod
    @torch.no_grad()
    def from_torch(cls, layer: nn.TransformerEncoderLayer) -> EncoderLayer:
        """A copy of a trained layer's parameters; refuses the variants this class does not compute."""
        act = layer.activation
        if layer.norm_first or not (act is F.relu or isinstance(act, nn.ReLU)) or not layer.self_attn.batch_first:
            raise ValueError("EncoderLayer.from_torch: needs a post-norm, ReLU, batch-first TransformerEncoderLayer")
        ref = layer.linear1.weight
        out = cls(layer.self_attn.embed_dim, layer.self_attn.num_heads, layer.linear1.out_features,
                  layer.norm1.eps).to(ref.device, ref.dtype)
        out.self_attn = SelfAttention.from_mha(layer.self_attn)
        for name in ("norm1", "linear1", "linear2", "norm2"):
            getattr(out, name).load_state_dict(getattr(layer, name).state_dict())
        return out.train(layer.training)

    def forward(self, x: Tensor) -> Tensor:
        x = self.norm1(x + self.self_attn(x))
        return self.norm2(x + self.linear2(self.activation(self.linear1(x))))


def _replace(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, module)


def unroll(model: nn.Module, *, inplace: bool = False) -> nn.Module:
    """``model`` (eval mode) with each transformer layer and multi-head attention as explicit modules.

    Returns a deep copy unless ``inplace``. Attention inside a replaced encoder layer is converted with it.
    """
    out = model if inplace else copy.deepcopy(model)
    out.eval()
    for name, module in list(out.named_modules()):
        if isinstance(module, nn.TransformerEncoderLayer):
            _replace(out, name, EncoderLayer.from_torch(module))
    for name, module in list(out.named_modules()):
        if isinstance(module, nn.MultiheadAttention):
            _replace(out, name, SelfAttention.from_mha(module))
    return out
