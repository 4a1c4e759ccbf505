"""NHWC engine-interface adapters around the NCHW networks (spec section 6.1).

Every backend (PyTorch, ONNX Runtime, TensorRT) sees the same tensors:
inputs ``render_input`` (A) and ``transf_input`` (B), (N, 160, 160, 6) float32 NHWC;
refiner outputs ``trans``, ``rot`` (N, 3) float32; scorer output ``scores`` (N, 1) float32,
all N hypotheses forming one cross-attention set.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from foundationpose.models.refine_net import RefineNet
from foundationpose.models.score_net import ScoreNetMultiPair

__all__ = [
    "INPUT_NAMES",
    "REFINER_OUTPUT_NAMES",
    "SCORER_OUTPUT_NAMES",
    "RefinerHWC",
    "ScorerHWC",
]

INPUT_NAMES = ("render_input", "transf_input")
REFINER_OUTPUT_NAMES = ("trans", "rot")
SCORER_OUTPUT_NAMES = ("scores",)


def _as_float32(t: Tensor) -> Tensor:
    """Cast reduced-precision (autocast) outputs to float32; a no-op (no graph node) otherwise."""
    return t if t.dtype == torch.float32 else t.float()


class RefinerHWC(nn.Module):
    """``forward(render_input, transf_input) -> (trans, rot)`` on NHWC crops."""

    def __init__(self, refine_net: RefineNet) -> None:
        super().__init__()
        self.refine_net = refine_net

    def forward(self, render_input: Tensor, transf_input: Tensor) -> tuple[Tensor, Tensor]:
        """render_input, transf_input: (N, 160, 160, 6) float -> trans (N, 3), rot (N, 3) float32.

        The permute to NCHW is a view (channels-last strides); convolutions accept it as is.
        """
        a = render_input.permute(0, 3, 1, 2)  # (N, 6, 160, 160)
        b = transf_input.permute(0, 3, 1, 2)
        trans, rot = self.refine_net(a, b)
        return _as_float32(trans), _as_float32(rot)


class ScorerHWC(nn.Module):
    """``forward(render_input, transf_input) -> scores`` on NHWC crops; the batch is one set."""

    def __init__(self, score_net: ScoreNetMultiPair) -> None:
        super().__init__()
        self.score_net = score_net

    def forward(self, render_input: Tensor, transf_input: Tensor) -> Tensor:
        """render_input, transf_input: (N, 160, 160, 6) float -> scores (N, 1) float32 logits."""
        a = render_input.permute(0, 3, 1, 2)  # (N, 6, 160, 160)
        b = transf_input.permute(0, 3, 1, 2)
        logits = self.score_net(a, b)  # (1, N): one set
        return _as_float32(logits.transpose(0, 1))  # (N, 1)
