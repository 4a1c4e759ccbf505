"""One frame of a tracking session, the same for every way in: what the frame runs, and the answer it gets.

A session keeps a :class:`~foundationpose.session_trust.SessionTrust` and its tracking state (the last result's
``cam_from_centred``). Whoever computes the poses (:class:`~foundationpose.estimator.Tracker` calls the estimator;
the server's flow submits to a :class:`~foundationpose.service.PoseService`, perhaps in another process) and however
it waits for them, each frame goes through these steps:

1. :func:`plan_frame`, before the frame and in the session's order: None means a track step from the tracking
   state; a :class:`~foundationpose.recovery.RecoveryPlan` means the session is LOST and recovers by itself (the
   plan is plain values, so it can travel with the frame to the process that computes it);
2. :func:`recovery_register`, where the frame's depth is (validated, metres): the plan's candidate mask to register
   on and the source its answer reports, or None when the depth offers no candidate. No candidate, or a register
   that is refused (too little depth under the mask: :class:`~foundationpose.errors.InputError`; a full register
   lane), means the frame is tracked from the tracking state instead;
3. :func:`answer`, once the frame's pose is computed: the session's verdict (its state after the frame, whether
   the pose is reported valid, the confidence, the source) and the pose to show. The tracking state to keep is the
   result's own ``cam_from_centred``.

The sources are :data:`~foundationpose.session_trust.CLIENT_REGISTER` for a register on the client's mask (or box),
:data:`~foundationpose.session_trust.TRACK` for a track step and :attr:`RecoveryRegister.source` for a recovery
register.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from foundationpose.recovery import RecoveryCandidate, RecoveryPlan
from foundationpose.session_state import SessionReport
from foundationpose.session_trust import SessionTrust, recovery_source

__all__ = ["RecoveryRegister", "SessionAnswer", "answer", "plan_frame", "recovery_register"]


@dataclass(frozen=True, slots=True, eq=False)
class RecoveryRegister:
    """A lost session's frame as a register on a recovery candidate (``candidate.mask``: (H, W) bool)."""

    candidate: RecoveryCandidate

    @property
    def mask(self) -> np.ndarray:
        return self.candidate.mask

    @property
    def source(self) -> str:
        """The ``source`` its answer reports."""
        return recovery_source(self.candidate)


@dataclass(frozen=True, slots=True, eq=False)
class SessionAnswer:
    """One result as its session answers it. report: the state after the frame, whether its pose is reported valid,
    the confidence and the source. cam_from_mesh: (4, 4) float64, the pose to show (for a symmetric object the
    member of the pose's symmetry class nearest the last one shown)."""

    report: SessionReport
    cam_from_mesh: np.ndarray


def plan_frame(trust: SessionTrust) -> RecoveryPlan | None:
    """What the session's next frame runs: None, a track step; a plan, first a register on the candidate it picks
    in the frame's depth (each plan moves the session on to its next ranked candidate)."""
    return trust.recovery_plan() if trust.recovery_due else None


def recovery_register(plan: RecoveryPlan, depth: np.ndarray, K: np.ndarray, diameter: float
                      ) -> RecoveryRegister | None:
    """The register a lost session's frame tries first (depth: (H, W) float32 metres; K: (3, 3) pixels; diameter:
    the object's, metres), or None when the depth offers no candidate."""
    candidate = plan.candidate(depth, np.asarray(K, dtype=np.float64), diameter)
    return None if candidate is None else RecoveryRegister(candidate)


def answer(trust: SessionTrust, result: Any, source: str) -> SessionAnswer:
    """Advance the session by one computed pose and answer it.

    result: anything with ``validity`` (a :class:`~foundationpose.validity.Judgement`, None counts as invalid) and
    ``cam_from_centred`` ((4, 4), the tracking state): a register's or a track step's result.
    """
    report, shown = trust.judge(result.validity, result.cam_from_centred, source=source)
    return SessionAnswer(report, trust.cam_from_mesh(shown))
