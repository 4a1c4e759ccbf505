"""Track and register calls with their validity, as evaluation needs them.

Until the track step computes validity itself (the estimator's ``TrackResult`` carrying it), :func:`track_judged`
measures it right after each track call with the same functions on the same inputs: the frame's depth through the
track step's filters (erosion, bilateral), the request's K, its start pose and the refined pose, so the numbers
are those the step will produce. It is the one place that changes when the step reports validity.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from foundationpose.estimator import PoseEstimator, RegisterResult, TrackResult
from foundationpose.mesh import ObjectModel
from foundationpose.sampling import bilateral_filter_depth, erode_depth
from foundationpose.validity import ValidityConfig, ValidityModel, judge_validity, measure_validity

__all__ = ["FrameJudge", "Judgement", "register_judged", "track_judged"]


@dataclass(frozen=True, slots=True, eq=False)
class Judgement:
    """measurements: (M,) float32 in :data:`foundationpose.validity.MEASUREMENTS` order; confidence in [0, 1]."""

    measurements: np.ndarray
    confidence: float
    valid: bool


class FrameJudge:
    """Validity of one object's poses on the compute device. config: the object's thresholds."""

    def __init__(self, obj: ObjectModel, config: ValidityConfig | None = None,
                 device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.model = ValidityModel.from_object(obj, self.device)
        self.config = config or ValidityConfig()

    def filtered_depth(self, depth: np.ndarray) -> torch.Tensor:
        """(1, H, W) float32: the track step's filters applied to a raw (H, W) depth map (metres)."""
        raw = torch.as_tensor(np.ascontiguousarray(depth, dtype=np.float32), device=self.device)[None]
        return bilateral_filter_depth(erode_depth(raw))

    def judge(self, depth: np.ndarray, K: np.ndarray, start_cam_from_centred: np.ndarray,
              cam_from_centred: np.ndarray) -> Judgement:
        """Validity of ``cam_from_centred`` (4, 4) refined from ``start_cam_from_centred`` on a raw depth map."""
        return self.judge_filtered(self.filtered_depth(depth), K, start_cam_from_centred, cam_from_centred)

    def judge_filtered(self, depth_f: torch.Tensor, K: np.ndarray, start_cam_from_centred: np.ndarray,
                       cam_from_centred: np.ndarray) -> Judgement:
        """As :meth:`judge` on an already filtered (1, H, W) depth (several poses on one frame)."""
        dev = self.device
        k = torch.as_tensor(np.asarray(K, dtype=np.float64), device=dev)[None]
        start = torch.as_tensor(np.asarray(start_cam_from_centred, dtype=np.float32), device=dev)[None]
        final = torch.as_tensor(np.asarray(cam_from_centred, dtype=np.float32), device=dev)[None]
        m = measure_validity(depth_f, k, start, final, self.model, self.config)
        confidence, valid = judge_validity(m, self.config)
        return Judgement(m[0].cpu().numpy(), float(confidence[0]), bool(valid[0]))


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
