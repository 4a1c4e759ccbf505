"""Scoring the refined hypotheses (spec §1.5, §5) and picking the best."""

from __future__ import annotations

import torch
from torch import Tensor

from deploy_core.errors import CapacityError
from deploy_core.infer import BaseInferCore
from foundationpose.crop import crop_sampling_grid, crop_windows, scorer_real_xyz, warp_to_crops
from foundationpose.mesh import ObjectModel
from foundationpose.models.blocks import CROP_SIZE
from foundationpose.network_inputs import DEFAULT_NETWORK_INPUT_IMPL, SCORE_CROP_RATIO, SCORE_INVALID_Z
from foundationpose.observation import PreparedFrame
from foundationpose.refine import PairInputs, assemble_pair_inputs
from foundationpose.render import Renderer
from foundationpose.render._cache import GeometryConstants
from foundationpose.sampling import FilterImpl

__all__ = ["build_scorer_inputs", "run_scorer", "select_best"]


def build_scorer_inputs(
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
    """Scorer pairs: crop ratio 1.1, invalid z < 0.1 m, real xyz by the double warp (spec §2.6.3).

    constants: the estimator's memo of the crop constants (``PoseEstimator.constants``; None: built per call).
    impl: how the two network inputs are written (:func:`foundationpose.refine.assemble_pair_inputs`).
    hypothesis_K / affine_inverse: for steps captured in a CUDA graph (:mod:`foundationpose.register_graph`):
    ``frame.K`` as (N, 3, 3) device rows for the windows and the render (a device K is data, never read back), and
    the windows inverted in closed form (:func:`foundationpose.crop.crop_sampling_grid`).
    """
    k_rows = frame.K if hypothesis_K is None else hypothesis_K
    crop_from_img = crop_windows(
        cam_from_centred, k_rows, obj.diameter, SCORE_CROP_RATIO, S=crop_size, constants=constants
    )
    rendered = renderer.render(obj.tensors, cam_from_centred, k_rows, frame.hw, crop_from_img)
    grid = crop_sampling_grid(  # shared by both warps
        crop_from_img, frame.hw, S=crop_size, constants=constants, affine_inverse=affine_inverse
    )
    rgb_b = warp_to_crops(  # a channels-first view (no copy): assemble_pair_inputs reads any strides
        frame.rgb, crop_from_img, S=crop_size, mode="bilinear", grid=grid, contiguous=False
    )
    xyz_b = scorer_real_xyz(frame.depth, crop_from_img, frame.K, S=crop_size, constants=constants, grid=grid,
                            affine_inverse=affine_inverse)
    return assemble_pair_inputs(
        rendered, rgb_b, xyz_b, cam_from_centred, obj.diameter, SCORE_INVALID_Z, crop_from_img, out_render, out_transf,
        impl=impl,
    )


def run_scorer(scorer: BaseInferCore, inputs: PairInputs, stream=None) -> Tensor:
    """One forward over all N hypotheses as one cross-attention set; returns logits (N,) float32.

    The set cannot be split (spec §4.4), so N above the engine's capacity is an error.
    """
    n = inputs.render_input.shape[0]
    if n > scorer.max_batch:
        raise CapacityError(f"scorer: {n} hypotheses exceed the engine's max batch {scorer.max_batch}; "
                            "the set must be scored in one call")
    out = scorer.infer({"render_input": inputs.render_input, "transf_input": inputs.transf_input}, stream=stream)
    return out["scores"].float().reshape(n)


def select_best(scores: Tensor) -> int:
    """Index of the highest score; ties go to the lowest index (spec §5)."""
    return int(torch.argmax(scores).item())
