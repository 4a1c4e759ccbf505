"""RefineNet: predicts a pose correction from a (rendered, real) crop pair (spec section 4.3)."""

from __future__ import annotations

from torch import Tensor, nn

from foundationpose.models.blocks import (
    D_MODEL,
    N_HEADS,
    PositionalEmbedding,
    make_encoder_a,
    make_encoder_ab,
    siamese_tokens,
)

__all__ = ["RefineNet"]


def _make_head(n_out: int) -> nn.Sequential:
    """Post-norm transformer encoder layer followed by a per-token Linear(512 -> n_out)."""
    return nn.Sequential(
        nn.TransformerEncoderLayer(
            d_model=D_MODEL,
            nhead=N_HEADS,
            dim_feedforward=512,
            dropout=0.1,  # inactive in eval mode
            activation="relu",
            layer_norm_eps=1e-5,
            batch_first=True,
            norm_first=False,
        ),
        nn.Linear(D_MODEL, n_out),
    )


class RefineNet(nn.Module):
    """The refiner of the official checkpoint run ``2023-10-28-18-33-37`` (axis-angle rotation).

    state_dict: 134 keys in the order of spec 4.6.1 (``encodeA``, ``encodeAB``, ``pos_embed``,
    ``trans_head``, ``rot_head``); 16,830,406 parameters.
    """

    def __init__(self) -> None:
        super().__init__()
        self.encodeA = make_encoder_a()
        self.encodeAB = make_encoder_ab()
        self.pos_embed = PositionalEmbedding()
        self.trans_head = _make_head(3)
        self.rot_head = _make_head(3)

    def forward(self, A: Tensor, B: Tensor) -> tuple[Tensor, Tensor]:
        """A: rendered crops, B: real crops, both (N, 6, 160, 160) NCHW, same dtype and device.

        Channels R, G, B in [0, 1] then X, Y, Z normalised (spec 1.4.4).
        Returns ``trans`` (N, 3) (multiply by d/2 for metres, camera frame) and ``rot`` (N, 3)
        (raw axis-angle; apply tanh * 20 deg, spec 2.7), each the mean over the 400 tokens of a
        per-token linear layer.
        """
        tokens = siamese_tokens(self.encodeA, self.encodeAB, self.pos_embed, A, B)  # (N, 400, 512)
        trans = self.trans_head(tokens).mean(dim=1)  # (N, 400, 3) -> (N, 3)
        rot = self.rot_head(tokens).mean(dim=1)  # (N, 3)
        return trans, rot
