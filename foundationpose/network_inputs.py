"""xyz normalisation and assembly of the 6-channel network inputs (spec §1.4 steps 4-5, §1.5).

Both branches (A = rendered, B = real) go through the same two functions; the networks take
(N, S, S, 6) float32 NHWC tensors with channels R, G, B, X, Y, Z (spec §6.1; RGB in [0, 1], no
mean/std normalisation).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "REFINE_CROP_RATIO",
    "SCORE_CROP_RATIO",
    "REFINE_INVALID_Z",
    "SCORE_INVALID_Z",
    "XYZ_CLIP",
    "RGB_SCALE",
    "rgb_to_unit",
    "normalize_xyz",
    "make_network_input",
]

REFINE_CROP_RATIO = 1.2  # refiner crop window = 1.2 x diameter (spec §2.4)
SCORE_CROP_RATIO = 1.1  # scorer crop window = 1.1 x diameter (spec §2.4)
REFINE_INVALID_Z = 0.001  # metres: refiner xyz invalid where z < this, before shifting (spec §1.4.4)
SCORE_INVALID_Z = 0.1  # metres: scorer threshold (spec §1.5, §8.5)
XYZ_CLIP = 2.0  # a normalised component with |x'| >= 2 is set to 0 (spec §1.4.4)
# float32(1 / 255): the reference's ``x / 255.0`` runs on CUDA, where PyTorch divides by a CPU scalar
# as a multiplication by its float32 reciprocal (differs from true division by 1 ulp for some values).
RGB_SCALE = float(np.float32(np.float32(1.0) / np.float32(255.0)))


def _radius_reciprocal_f32(diameter: float) -> np.float32:
    """``r = float32(1 / rho32)``, ``rho32 = float32(d) / 2`` (the reference divides by a CUDA scalar,
    which PyTorch evaluates as a multiplication by the float32 reciprocal)."""
    rho32 = np.float32(diameter) / np.float32(2.0)
    return np.float32(np.float32(1.0) / rho32)


def rgb_to_unit(rgb_255: Tensor, out: Tensor | None = None) -> Tensor:
    """RGB as 0-255 floats -> [0, 1] exactly as the reference does: ``rgb_255 * float32(1/255)``.

    rgb_255: (..., 3) float32 (e.g. the bilinear real crop, or the rendered colour times 255).
    out: optional float32 buffer of the same shape (may be ``rgb_255`` itself); returned.
    """
    if out is None:
        return rgb_255 * RGB_SCALE
    return torch.mul(rgb_255, RGB_SCALE, out=out)


def normalize_xyz(
    xyz: Tensor,
    t: Tensor,
    diameter: float,
    invalid_z: float,
    out: Tensor | None = None,
) -> Tensor:
    """Centre xyz maps on each hypothesis' translation and scale them by ``1 / (d / 2)`` (spec §1.4.4).

    xyz: (N, S, S, 3) float32 camera-frame metres (rendered or real; background / no depth = 0).
    t: (N, 3) float32 hypothesis translations (``cam_from_centred[:, :3, 3]``), metres.
    diameter: mesh diameter, metres. invalid_z: ``REFINE_INVALID_Z`` (0.001) or ``SCORE_INVALID_Z`` (0.1).
    out: optional (N, S, S, 3) float32 buffer (may be ``xyz`` itself or a channel slice of a network-input
        buffer); fully overwritten and returned.
    Returns (N, S, S, 3) float32: ``x' = (xyz - t) * float32(1 / rho32)``; all three components 0 where the
    *input* ``z < invalid_z``; a single component 0 where ``|x'| >= 2``.
    """
    assert xyz.ndim == 4 and xyz.shape[-1] == 3, xyz.shape
    assert t.shape == (xyz.shape[0], 3), (t.shape, xyz.shape)
    invalid = xyz[..., 2:3] < invalid_z  # (N, S, S, 1), evaluated before shifting
    r = float(_radius_reciprocal_f32(diameter))  # exactly representable in float32
    shifted = xyz - t.to(xyz.dtype)[:, None, None, :]  # (N, S, S, 3)
    if out is None:
        out = torch.empty_like(xyz)
    torch.mul(shifted, r, out=out)
    out.masked_fill_(invalid | (torch.abs(out) >= XYZ_CLIP), 0.0)
    return out


def make_network_input(rgb: Tensor, xyz_normalised: Tensor, out: Tensor | None = None) -> Tensor:
    """Concatenate RGB and normalised xyz into the NHWC network input (channels R, G, B, X, Y, Z).

    rgb: (N, S, S, 3) float32 in [0, 1], RGB order. xyz_normalised: (N, S, S, 3) float32 from
    :func:`normalize_xyz`. out: optional (N, S, S, 6) float32 buffer (e.g. a pool view), fully overwritten.
    Returns (N, S, S, 6) float32 (``render_input`` for the rendered branch A, ``transf_input`` for B).
    """
    assert rgb.ndim == 4 and rgb.shape[-1] == 3, rgb.shape
    assert xyz_normalised.shape == rgb.shape, (xyz_normalised.shape, rgb.shape)
    if out is None:
        return torch.cat([rgb, xyz_normalised], dim=-1)
    assert out.shape == (*rgb.shape[:-1], 6), out.shape
    if out[..., :3].data_ptr() != rgb.data_ptr():
        out[..., :3].copy_(rgb)
    if out[..., 3:].data_ptr() != xyz_normalised.data_ptr():
        out[..., 3:].copy_(xyz_normalised)
    return out
