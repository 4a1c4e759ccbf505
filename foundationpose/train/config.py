"""Settings of one training run (``python -m foundationpose.train``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from foundationpose.train.refiner_targets import PerturbConfig, RefinerLossConfig
from foundationpose.train.scenes import SceneConfig
from foundationpose.train.scorer_ranking import RankingConfig

__all__ = ["TRAIN_SEED_LIMIT", "TrainConfig"]

# Training seeds its data generators with seed and seed + 1, both below 2**62; held-out evaluation views draw from
# seeds at or above 2**63 (foundationpose.evaluate.runs.held_out_seeds), so the two streams never share a seed.
TRAIN_SEED_LIMIT = 2**62


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainConfig:
    """One object-specific training run of both networks.

    The budget is ``minutes`` of training (wall clock, summed over resumed runs) or ``steps`` optimiser steps
    (both networks together), whichever ends first. The learning rate follows a warm-up + cosine schedule
    over the steps when ``steps`` is given (then a run is deterministic for a seed), else over the minutes.
    """

    mesh: Path
    out_dir: Path
    minutes: float = 7.0
    steps: int | None = None
    init: Path | None = None  # official-layout weights to fine-tune from; None = random init (seed)
    device: str = "auto"
    renderer: str = "auto"
    precision: str = "auto"  # auto = bf16 autocast on CUDA, fp32 on CPU; or fp32 / bf16 / fp16
    seed: int = 0
    refiner_batch: int = 128  # hypotheses per refiner step (H200, 7 min: 128 tracked the L block 2.5x closer than 64)
    hypotheses_per_scene: int = 4  # refiner hypotheses drawn around each synthetic observation
    scorer_sets: int = 4  # observations per scorer step, each one set of ``ranking.set_size`` hypotheses
    scorer_fraction: float = 0.35  # share of the optimiser steps that train the scorer
    lr: float = 4e-4  # peak AdamW learning rate of the refiner (and of the scorer when scorer_lr is None)
    # The scorer's attention has no norm or residual: at 4e-4 it learned in ~200 steps on the H200, then collapsed
    # to a constant output (loss ln(set_size)) and, for one object, to NaN weights. A lower peak keeps it learning.
    scorer_lr: float | None = 1.5e-4
    weight_decay: float = 1e-4
    warmup_steps: int = 150  # per network
    min_lr_fraction: float = 0.03  # the cosine ends at lr * this
    grad_clip: float = 1.0
    zero_init_heads: bool = True  # random init: the refiner's output heads start at "no update"
    frame_hw: tuple[int, int] = (256, 320)  # training observation size (a window of a larger virtual sensor)
    crop_size: int = 160  # network crop side (160 = the official networks; tests use less)
    log_every: int = 25  # optimiser steps per JSON log line
    checkpoint_minutes: float = 2.0  # resumable state (and the weights) written this often
    progress: bool = True
    scene: SceneConfig = field(default_factory=SceneConfig)
    perturb: PerturbConfig = field(default_factory=PerturbConfig)
    loss: RefinerLossConfig = field(default_factory=RefinerLossConfig)
    ranking: RankingConfig = field(default_factory=RankingConfig)

    def __post_init__(self) -> None:
        if not self.minutes > 0:
            raise ValueError(f"minutes must be > 0, got {self.minutes}")
        if not 0 <= self.seed < TRAIN_SEED_LIMIT - 1:
            raise ValueError(f"seed must be in [0, 2**62 - 1) (evaluation keeps the seeds above), got {self.seed}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1 or None, got {self.steps}")
        if self.refiner_batch < 1 or self.hypotheses_per_scene < 1 or self.refiner_batch % self.hypotheses_per_scene:
            raise ValueError("refiner_batch must be a positive multiple of hypotheses_per_scene, got "
                             f"{self.refiner_batch} and {self.hypotheses_per_scene}")
        if not self.lr > 0 or (self.scorer_lr is not None and not self.scorer_lr > 0):
            raise ValueError(f"lr and scorer_lr must be > 0, got {self.lr} and {self.scorer_lr}")
        if self.scorer_sets < 1:
            raise ValueError(f"scorer_sets must be >= 1, got {self.scorer_sets}")
        if not 0 <= self.scorer_fraction < 1:
            raise ValueError(f"scorer_fraction must be in [0, 1), got {self.scorer_fraction}")
        if self.precision not in ("auto", "fp32", "bf16", "fp16"):
            raise ValueError(f"precision must be auto, fp32, bf16 or fp16, got {self.precision!r}")
        if self.crop_size % 8 or not 8 <= self.crop_size <= 160:
            raise ValueError(f"crop_size must be a multiple of 8 in [8, 160] (400 positional rows), got {self.crop_size}")
        if self.log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {self.log_every}")
