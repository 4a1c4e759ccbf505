"""The demo's record of each answer's trust: the session state, the confidence and the pose to show.

Frames come in order (the demo's write stage): the first is the register on the client's mask, the others are
tracks from the previous answer's tracking state. Each result carries its validity (measured in the register or
track step); a :class:`~foundationpose.session_trust.SessionTrust` turns it into the session's state and, for a
symmetric object, the member of the pose's symmetry class nearest the previous one shown.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from foundationpose.mesh import ObjectModel
from foundationpose.session_state import State
from foundationpose.session_step import answer
from foundationpose.session_trust import CLIENT_REGISTER, TRACK, SessionTrust

__all__ = ["TrustLog"]


class TrustLog:
    """One object's session as the demo reports it (no automatic recovery: the demo tracks every frame)."""

    def __init__(self, obj: ObjectModel) -> None:
        self.obj = obj
        self.trust = SessionTrust(obj, recovery=None)
        self.states: list[str] = []
        self.confidences: list[float] = []
        self.valid = 0

    def step(self, result: Any, *, register: bool) -> tuple[np.ndarray, dict[str, Any]]:
        """``(cam_from_mesh to show (4, 4) float64, status for the overlay)`` of one answer (a RegisterResult or
        TrackResult: its pose and validity)."""
        answered = answer(self.trust, result, CLIENT_REGISTER if register else TRACK)
        report = answered.report
        self.states.append(report.state.value)
        self.confidences.append(report.confidence)
        self.valid += report.pose_valid
        status = {"state": report.state.value, "confidence": report.confidence, "pose_valid": report.pose_valid}
        return answered.cam_from_mesh, status

    def summary(self) -> dict[str, Any]:
        """Frames per state, poses reported valid, the confidence's mean and minimum."""
        conf = np.asarray(self.confidences, dtype=np.float64)
        symmetry = self.obj.symmetry
        return {"states": {s.value: self.states.count(s.value) for s in State}, "pose_valid_frames": self.valid,
                "frames": len(self.states), "confidence_mean": float(conf.mean()) if len(conf) else None,
                "confidence_min": float(conf.min()) if len(conf) else None,
                "symmetry": None if symmetry is None else symmetry.describe()}
