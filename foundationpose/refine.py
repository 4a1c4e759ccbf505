"""One refine iteration (spec §1.4): crops, render, real warps, network, pose update."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from deploy_core.infer import BaseInferCore
from foundationpose.crop import crop_sampling_grid, crop_windows, warp_to_crops
from foundationpose.diameters import RowDiameters
from foundationpose.mesh import ObjectModel
from foundationpose.models.blocks import CROP_SIZE
from foundationpose.network_inputs import (
    DEFAULT_NETWORK_INPUT_IMPL,
    REFINE_CROP_RATIO,
    REFINE_INVALID_Z,
    write_network_input,
)
from foundationpose.observation import PreparedFrame
from foundationpose.pose_update import apply_refiner_output
from foundationpose.render import Renderer, RenderOutput
from foundationpose.render._cache import GeometryConstants
from foundationpose.sampling import FilterImpl

if TYPE_CHECKING:
    from foundationpose.object_group import GroupRows

__all__ = [
    "PairInputs",
    "assemble_pair_inputs",
    "build_refiner_inputs",
    "build_refiner_inputs_per_frame",
    "crop_geometry",
    "refine_iteration",
    "run_refiner",
]


@dataclass(slots=True)
class PairInputs:
    """Network inputs of one step.

    render_input: (N, S, S, 6) float32 NHWC, A = rendered crop (R,G,B in [0,1], normalised X,Y,Z).
    transf_input: (N, S, S, 6) float32 NHWC, B = real crop, same layout.
    crop_from_img: (N, 3, 3) float32 crop windows used for both.
    """

    render_input: Tensor
    transf_input: Tensor
    crop_from_img: Tensor


def build_refiner_inputs(
    cam_from_centred: Tensor,
    frame: PreparedFrame,
    obj: ObjectModel,
    renderer: Renderer,
    *,
    crop_size: int = CROP_SIZE,
    out_render: Tensor | None = None,
    out_transf: Tensor | None = None,
    constants: GeometryConstants | None = None,
    impl: FilterImpl = DEFAULT_NETWORK_INPUT_IMPL,
    hypothesis_K: Tensor | None = None,
    affine_inverse: bool = False,
) -> PairInputs:
    """Steps 1-5 of spec §1.4 for hypotheses ``cam_from_centred`` (N, 4, 4) float32.

    out_render / out_transf: optional (N, S, S, 6) float32 buffers (pool views), fully overwritten.
    constants: the estimator's memo of the crop constants (``PoseEstimator.constants``; None: built per call).
    impl: how the two network inputs are written (:func:`assemble_pair_inputs`).
    hypothesis_K / affine_inverse: for steps captured in a CUDA graph (:mod:`foundationpose.register_graph`):
    ``frame.K`` as (N, 3, 3) device rows (a device K is data, never read back), and the sampling grid's
    closed-form window inverse (:func:`foundationpose.crop.crop_sampling_grid`).
    """
    return _build(
        cam_from_centred, frame.rgb, frame.xyz_cam, frame.K if hypothesis_K is None else hypothesis_K, frame.hw, obj,
        renderer, crop_size, out_render, out_transf, constants, affine_inverse, impl=impl,
    )


def build_refiner_inputs_per_frame(
    cam_from_centred: Tensor,
    rgb: Tensor,
    xyz: Tensor,
    Ks: np.ndarray | Tensor,
    obj: ObjectModel | GroupRows,
    renderer: Renderer,
    *,
    crop_size: int = CROP_SIZE,
    out_render: Tensor | None = None,
    out_transf: Tensor | None = None,
    constants: GeometryConstants | None = None,
    affine_inverse: bool = False,
    impl: FilterImpl = DEFAULT_NETWORK_INPUT_IMPL,
) -> PairInputs:
    """:func:`build_refiner_inputs` for N hypotheses that each come with their own frame (e.g. N track sessions).

    cam_from_centred: (N, 4, 4) float32.  rgb: (N, H, W, 3) float32 0..255 and xyz: (N, H, W, 3) float32 metres,
    row i = frame of hypothesis i (:class:`foundationpose.observation.FrameBatch`).  Ks: (N, 3, 3) float64 (or (3, 3)).
    obj: the object of every row, or the rows of an object group (:class:`foundationpose.object_group.GroupRows`:
    per-row diameters and meshes; row i then uses its own object's).
    One call each of crop windows, render, sampling grid, two warps and normalisation for all N; row i is
    bit-identical to ``build_refiner_inputs(cam_from_centred[i:i+1], frame_i, obj_i, ...)`` on the CPU.
    affine_inverse: the sampling grid's closed-form window inverse (:func:`foundationpose.crop.crop_sampling_grid`),
    for steps captured in a CUDA graph. impl: how the two network inputs are written (:func:`assemble_pair_inputs`).
    """
    assert rgb.ndim == 4 and xyz.shape == rgb.shape and rgb.shape[0] == cam_from_centred.shape[0], (
        rgb.shape, xyz.shape, cam_from_centred.shape
    )
    hw = (int(rgb.shape[1]), int(rgb.shape[2]))
    return _build(
        cam_from_centred, rgb, xyz, Ks, hw, obj, renderer, crop_size, out_render, out_transf, constants, affine_inverse,
        impl=impl,
    )


def crop_geometry(
    cam_from_centred: Tensor,
    K: np.ndarray | Tensor,
    diameter: float | RowDiameters,
    hw: tuple[int, int],
    crop_size: int,
    constants: GeometryConstants | None,
    affine_inverse: bool = False,
) -> tuple[Tensor, Tensor]:
    """The refiner crops' windows ``crop_from_img`` (N, 3, 3) and the sampling grid (N, S, S, 2) both warps share."""
    crop_from_img = crop_windows(cam_from_centred, K, diameter, REFINE_CROP_RATIO, S=crop_size, constants=constants)
    grid = crop_sampling_grid(crop_from_img, hw, S=crop_size, constants=constants, affine_inverse=affine_inverse)
    return crop_from_img, grid


def _build(
    cam_from_centred: Tensor,
    rgb: Tensor,
    xyz: Tensor,
    K: np.ndarray | Tensor,
    hw: tuple[int, int],
    obj: ObjectModel | GroupRows,
    renderer: Renderer,
    crop_size: int,
    out_render: Tensor | None,
    out_transf: Tensor | None,
    constants: GeometryConstants | None,
    affine_inverse: bool = False,
    *,
    impl: FilterImpl = DEFAULT_NETWORK_INPUT_IMPL,
) -> PairInputs:
    crop_from_img, grid = crop_geometry(cam_from_centred, K, obj.diameter, hw, crop_size, constants, affine_inverse)
    rendered = renderer.render(obj.tensors, cam_from_centred, K, hw, crop_from_img)
    # channels-first views (no copy): assemble_pair_inputs reads any strides
    rgb_b = warp_to_crops(rgb, crop_from_img, S=crop_size, mode="bilinear", grid=grid, contiguous=False)
    xyz_b = warp_to_crops(xyz, crop_from_img, S=crop_size, mode="nearest", grid=grid, contiguous=False)
    return assemble_pair_inputs(
        rendered, rgb_b, xyz_b, cam_from_centred, obj.diameter, REFINE_INVALID_Z, crop_from_img, out_render, out_transf,
        impl=impl,
    )


def assemble_pair_inputs(
    rendered: RenderOutput,
    rgb_b_255: Tensor,
    xyz_b: Tensor,
    cam_from_centred: Tensor,
    diameter: float | RowDiameters,
    invalid_z: float,
    crop_from_img: Tensor,
    out_render: Tensor | None = None,
    out_transf: Tensor | None = None,
    *,
    impl: FilterImpl = DEFAULT_NETWORK_INPUT_IMPL,
) -> PairInputs:
    """Write the two NHWC network inputs (R,G,B in [0,1], normalised X,Y,Z) straight into their buffers.

    rendered: the hypotheses' renders (rgb in [0,1], xyz metres).  rgb_b_255: (N, S, S, 3) real crops, 0..255.
    xyz_b: (N, S, S, 3) real camera-frame points.  The rendered colour goes through x255 / 255 as in the
    reference (spec §1.4 step 2); /255 is a multiplication by float32(1/255) as PyTorch does on CUDA.
    impl: "auto" (one Triton launch per branch on CUDA when triton imports, else the eager twin), "torch" or
    "triton"; the same bits either way (:func:`foundationpose.network_inputs.write_network_input`).
    """
    n, s = rendered.rgb.shape[0], rendered.rgb.shape[1]
    for real in (rgb_b_255, xyz_b):
        if real.shape[1:3] != (s, s):
            raise ValueError(f"the renders are {s}x{s} crops but the real crops are {real.shape[1]}x{real.shape[2]}: "
                             "the renderer's crop_size_px must equal the crop size")
    device = rendered.rgb.device
    render_input = out_render if out_render is not None else torch.empty((n, s, s, 6), device=device)
    transf_input = out_transf if out_transf is not None else torch.empty((n, s, s, 6), device=device)
    t = cam_from_centred[:, :3, 3]
    common = {"diameter": diameter, "invalid_z": invalid_z, "impl": impl}
    write_network_input(rendered.rgb, rendered.xyz_cam, t, render_input, rendered=True, **common)
    write_network_input(rgb_b_255, xyz_b, t, transf_input, rendered=False, **common)
    return PairInputs(render_input=render_input, transf_input=transf_input, crop_from_img=crop_from_img)


def run_refiner(refiner: BaseInferCore, inputs: PairInputs, stream=None) -> tuple[Tensor, Tensor]:
    """Forward the refiner in chunks of at most ``refiner.max_batch``; returns trans, rot (N, 3) float32."""
    n = inputs.render_input.shape[0]
    step = max(1, min(n, refiner.max_batch))
    trans_parts, rot_parts = [], []
    for start in range(0, n, step):
        out = refiner.infer(
            {
                "render_input": inputs.render_input[start : start + step],
                "transf_input": inputs.transf_input[start : start + step],
            },
            stream=stream,
        )
        trans_parts.append(out["trans"].float())
        rot_parts.append(out["rot"].float())
    return torch.cat(trans_parts), torch.cat(rot_parts)


def refine_iteration(
    cam_from_centred: Tensor,
    frame: PreparedFrame,
    obj: ObjectModel,
    renderer: Renderer,
    refiner: BaseInferCore,
    *,
    crop_size: int = CROP_SIZE,
    constants: GeometryConstants | None = None,
    impl: FilterImpl = DEFAULT_NETWORK_INPUT_IMPL,
) -> Tensor:
    """One full iteration: returns the updated (N, 4, 4) float32 poses (centred frame). impl: how the network
    inputs are written (:func:`assemble_pair_inputs`)."""
    inputs = build_refiner_inputs(
        cam_from_centred, frame, obj, renderer, crop_size=crop_size, constants=constants, impl=impl
    )
    trans, rot = run_refiner(refiner, inputs)
    return apply_refiner_output(cam_from_centred, trans, rot, obj.diameter)
