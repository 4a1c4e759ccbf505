"""Turn the refiner's raw outputs into updated poses (spec §2.7).

Checkpoint config: ``rot_rep = axis_angle``, ``trans_rep = tracknet``, ``normalize_xyz = true``,
``rot_normalizer = 0.3490658503988659`` (20 degrees). With ``normalize_xyz`` the translation output is
scaled by the mesh radius ``d / 2`` and has **no** tanh; ``trans_normalizer`` is unused.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from foundationpose.diameters import RowDiameters

__all__ = ["ROT_NORMALIZER", "SO3_EXP_EPS", "so3_exp_map", "apply_refiner_output"]

ROT_NORMALIZER = 0.3490658503988659  # radians (20 deg), checkpoint config rot_normalizer (spec §2.7)
SO3_EXP_EPS = 1e-4  # pytorch3d so3_exp_map: angle = sqrt(max(|omega|^2, eps))


def _hat(omega: Tensor) -> Tensor:
    """Skew matrices [omega]x (N, 3, 3) of axis-angle vectors (N, 3)."""
    n = omega.shape[0]
    skew = omega.new_zeros((n, 3, 3))
    x, y, z = omega.unbind(dim=1)
    skew[:, 0, 1] = -z
    skew[:, 0, 2] = y
    skew[:, 1, 0] = z
    skew[:, 1, 2] = -x
    skew[:, 2, 0] = -y
    skew[:, 2, 1] = x
    return skew


def so3_exp_map(omega: Tensor, eps: float = SO3_EXP_EPS) -> Tensor:
    """Rotation matrices from axis-angle vectors with pytorch3d ``so3_exp_map`` semantics.

    omega: (N, 3) float32 axis-angle (radians), any device.
    Returns (N, 3, 3), same dtype/device: ``R = fac1 [w]x + fac2 [w]x^2 + I`` with
    ``theta = sqrt(max(|w|^2, eps))``, ``fac1 = sin(theta) / theta``, ``fac2 = (1 - cos(theta)) / theta^2``,
    evaluated in pytorch3d's operation order. For ``|w| < 0.01`` the factors use ``theta = 0.01`` (a tiny
    deviation from exact Rodrigues, kept for parity); ``w = 0`` gives exactly ``I``.
    """
    assert omega.ndim == 2 and omega.shape[1] == 3, omega.shape
    norms_sq = (omega * omega).sum(1)  # (N,)
    angles = torch.clamp(norms_sq, eps).sqrt()
    angles_inv = 1.0 / angles
    fac1 = angles_inv * angles.sin()
    fac2 = angles_inv * angles_inv * (1.0 - angles.cos())
    skews = _hat(omega)  # (N, 3, 3)
    skews_sq = torch.bmm(skews, skews)
    eye = torch.eye(3, dtype=omega.dtype, device=omega.device)[None]
    return fac1[:, None, None] * skews + fac2[:, None, None] * skews_sq + eye


def apply_refiner_output(cam_from_centred: Tensor, trans: Tensor, rot: Tensor,
                         diameter: float | RowDiameters) -> Tensor:
    """New poses from the refiner outputs for hypotheses ``cam_from_centred`` (spec §2.7).

    cam_from_centred: (N, 4, 4) float32 poses ``T_A`` used to build this iteration's crops.
    trans, rot: (N, 3) raw refiner outputs (cast to float32). diameter: mesh diameter, metres, or one per row
    (:class:`~foundationpose.diameters.RowDiameters`: row i uses its ``rho32``, the scalar's value).
    Returns (N, 4, 4) float32 ``T_B``: ``t_B = t_A + trans * rho32`` (``rho32 = float32(d) / 2``, no tanh)
    and ``R_B = exp([w]x)^T R_A`` with ``w = tanh(rot) * float32(0.3490658503988659)`` (each component
    within +-20 deg); the rotation acts in the camera frame about the centred-mesh origin.
    """
    assert cam_from_centred.ndim == 3 and cam_from_centred.shape[1:] == (4, 4), cam_from_centred.shape
    n = cam_from_centred.shape[0]
    assert trans.shape == (n, 3) and rot.shape == (n, 3), (trans.shape, rot.shape)
    pose_a = cam_from_centred.to(torch.float32)
    if isinstance(diameter, RowDiameters):
        trans_delta = trans.to(torch.float32) * diameter.rho32[:, None]  # (N, 3) metres, row i: its radius
    else:
        rho32 = float(np.float32(diameter) / np.float32(2.0))
        trans_delta = trans.to(torch.float32) * rho32  # (N, 3) metres, camera frame
    omega = torch.tanh(rot.to(torch.float32)) * float(np.float32(ROT_NORMALIZER))  # (N, 3)
    rot_delta = so3_exp_map(omega).permute(0, 2, 1)  # (N, 3, 3) = exp(w)^T
    pose_b = torch.zeros_like(pose_a)
    pose_b[:, 3, 3].fill_(1.0)  # fill_: no tensor literal (a host-to-device copy on CUDA)
    pose_b[:, :3, 3] = pose_a[:, :3, 3] + trans_delta
    pose_b[:, :3, :3] = rot_delta @ pose_a[:, :3, :3]
    return pose_b
