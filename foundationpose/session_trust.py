"""One object's session as its answers report it: the state after each result, when and where to recover, and the
pose to show.

Every way in keeps one :class:`SessionTrust` per tracking session (the Python :class:`~foundationpose.estimator.
Tracker`, the demo, the HTTP server's sessions), so a frame's verdict, the state machine
(:mod:`foundationpose.session_state`), the choice of recovery candidates (:mod:`foundationpose.recovery`) and
the symmetric object's canonical pose (:func:`foundationpose.symmetry.canonical_pose`) are decided in one place:

* :meth:`SessionTrust.judge` after every result: the next state, whether the pose is reported valid, and the
  ``cam_from_centred`` to show (the member of the pose's symmetry class nearest the last one shown);
* :attr:`SessionTrust.recovery_due` before a frame: the session is LOST and recovers by itself; then
  :meth:`SessionTrust.recovery_plan` says how this frame's candidate mask is picked (cycling through the ranked
  candidates, one per frame, until a pose is reported valid).

A frame's steps around these calls (plan, recovery register, answer) are :mod:`foundationpose.session_step`'s.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from foundationpose.coordinate_frames import to_mesh_frame
from foundationpose.mesh import ObjectModel
from foundationpose.recovery import DEFAULT_RECOVERY, RecoveryCandidate, RecoveryConfig, RecoveryPlan
from foundationpose.session_state import (
    SessionConfig,
    SessionReport,
    SessionState,
    State,
    advance,
    start_session,
)
from foundationpose.symmetry import canonical_pose

__all__ = ["CLIENT_POSE", "CLIENT_REGISTER", "TRACK", "SessionTrust", "recovery_source"]

CLIENT_REGISTER = "register (client mask)"  # a register on the client's mask: trusted at once when valid
CLIENT_POSE = "start (client pose)"  # a session begun from a pose the client gives
TRACK = "track"


def recovery_source(candidate: RecoveryCandidate) -> str:
    """The ``source`` of a pose from a recovery register on ``candidate``."""
    return f"recovery register ({candidate.source} candidate)"


class SessionTrust:
    """The trust state of one session of ``obj``.

    config: the state machine's thresholds. recovery: how candidates are found while LOST; None = no automatic
    recovery (the session tracks on from its last estimate, and may re-acquire by itself). The object's
    symmetries (``obj.symmetry``) decide the pose shown.
    """

    def __init__(self, obj: ObjectModel, *, config: SessionConfig | None = None,
                 recovery: RecoveryConfig | None = DEFAULT_RECOVERY) -> None:
        self.obj = obj
        self.config = config or SessionConfig()
        self.recovery = recovery
        self.state: SessionState = start_session()
        self.attempts = 0  # recovery registers since the last pose reported valid
        self.shown: np.ndarray | None = None  # the last answer's cam_from_centred (canonical under the symmetries)
        symmetry = obj.symmetry
        self._tfs = None if symmetry is None else torch.as_tensor(symmetry.tfs_centred, dtype=torch.float32)

    @property
    def recovery_due(self) -> bool:
        """The session is LOST and recovers by itself: the next frame should first try a register on the
        candidate of :meth:`recovery_plan`."""
        return self.state.state is State.LOST and self.recovery is not None

    def recovery_plan(self) -> RecoveryPlan:
        """This frame's recovery (its ``candidate(depth, K, diameter)`` picks the mask); the next call moves on to
        the next ranked candidate."""
        assert self.recovery is not None, "recovery_plan needs a RecoveryConfig"
        plan = RecoveryPlan(self.recovery, self.state.last_valid_cam_from_centred, self.state.frames_since_valid,
                            self.attempts)
        self.attempts += 1
        return plan

    def start_from(self, cam_from_centred: np.ndarray) -> SessionReport:
        """Begin from a pose the client gives (trusted as a register on the client's mask is)."""
        self.state, reported = advance(self.state, valid=True, cam_from_centred=cam_from_centred, register=True,
                                       forced=True, config=self.config)
        self.shown = np.asarray(cam_from_centred, dtype=np.float32)
        return SessionReport(self.state.state, reported, None, CLIENT_POSE)

    def judge(self, validity: Any, cam_from_centred: np.ndarray, *, source: str) -> tuple[SessionReport, np.ndarray]:
        """Advance the session by one result: ``(report, cam_from_centred to show (4, 4) float32)``.

        validity: the result's :class:`~foundationpose.validity.Judgement` (None counts as invalid).
        cam_from_centred: the result's tracking state. source: :data:`CLIENT_REGISTER`, :data:`TRACK` or
        :func:`recovery_source` (a register on the client's mask is trusted at once when valid; a recovery
        register must be confirmed by the next frames).
        """
        valid = validity is not None and bool(validity.valid)
        register = source != TRACK
        self.state, reported = advance(self.state, valid=valid, cam_from_centred=cam_from_centred, register=register,
                                       forced=source in (CLIENT_REGISTER, CLIENT_POSE), config=self.config)
        if reported:
            self.attempts = 0
        shown = np.asarray(cam_from_centred, dtype=np.float32)
        if self._tfs is not None:
            reference = None if self.shown is None else torch.as_tensor(self.shown)[None]
            shown = canonical_pose(torch.as_tensor(shown)[None], self._tfs, reference)[0].numpy()
        self.shown = shown
        confidence = None if validity is None else float(validity.confidence)
        return SessionReport(self.state.state, reported, confidence, source), shown

    def cam_from_mesh(self, shown: np.ndarray) -> np.ndarray:
        """(4, 4) float64 cam_from_mesh of a pose :meth:`judge` returned."""
        return to_mesh_frame(shown, self.obj.centred_from_mesh)
