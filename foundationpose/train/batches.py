"""Network inputs of one training step, built by the inference code itself.

The synthetic observations go through the track lane's frame preparation (depth erosion + bilateral filter
+ back-projection, :func:`foundationpose.observation.filter_and_backproject_stacked`), the refiner pairs through
:func:`foundationpose.refine.build_refiner_inputs_per_frame` and the scorer sets through
:func:`foundationpose.score.build_scorer_inputs` (crop windows, crop renders, warps, the scorer's double
warp, xyz normalisation): the networks are trained on exactly the tensors they are given at inference.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from foundationpose.mesh import ObjectModel
from foundationpose.observation import FrameBatch, filter_and_backproject_stacked
from foundationpose.refine import build_refiner_inputs_per_frame
from foundationpose.render import Renderer
from foundationpose.score import build_scorer_inputs
from foundationpose.train.refiner_targets import PerturbConfig, perturb_poses
from foundationpose.train.scenes import SceneBatch, SceneConfig, sample_scenes
from foundationpose.train.scorer_ranking import RankingConfig, hypothesis_set

__all__ = ["PairBatch", "SampleSource", "nchw"]


def nchw(nhwc: Tensor) -> Tensor:
    """(N, S, S, C) NHWC -> (N, C, S, S) view (channels-last strides, what the convolutions like)."""
    return nhwc.permute(0, 3, 1, 2)


@dataclass(slots=True)
class PairBatch:
    """render_input / transf_input: (N, S, S, 6) float32 NHWC; hypotheses and truth (N, 4, 4) float32."""

    render_input: Tensor
    transf_input: Tensor
    hypotheses: Tensor
    cam_from_centred_gt: Tensor


class SampleSource:
    """Draws synthetic observations of one object and turns them into refiner or scorer batches.

    gen: CPU generator (poses, perturbations); device_gen: generator on the renderer's device (pixels).
    """

    def __init__(self, obj: ObjectModel, renderer: Renderer, *, frame_hw: tuple[int, int], crop_size: int,
                 gen: torch.Generator, device_gen: torch.Generator, scene: SceneConfig | None = None,
                 perturb: PerturbConfig | None = None, ranking: RankingConfig | None = None) -> None:
        self.obj, self.renderer = obj, renderer
        self.frame_hw, self.crop_size = frame_hw, crop_size
        self.gen, self.device_gen = gen, device_gen
        self.scene = scene or SceneConfig()
        self.perturb = perturb or PerturbConfig()
        self.ranking = ranking or RankingConfig()

    def observations(self, n: int) -> tuple[SceneBatch, FrameBatch]:
        scenes = sample_scenes(self.obj, self.renderer, n, self.frame_hw, self.gen, self.device_gen, self.scene)
        frames = filter_and_backproject_stacked(scenes.rgb, scenes.depth, list(scenes.Ks))
        return scenes, frames

    @torch.no_grad()
    def refiner_batch(self, batch: int, hypotheses_per_scene: int) -> PairBatch:
        """``batch`` perturbed hypotheses, ``hypotheses_per_scene`` around each of ``batch / that`` observations."""
        scenes, frames = self.observations(batch // hypotheses_per_scene)
        reps = hypotheses_per_scene
        gt = scenes.cam_from_centred.repeat_interleave(reps, dim=0)
        hypotheses = perturb_poses(gt, self.obj.diameter, self.gen, self.perturb)
        inputs = build_refiner_inputs_per_frame(
            hypotheses, frames.rgb.repeat_interleave(reps, dim=0), frames.xyz_cam.repeat_interleave(reps, dim=0),
            np.repeat(frames.Ks, reps, axis=0), self.obj, self.renderer, crop_size=self.crop_size,
        )
        return PairBatch(inputs.render_input, inputs.transf_input, hypotheses, gt)

    @torch.no_grad()
    def scorer_batch(self, sets: int) -> PairBatch:
        """``sets`` observations x ``ranking.set_size`` hypotheses; rows grouped by set (set-major)."""
        scenes, frames = self.observations(sets)
        hyps, renders, reals = [], [], []
        for i in range(sets):
            h = hypothesis_set(scenes.cam_from_centred[i], self.obj.diameter, self.gen, self.ranking)
            inputs = build_scorer_inputs(h, frames.frames[i], self.obj, self.renderer, crop_size=self.crop_size)
            hyps.append(h)
            renders.append(inputs.render_input)
            reals.append(inputs.transf_input)
        gt = scenes.cam_from_centred.repeat_interleave(self.ranking.set_size, dim=0)
        return PairBatch(torch.cat(renders), torch.cat(reals), torch.cat(hyps), gt)
