"""Readable reference twins of the register and track steps: the per-iteration algorithm of spec §1.2 and §1.3.

:func:`register_reference` and :func:`track_reference` run the algorithm one iteration at a time with the plain
functions (:func:`foundationpose.refine.refine_iteration`, the scorer's inputs and forward, the pick), on fresh
tensors and with the networks' own ``infer``; the step definitions (:func:`foundationpose.register_graph.register_step`,
:func:`foundationpose.track_graph.track_step`) run the same operations on static buffers so that they can be
captured. On the CPU the two agree bit for bit (tested); on CUDA within the fp16 tolerance (the captured steps use
the closed-form window inverse). Not used by the register/track paths.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from foundationpose import validate
from foundationpose.mesh import ObjectModel
from foundationpose.observation import prepare_frame
from foundationpose.refine import refine_iteration
from foundationpose.score import build_scorer_inputs, run_scorer, select_best

if TYPE_CHECKING:
    from foundationpose.estimator import PoseEstimator

__all__ = ["register_reference", "track_reference"]


def register_reference(estimator: PoseEstimator, obj: ObjectModel,
                       request: validate.RegisterRequest) -> tuple[Tensor, Tensor, int]:
    """Mirrors :meth:`PoseEstimator.register_candidates`: ``(poses (N, 4, 4) float32 cam_from_centred, scores (N,)
    float32, index of the best)`` after every refine iteration and the scorer."""
    est = estimator
    iterations = request.iterations or est.config.register_iterations
    frame = prepare_frame(request.rgb, request.depth, request.K, est.device, xyz_float64=True, constants=est.constants)
    mask = torch.as_tensor(request.mask, device=est.device)
    validate.require_masked_depth_count(int(validate.masked_depth_count(frame.depth, mask)))
    poses = est.hypotheses(frame, mask, obj.symmetry_tfs)
    for _ in range(iterations):
        poses = refine_iteration(poses, frame, obj, est.renderer, est.networks.refiner, crop_size=est.config.crop_size,
                                 constants=est.constants)
    inputs = build_scorer_inputs(poses, frame, obj, est.renderer, crop_size=est.config.crop_size,
                                 constants=est.constants)
    scores = run_scorer(est.networks.scorer, inputs)
    return poses, scores, select_best(scores)


def track_reference(estimator: PoseEstimator, obj: ObjectModel, request: validate.TrackRequest) -> np.ndarray:
    """Mirrors :meth:`PoseEstimator.run_track`: the (4, 4) float32 cam_from_centred after the track iterations."""
    from foundationpose.estimator import start_cam_from_centred

    est = estimator
    iterations = request.iterations or est.config.track_iterations
    frame = prepare_frame(request.rgb, request.depth, request.K, est.device, xyz_float64=False,
                          constants=est.constants)
    pose = torch.as_tensor(start_cam_from_centred(request, obj), device=est.device)[None]
    for _ in range(iterations):
        pose = refine_iteration(pose, frame, obj, est.renderer, est.networks.track_refiner,
                                crop_size=est.config.crop_size, constants=est.constants)
    return pose[0].detach().cpu().numpy().astype(np.float32)
