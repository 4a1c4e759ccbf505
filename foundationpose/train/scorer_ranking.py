"""What the scorer is trained on: sets of hypotheses of one observation, ranked by closeness to the truth.

At register the scorer sees the 252 refined hypotheses of one frame as one cross-attention set (spec §5):
a few have converged near the truth (errors of a fraction of a degree to a few degrees), the rest sit at
wrong poses, many of them at the local minima of a box-like shape (the truth turned by 90 or 180 deg about
one of the object's axes, where the silhouette nearly agrees). A training set mixes ``near`` hypotheses at
log-uniform scales from 0.3 to 30 deg (with proportional translation errors), such ``flipped`` ones (plus a
few degrees of noise) and uniformly random rotations, all with small translation errors.
The loss is a listwise cross-entropy of the set's logits against a sharp soft target over the hypotheses'
ADD (the closest one gets almost all the mass), so the argmax the service takes is what is trained.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F

from foundationpose.pose_update import so3_exp_map
from foundationpose.train.scenes import random_rotations

__all__ = ["RankingConfig", "add_per_hypothesis", "hypothesis_set", "ranking_loss"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RankingConfig:
    set_size: int = 16  # hypotheses per observation (inference: 252 in one set; attention averages over it)
    near_fraction: float = 0.4
    flip_fraction: float = 0.3  # of the set: the truth turned about an object axis (90 / 180 deg, or any angle)
    near_deg: tuple[float, float] = (0.3, 30.0)  # log-uniform angle range of the near hypotheses
    near_diameters_per_30deg: float = 0.12  # translation std of a near hypothesis at 30 deg (scales linearly)
    far_diameters: float = 0.08  # translation std of the random-rotation hypotheses
    # The flipped ones sit where a refined register hypothesis sits: depth fitted, so their translation is close
    flip_diameters: float = 0.01  # translation std of the flipped hypotheses
    flip_any_angle: float = 0.5  # of the flipped: turned by a uniform angle in [30, 330] deg (near-symmetric axes)
    temperature_diameters: float = 0.01  # soft-target temperature on ADD, in diameters

    def __post_init__(self) -> None:
        if self.set_size < 2:
            raise ValueError(f"set_size must be >= 2, got {self.set_size}")
        if not (0 < self.near_fraction <= 1 and 0 <= self.flip_fraction <= 1 - self.near_fraction):
            raise ValueError("need 0 < near_fraction <= 1 and 0 <= flip_fraction <= 1 - near_fraction, got "
                             f"{self.near_fraction}, {self.flip_fraction}")
        if not (self.flip_diameters >= 0 and 0 <= self.flip_any_angle <= 1):
            raise ValueError("need flip_diameters >= 0 and 0 <= flip_any_angle <= 1, got "
                             f"{self.flip_diameters}, {self.flip_any_angle}")


def hypothesis_set(cam_from_centred: Tensor, diameter: float, gen: torch.Generator, cfg: RankingConfig) -> Tensor:
    """(L, 4, 4) float32 hypotheses around one ground-truth pose (4, 4), in a random order, on its device."""
    size = cfg.set_size
    n_near = max(1, round(size * cfg.near_fraction))
    gt = cam_from_centred.detach().to("cpu", torch.float64)
    lo, hi = math.log(cfg.near_deg[0]), math.log(cfg.near_deg[1])
    angle = torch.exp(torch.rand(n_near, generator=gen, dtype=torch.float64) * (hi - lo) + lo)  # degrees
    axes = torch.randn(n_near, 3, generator=gen, dtype=torch.float64)
    axes = axes / axes.norm(dim=1, keepdim=True).clamp(min=1e-12)
    rot_near = so3_exp_map(axes * torch.deg2rad(angle)[:, None]) @ gt[:3, :3]
    t_near = gt[:3, 3] + torch.randn(n_near, 3, generator=gen, dtype=torch.float64) * (
        angle / 30.0 * cfg.near_diameters_per_30deg * diameter)[:, None]
    n_flip = min(size - n_near, round(size * cfg.flip_fraction))
    axis_index = torch.randint(0, 3, (n_flip,), generator=gen)
    flip_angle = torch.tensor([math.pi / 2, math.pi, -math.pi / 2], dtype=torch.float64)[
        torch.randint(0, 3, (n_flip,), generator=gen)]
    any_angle = torch.rand(n_flip, generator=gen, dtype=torch.float64) < cfg.flip_any_angle
    uniform = torch.deg2rad(30.0 + 300.0 * torch.rand(n_flip, generator=gen, dtype=torch.float64))
    flip_angle = torch.where(any_angle, uniform, flip_angle)
    flip = torch.zeros(n_flip, 3, dtype=torch.float64)
    flip[torch.arange(n_flip), axis_index] = flip_angle
    jitter = torch.randn(n_flip, 3, generator=gen, dtype=torch.float64) * math.radians(3.0)
    rot_flip = so3_exp_map(jitter) @ gt[:3, :3] @ so3_exp_map(flip)  # turned about an axis of the object frame
    t_flip = gt[:3, 3] + torch.randn(n_flip, 3, generator=gen, dtype=torch.float64) * cfg.flip_diameters * diameter
    n_far = size - n_near - n_flip
    rot_far = torch.cat([rot_flip, random_rotations(n_far, gen)])
    t_far = torch.cat([t_flip, gt[:3, 3] + torch.randn(n_far, 3, generator=gen, dtype=torch.float64)
                       * cfg.far_diameters * diameter])
    poses = torch.zeros(size, 4, 4, dtype=torch.float64)
    poses[:, :3, :3] = torch.cat([rot_near, rot_far])
    poses[:, :3, 3] = torch.cat([t_near, t_far])
    poses[:, 3, 3] = 1.0
    order = torch.randperm(size, generator=gen)
    return poses[order].to(cam_from_centred.device, torch.float32)


def add_per_hypothesis(hypotheses: Tensor, cam_from_centred_gt: Tensor, points_centred: Tensor) -> Tensor:
    """ADD (metres) of each hypothesis (..., 4, 4) against the truth (..., 4, 4) (broadcast) over points (P, 3)."""
    est = points_centred @ hypotheses[..., :3, :3].transpose(-1, -2) + hypotheses[..., None, :3, 3]
    ref = points_centred @ cam_from_centred_gt[..., :3, :3].transpose(-1, -2) + cam_from_centred_gt[..., None, :3, 3]
    return (est - ref).norm(dim=-1).mean(dim=-1)


def ranking_loss(logits: Tensor, add_m: Tensor, diameter: float, cfg: RankingConfig) -> tuple[Tensor, Tensor]:
    """Listwise loss of logits (B, L) against soft targets ``softmax(-ADD / (tau d))``; returns (loss, top-1 hit rate).

    The hit rate is the fraction of sets whose argmax is the hypothesis with the smallest ADD.
    """
    target = F.softmax(-add_m / (cfg.temperature_diameters * diameter), dim=1)
    loss = -(target * F.log_softmax(logits.float(), dim=1)).sum(dim=1).mean()
    hit = (logits.argmax(dim=1) == add_m.argmin(dim=1)).float().mean()
    return loss, hit
