"""The two FoundationPose networks (spec section 4) and their NHWC engine adapters (spec 6.1)."""

from __future__ import annotations

from foundationpose.models.blocks import ConvBNReLU, PositionalEmbedding, ResBlock
from foundationpose.models.fold import fold_batchnorm
from foundationpose.models.hwc import (
    INPUT_NAMES,
    REFINER_OUTPUT_NAMES,
    SCORER_OUTPUT_NAMES,
    RefinerHWC,
    ScorerHWC,
)
from foundationpose.models.random_init import randomize_
from foundationpose.models.refine_net import RefineNet
from foundationpose.models.score_net import ScoreNetMultiPair

__all__ = [
    "INPUT_NAMES",
    "REFINER_OUTPUT_NAMES",
    "SCORER_OUTPUT_NAMES",
    "ConvBNReLU",
    "PositionalEmbedding",
    "RefineNet",
    "RefinerHWC",
    "ResBlock",
    "ScoreNetMultiPair",
    "ScorerHWC",
    "fold_batchnorm",
    "randomize_",
]
