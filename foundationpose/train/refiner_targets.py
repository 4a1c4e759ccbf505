"""What the refiner is trained on: perturbed hypotheses around the truth and the update that undoes them.

The refiner's outputs mean (spec §2.7, :func:`foundationpose.pose_update.apply_refiner_output`):
``t_B = t_A + trans * d/2`` and ``R_B = exp(w)^T R_A`` with ``w = tanh(rot) * 20 deg``. The update that
lands on the truth ``(R, t)`` is therefore ``trans* = (t - t_A) / (d/2)`` and ``w* = log(R_A R^T)``; each
component of ``w*`` beyond the +-20 deg bound is clipped (the refiner moves as far as it can in that
direction; register's further iterations do the rest).

Perturbations mimic what the refiner sees at inference (a mixture, :class:`PerturbConfig`):
* register, first iterations: the nearest of the 252 grid rotations is up to ~35 deg off, the guessed
  translation sits on the visible surface (in front of the centre by up to ~d/2) near the mask-box centre;
* register, later iterations: a few degrees and a few percent of the diameter;
* track: the frame-to-frame motion, ~1-4 deg and ~1 cm.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from foundationpose.pose_update import ROT_NORMALIZER, so3_exp_map

__all__ = ["LOSS_KINDS", "PerturbConfig", "RefinerLoss", "RefinerLossConfig", "perturb_poses", "refiner_loss", "refiner_targets", "so3_log"]

_ROT_BOUND = float(np.float32(ROT_NORMALIZER))
_TARGET_CLIP = 0.97  # targets of tanh(rot) stay inside (-1, 1) (tanh's gradient vanishes at the bound)


@dataclass(frozen=True, slots=True, kw_only=True)
class PerturbConfig:
    """Mixture of perturbation scales (fractions sum to 1); angles in degrees, translations in diameters."""

    register_fraction: float = 0.45
    register_max_deg: float = 40.0  # angle ~ U(0, this)
    register_xy_diameters: float = 0.06  # std of the lateral offset
    register_depth_diameters: tuple[float, float] = (-0.55, 0.15)  # z offset ~ U(lo, hi) (negative = in front)
    refine_fraction: float = 0.3
    refine_deg: float = 8.0  # |N(0, this)|
    refine_diameters: float = 0.06  # N(0, this) per axis
    track_deg: float = 3.0  # the rest: track-like
    track_diameters: float = 0.02

    def __post_init__(self) -> None:
        if not (0 <= self.register_fraction and 0 <= self.refine_fraction
                and self.register_fraction + self.refine_fraction <= 1):
            raise ValueError("register_fraction and refine_fraction must be >= 0 and sum to <= 1, got "
                             f"{self.register_fraction}, {self.refine_fraction}")


def _random_axes(n: int, gen: torch.Generator) -> Tensor:
    axes = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    return axes / axes.norm(dim=1, keepdim=True).clamp(min=1e-12)


def perturb_poses(cam_from_centred: Tensor, diameter: float, gen: torch.Generator, cfg: PerturbConfig = PerturbConfig()) -> Tensor:
    """Hypotheses (n, 4, 4) float32 around the ground truth (n, 4, 4), on its device (CPU draws, ``gen``)."""
    n = cam_from_centred.shape[0]
    kind = torch.rand(n, generator=gen, dtype=torch.float64)
    register = kind < cfg.register_fraction
    refine = ~register & (kind < cfg.register_fraction + cfg.refine_fraction)
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    g = torch.randn(n, generator=gen, dtype=torch.float64).abs()
    angle_deg = torch.where(register, u * cfg.register_max_deg,
                            torch.where(refine, g * cfg.refine_deg, g * cfg.track_deg))
    omega = _random_axes(n, gen) * torch.deg2rad(angle_deg)[:, None]
    noise = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    z_reg = torch.rand(n, generator=gen, dtype=torch.float64) * (
        cfg.register_depth_diameters[1] - cfg.register_depth_diameters[0]) + cfg.register_depth_diameters[0]
    offset = torch.where(refine[:, None], noise * cfg.refine_diameters, noise * cfg.track_diameters)
    offset = torch.where(register[:, None], torch.cat([noise[:, :2] * cfg.register_xy_diameters, z_reg[:, None]], 1),
                         offset) * diameter
    gt = cam_from_centred.detach().to("cpu", torch.float64)
    out = gt.clone()
    # register: the guess lies on the visible surface, i.e. mostly in front of the centre (smaller camera z)
    out[:, :3, 3] = gt[:, :3, 3] + offset
    out[:, :3, :3] = so3_exp_map(omega) @ gt[:, :3, :3]
    return out.to(cam_from_centred.device, torch.float32)


def so3_log(rot: Tensor) -> Tensor:
    """Axis-angle vectors (n, 3) of rotations (n, 3, 3), angles in [0, pi) (accurate away from pi)."""
    trace = rot[:, 0, 0] + rot[:, 1, 1] + rot[:, 2, 2]
    cos = ((trace - 1) / 2).clamp(-1 + 1e-7, 1 - 1e-7)
    angle = torch.acos(cos)
    vee = torch.stack([rot[:, 2, 1] - rot[:, 1, 2], rot[:, 0, 2] - rot[:, 2, 0], rot[:, 1, 0] - rot[:, 0, 1]], dim=1)
    scale = torch.where(angle < 1e-4, 0.5 + angle * angle / 12, angle / (2 * torch.sin(angle)))
    return vee * scale[:, None]


def refiner_targets(hypotheses: Tensor, cam_from_centred_gt: Tensor, diameter: float) -> tuple[Tensor, Tensor]:
    """``(trans*, unit_rot*)`` (n, 3) float32: the translation output and ``tanh(rot)`` that reach the truth.

    trans* = (t_gt - t_A) / (d/2) (no tanh, spec §2.7); unit_rot* = clip(log(R_A R_gt^T) / 20deg, +-0.97).
    """
    rho = float(np.float32(diameter) / np.float32(2.0))
    pose_a = hypotheses.to(torch.float32)
    gt = cam_from_centred_gt.to(torch.float32)
    trans = (gt[:, :3, 3] - pose_a[:, :3, 3]) / rho
    omega = so3_log(pose_a[:, :3, :3] @ gt[:, :3, :3].transpose(1, 2))
    return trans, (omega / _ROT_BOUND).clamp(-_TARGET_CLIP, _TARGET_CLIP)


@dataclass(frozen=True, slots=True)
class RefinerLoss:
    total: Tensor
    trans: Tensor
    rot: Tensor


LOSS_KINDS = ("mse", "l1", "smooth_l1")


@dataclass(frozen=True, slots=True, kw_only=True)
class RefinerLossConfig:
    """Per-component loss of the two outputs, both in their own units (translation: d/2; tanh(rot): 20 deg).

    ``mse`` weighs each sample by its error, so the large register perturbations (targets clipped near the
    bound) dominate the gradient; ``l1`` / ``smooth_l1`` give small, track-scale errors the same pull per unit
    of error as large ones. ``smooth_l1_beta`` is where smooth-L1 turns quadratic (0.02 = 0.4 deg, 1 % of d).
    """

    kind: str = "l1"
    smooth_l1_beta: float = 0.02

    def __post_init__(self) -> None:
        if self.kind not in LOSS_KINDS:
            raise ValueError(f"kind must be one of {', '.join(LOSS_KINDS)}, got {self.kind!r}")
        if not self.smooth_l1_beta > 0:
            raise ValueError(f"smooth_l1_beta must be > 0, got {self.smooth_l1_beta}")


def _loss(pred: Tensor, target: Tensor, cfg: RefinerLossConfig) -> Tensor:
    """The mean per-component loss of ``cfg.kind`` (torch's own loss functions)."""
    if cfg.kind == "mse":
        return F.mse_loss(pred, target)
    if cfg.kind == "l1":
        return F.l1_loss(pred, target)
    return F.smooth_l1_loss(pred, target, beta=cfg.smooth_l1_beta)


def refiner_loss(trans_pred: Tensor, rot_pred: Tensor, trans_target: Tensor, unit_rot_target: Tensor,
                 cfg: RefinerLossConfig = RefinerLossConfig()) -> RefinerLoss:
    """Mean loss of the translation output (units of d/2) plus that of ``tanh(rot)`` (units of the 20 deg bound)."""
    trans_loss = _loss(trans_pred.float(), trans_target, cfg)
    rot_loss = _loss(torch.tanh(rot_pred.float()), unit_rot_target, cfg)
    return RefinerLoss(total=trans_loss + rot_loss, trans=trans_loss, rot=rot_loss)
