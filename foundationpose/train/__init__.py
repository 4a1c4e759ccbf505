"""``python -m foundationpose.train``: object-specific training of RefineNet and ScoreNetMultiPair.

Modules, one job each: ``scenes`` (random RGB-D observations rendered on the device), ``batches`` (network
inputs built by the inference code), ``refiner_targets`` (perturbations and the update that undoes them),
``scorer_ranking`` (hypothesis sets and the listwise loss), ``loop`` (schedule, mixed precision, logs,
checkpoints, export in the official layout), ``loss_plot`` (PNG curves), ``config`` and ``cli``.
"""

from foundationpose.train.config import TrainConfig
from foundationpose.train.loop import Trainer

__all__ = ["TrainConfig", "Trainer"]
