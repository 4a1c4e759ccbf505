"""Track and register calls with their validity, as evaluation needs them.

Until the track step computes validity itself (the estimator's ``TrackResult`` carrying it), :func:`track_judged`
measures it right after each track call with the same functions on the same inputs: the frame's depth through the
track step's filters (erosion, bilateral), the request's K, its start pose and the refined pose, so the numbers
are those the step will produce. It is the one place that changes when the step reports validity.
"""

from __future__ import annotations

import numpy as np

from foundationpose.estimator import PoseEstimator, RegisterResult, TrackResult
from foundationpose.mesh import ObjectModel
from foundationpose.validity import FrameJudge, Judgement

__all__ = ["FrameJudge", "Judgement", "register_judged", "track_judged"]


def track_judged(estimator: PoseEstimator, obj: ObjectModel, judge: FrameJudge, rgb: np.ndarray, depth: np.ndarray,
                 K: np.ndarray, start_cam_from_centred: np.ndarray) -> tuple[TrackResult, Judgement]:
    """One track call from ``start_cam_from_centred`` (4, 4) float32 and the validity of its pose."""
    result = estimator.track(obj, rgb, depth, K, start_cam_from_centred, prev_frame="centred")
    return result, judge.judge(depth, K, start_cam_from_centred, result.cam_from_centred)


def register_judged(estimator: PoseEstimator, obj: ObjectModel, judge: FrameJudge, rgb: np.ndarray,
                    depth: np.ndarray, mask: np.ndarray, K: np.ndarray, symmetry_tfs: np.ndarray | None = None
                    ) -> tuple[RegisterResult, Judgement]:
    """One register call and the validity of its pose (no motion: the pose is measured against itself)."""
    result = estimator.register(obj, rgb, depth, mask, K, symmetry_tfs=symmetry_tfs)
    return result, judge.judge(depth, K, result.cam_from_centred, result.cam_from_centred)
