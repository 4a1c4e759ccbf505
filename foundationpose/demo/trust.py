"""The demo's judgement of each answer: its validity, the session state, and the pose to show for it.

Frames come in order (the demo's write stage): the first is the register on the client's mask, the others are
tracks from the previous answer's tracking state. Validity is measured with
:class:`foundationpose.validity.FrameJudge` on the frame's depth (the track step's filters) until the
estimator's results carry it. With declared symmetries the pose shown and written is the member of its symmetry
class nearest the previous one shown (:func:`foundationpose.symmetry.canonical_pose`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from foundationpose.mesh import ObjectModel
from foundationpose.session_state import SessionConfig, State, advance, start_session
from foundationpose.symmetry import ObjectSymmetry, canonical_pose
from foundationpose.validity import FrameJudge

__all__ = ["SessionTrust"]


class SessionTrust:
    """One object's session as the demo reports it. device: where the measurements run."""

    def __init__(self, obj: ObjectModel, symmetry: ObjectSymmetry | None, device: str | torch.device,
                 session: SessionConfig | None = None) -> None:
        self.obj, self.symmetry = obj, symmetry
        self.judge = FrameJudge(obj, device=device)
        self.session_config = session or SessionConfig()
        self.state = start_session()
        self.shown: np.ndarray | None = None  # the last cam_from_centred shown
        self._tfs = None if symmetry is None else torch.as_tensor(symmetry.tfs_centred, dtype=torch.float32)
        self.states: list[str] = []
        self.confidences: list[float] = []
        self.valid = 0

    def step(self, depth: np.ndarray, K: np.ndarray, start: np.ndarray | None, cam_from_centred: np.ndarray
             ) -> tuple[np.ndarray, dict[str, Any]]:
        """``(cam_from_mesh to show (4, 4) float64, status for the overlay)`` of one answer. start: the track's
        start pose (cam_from_centred), None for the register."""
        register = start is None
        judgement = self.judge.judge(depth, K, cam_from_centred if register else start, cam_from_centred)
        self.state, reported = advance(self.state, valid=judgement.valid, cam_from_centred=cam_from_centred,
                                       register=register, forced=register, config=self.session_config)
        shown = cam_from_centred
        if self._tfs is not None:
            ref = None if self.shown is None else torch.as_tensor(self.shown)[None]
            shown = canonical_pose(torch.as_tensor(cam_from_centred)[None], self._tfs, ref)[0].numpy()
        self.shown = shown
        self.states.append(self.state.state.value)
        self.confidences.append(judgement.confidence)
        self.valid += reported
        status = {"state": self.state.state.value, "confidence": judgement.confidence, "pose_valid": reported}
        return shown.astype(np.float64) @ self.obj.centred_from_mesh, status

    def summary(self) -> dict[str, Any]:
        """Frames per state, poses reported valid, the confidence's mean and minimum."""
        conf = np.asarray(self.confidences, dtype=np.float64)
        return {"states": {s.value: self.states.count(s.value) for s in State}, "pose_valid_frames": self.valid,
                "frames": len(self.states), "confidence_mean": float(conf.mean()) if len(conf) else None,
                "confidence_min": float(conf.min()) if len(conf) else None,
                "symmetry": None if self.symmetry is None else self.symmetry.describe()}
