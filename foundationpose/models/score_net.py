"""ScoreNetMultiPair: ranks a set of pose hypotheses with cross-attention (spec section 4.4)."""

from __future__ import annotations

from torch import Tensor, nn

from foundationpose.models.blocks import (
    D_MODEL,
    N_HEADS,
    PositionalEmbedding,
    make_encoder_a,
    make_encoder_ab,
    self_attention,
    siamese_tokens,
)

__all__ = ["ScoreNetMultiPair"]


class ScoreNetMultiPair(nn.Module):
    """The scorer of the official checkpoint run ``2024-01-11-20-02-45``.

    state_dict: 116 keys in the order of spec 4.6.2 (``encoderA``, ``encoderAB``, ``att``,
    ``att_cross``, ``pos_embed``, ``linear``); 15,773,121 parameters.

    A hypothesis' logit depends on every other hypothesis of its set (``att_cross``), so a set
    must be scored in one call; splitting it changes the numbers.
    """

    def __init__(self) -> None:
        super().__init__()
        self.encoderA = make_encoder_a()
        self.encoderAB = make_encoder_ab()
        self.att = nn.MultiheadAttention(D_MODEL, N_HEADS, dropout=0.0, bias=True, batch_first=True)
        self.att_cross = nn.MultiheadAttention(D_MODEL, N_HEADS, dropout=0.0, bias=True, batch_first=True)
        self.pos_embed = PositionalEmbedding()
        self.linear = nn.Linear(D_MODEL, 1)

    def forward(self, A: Tensor, B: Tensor, L: int | None = None) -> Tensor:
        """A: rendered crops, B: real crops, both (N, 6, 160, 160) NCHW, same dtype and device.

        L: hypotheses per set; N must be a multiple of it. ``None`` (the reference's use): the
        whole batch is one set, B = 1, L = N.
        Returns the raw score logits (N // L, L); higher is better, no threshold applies.
        """
        n = A.shape[0]
        if L is not None and (L < 1 or n % L != 0):
            raise ValueError(f"L must divide the batch: got N={n}, L={L}")
        tokens = siamese_tokens(self.encoderA, self.encoderAB, self.pos_embed, A, B)  # (N, 400, 512)
        x = self_attention(self.att, tokens)  # (N, 400, 512); no residual, no norm
        x = x.mean(dim=1)  # (N, 512)
        x = x.unsqueeze(0) if L is None else x.reshape(n // L, L, D_MODEL)  # (B, L, 512)
        x = self_attention(self.att_cross, x)  # (B, L, 512); across the hypotheses of a set
        return self.linear(x).squeeze(-1)  # (B, L)
