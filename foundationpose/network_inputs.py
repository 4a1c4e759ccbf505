"""xyz normalisation and assembly of the 6-channel network inputs (spec §1.4 steps 4-5, §1.5).

Both branches (A = rendered, B = real) go through the same two functions; the networks take
(N, S, S, 6) float32 NHWC tensors with channels R, G, B, X, Y, Z (spec §6.1; RGB in [0, 1], no
mean/std normalisation).

:func:`write_network_input` fills one such tensor from one branch: on CUDA with one Triton launch
(:mod:`foundationpose._network_inputs_triton`, the same float32 operations in the same order: bit-identical),
elsewhere with :func:`write_network_input_reference`, the readable eager twin (``rgb_to_unit`` and
``normalize_xyz`` into the two channel slices, ~7 elementwise ops per branch). ``impl`` picks as the depth
filters do: "auto" = Triton for CUDA tensors when triton imports, "torch" = the twin, "triton" = the kernel
(on CPU tensors under the Triton interpreter: slow, for tests).
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import numpy as np
import torch
from torch import Tensor

from foundationpose.diameters import RowDiameters
from foundationpose.sampling.depth_filters import FilterImpl, import_triton_module, pick_triton_module

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_NETWORK_INPUT_IMPL",
    "REFINE_CROP_RATIO",
    "SCORE_CROP_RATIO",
    "REFINE_INVALID_Z",
    "SCORE_INVALID_Z",
    "XYZ_CLIP",
    "RGB_SCALE",
    "rgb_to_unit",
    "normalize_xyz",
    "make_network_input",
    "write_network_input",
    "write_network_input_reference",
]

REFINE_CROP_RATIO = 1.2  # refiner crop window = 1.2 x diameter (spec §2.4)
SCORE_CROP_RATIO = 1.1  # scorer crop window = 1.1 x diameter (spec §2.4)
REFINE_INVALID_Z = 0.001  # metres: refiner xyz invalid where z < this, before shifting (spec §1.4.4)
SCORE_INVALID_Z = 0.1  # metres: scorer threshold (spec §1.5, §8.5)
XYZ_CLIP = 2.0  # a normalised component with |x'| >= 2 is set to 0 (spec §1.4.4)
# float32(1 / 255): the reference's ``x / 255.0`` runs on CUDA, where PyTorch divides by a CPU scalar
# as a multiplication by its float32 reciprocal (differs from true division by 1 ulp for some values).
RGB_SCALE = float(np.float32(np.float32(1.0) / np.float32(255.0)))
# The default ``impl`` of every network-input writer: the fused Triton kernel on CUDA (bit-identical to the eager
# twin; docs/benchmarks.md has the timings), the eager twin elsewhere; "torch" forces the twin.
DEFAULT_NETWORK_INPUT_IMPL: FilterImpl = "auto"


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
    diameter: float | RowDiameters,
    invalid_z: float,
    out: Tensor | None = None,
) -> Tensor:
    """Centre xyz maps on each hypothesis' translation and scale them by ``1 / (d / 2)`` (spec §1.4.4).

    xyz: (N, S, S, 3) float32 camera-frame metres (rendered or real; background / no depth = 0).
    t: (N, 3) float32 hypothesis translations (``cam_from_centred[:, :3, 3]``), metres.
    diameter: mesh diameter, metres, or one per row (:class:`~foundationpose.diameters.RowDiameters`: row i is
    scaled by its ``inv_rho32``, the scalar's float32 factor). invalid_z: ``REFINE_INVALID_Z`` (0.001) or
    ``SCORE_INVALID_Z`` (0.1).
    out: optional (N, S, S, 3) float32 buffer (may be ``xyz`` itself or a channel slice of a network-input
        buffer); fully overwritten and returned.
    Returns (N, S, S, 3) float32: ``x' = (xyz - t) * float32(1 / rho32)``; all three components 0 where the
    *input* ``z < invalid_z``; a single component 0 where ``|x'| >= 2``.
    """
    assert xyz.ndim == 4 and xyz.shape[-1] == 3, xyz.shape
    assert t.shape == (xyz.shape[0], 3), (t.shape, xyz.shape)
    invalid = xyz[..., 2:3] < invalid_z  # (N, S, S, 1), evaluated before shifting
    shifted = xyz - t.to(xyz.dtype)[:, None, None, :]  # (N, S, S, 3)
    if out is None:
        out = torch.empty_like(xyz)
    if isinstance(diameter, RowDiameters):
        torch.mul(shifted, diameter.inv_rho32[:, None, None, None], out=out)  # row i: its float32 factor
    else:
        torch.mul(shifted, float(_radius_reciprocal_f32(diameter)), out=out)  # exactly representable in float32
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


def write_network_input_reference(
    rgb: Tensor,
    xyz: Tensor,
    t: Tensor,
    out: Tensor,
    *,
    diameter: float | RowDiameters,
    invalid_z: float,
    rendered: bool,
) -> Tensor:
    """The eager twin of the Triton kernel: ``out[..., :3]`` = RGB in [0, 1], ``out[..., 3:]`` = normalised xyz.

    rendered: branch A, ``rgb`` in [0, 1] goes through x255 first (``rgb_to_unit(rgb * 255)``, as the reference
    rescales its render; spec §1.4 step 2); else branch B, ``rgb`` is 0..255. Other arguments as
    :func:`write_network_input`. Returns ``out``.
    """
    rgb_to_unit(rgb * 255.0 if rendered else rgb, out=out[..., :3])
    normalize_xyz(xyz, t, diameter, invalid_z, out=out[..., 3:])
    return out


def write_network_input(
    rgb: Tensor,
    xyz: Tensor,
    t: Tensor,
    out: Tensor,
    *,
    diameter: float | RowDiameters,
    invalid_z: float,
    rendered: bool,
    impl: FilterImpl = DEFAULT_NETWORK_INPUT_IMPL,
) -> Tensor:
    """Fill one NHWC network input from one branch (spec §1.4 steps 2-5); returns ``out``.

    rgb: (N, S, S, 3) float32, in [0, 1] when ``rendered`` (A, the crop renders), else 0..255 (B, the real crops).
    xyz: (N, S, S, 3) float32 camera-frame metres. t: (N, 3) the hypotheses' translations
    (``cam_from_centred[:, :3, 3]``; rounded to float32 first if it is not). out: (N, S, S, 6) float32 buffer
    (e.g. a pool view; any strides), fully overwritten. diameter: mesh diameter, metres, or one per row
    (:class:`~foundationpose.diameters.RowDiameters`; the kernel then reads each row's factor). invalid_z:
    ``REFINE_INVALID_Z`` or ``SCORE_INVALID_Z``. impl: "auto" | "torch" | "triton" (module docstring); both give
    the same bits. The Triton path allocates nothing for a float32 ``t`` and never synchronises (capturable).
    """
    kernels = _triton_for(out.device, impl)
    if kernels is None:
        return write_network_input_reference(
            rgb, xyz, t, out, diameter=diameter, invalid_z=invalid_z, rendered=rendered
        )
    if t.dtype != torch.float32:
        t = t.to(torch.float32)  # as normalize_xyz's t.to(xyz.dtype)
    per_row = isinstance(diameter, RowDiameters)
    kernels.write_network_input_triton(
        rgb, xyz, t, out, rendered=rendered,
        xyz_scale=1.0 if per_row else float(_radius_reciprocal_f32(diameter)),
        xyz_scale_rows=diameter.inv_rho32 if per_row else None,
        invalid_z=invalid_z, rgb_unit_scale=RGB_SCALE, xyz_clip=XYZ_CLIP,
    )
    return out


@functools.cache
def _triton_kernels() -> ModuleType | None:
    """The Triton kernel module, or None where triton does not import (probed once per process)."""
    return import_triton_module("foundationpose._network_inputs_triton", "network-input kernel")


def _triton_for(device: torch.device, impl: FilterImpl) -> ModuleType | None:
    return pick_triton_module(_triton_kernels, device.type == "cuda", impl, "network input")
