"""SessionTrust: one session's verdicts, when it recovers and the pose shown for a symmetric object."""

from __future__ import annotations

import numpy as np
import trimesh

from foundationpose.mesh import load_object
from foundationpose.session_state import State
from foundationpose.session_trust import CLIENT_REGISTER, TRACK, SessionTrust
from foundationpose.symmetry import parse_symmetry
from foundationpose.validity import Judgement

VALID = Judgement(measurements=np.zeros(11, np.float32), confidence=0.9, valid=True)
INVALID = Judgement(measurements=np.zeros(11, np.float32), confidence=0.1, valid=False)


def _box(symmetries=()):
    return load_object(trimesh.creation.box(extents=(0.06, 0.06, 0.10)), symmetries=symmetries)


def _pose(z: float = 0.5, yaw_deg: float = 0.0) -> np.ndarray:
    c, s = np.cos(np.radians(yaw_deg)), np.sin(np.radians(yaw_deg))
    pose = np.eye(4, dtype=np.float32)
    pose[:2, :2] = [[c, -s], [s, c]]
    pose[2, 3] = z
    return pose


def test_a_client_register_is_trusted_and_three_invalid_tracks_lose_the_session() -> None:
    trust = SessionTrust(_box())
    report, _ = trust.judge(VALID, _pose(), source=CLIENT_REGISTER)
    assert (report.state, report.pose_valid, report.confidence, report.source) == (State.TRACKING, True, 0.9,
                                                                                  CLIENT_REGISTER)
    states = [trust.judge(INVALID, _pose(), source=TRACK)[0] for _ in range(3)]
    assert [(r.state, r.pose_valid) for r in states] == [(State.UNCERTAIN, False), (State.UNCERTAIN, False),
                                                         (State.LOST, False)]
    assert trust.recovery_due
    # a missing verdict counts as invalid
    assert trust.judge(None, _pose(), source=TRACK)[0].confidence is None


def test_a_recovery_register_must_be_confirmed_and_resets_the_candidate_cycle() -> None:
    trust = SessionTrust(_box())
    trust.judge(INVALID, _pose(), source=CLIENT_REGISTER)
    assert trust.state.state is State.LOST
    trust.attempts = 3
    report, _ = trust.judge(VALID, _pose(), source="recovery register (region candidate)")
    assert (report.state, report.pose_valid) == (State.RECOVERING, False) and trust.attempts == 3
    report, _ = trust.judge(VALID, _pose(), source=TRACK)
    assert (report.state, report.pose_valid) == (State.TRACKING, True) and trust.attempts == 0
    assert not trust.recovery_due


def test_no_recovery_config_means_no_recovery() -> None:
    trust = SessionTrust(_box(), recovery=None)
    trust.judge(INVALID, _pose(), source=CLIENT_REGISTER)
    assert trust.state.state is State.LOST and not trust.recovery_due


def test_a_symmetric_flip_is_shown_as_the_previous_pose() -> None:
    trust = SessionTrust(_box([parse_symmetry("z:4")]))
    _, first = trust.judge(VALID, _pose(yaw_deg=10.0), source=CLIENT_REGISTER)
    np.testing.assert_allclose(first, _pose(yaw_deg=10.0), atol=1e-6)  # nearest the identity: kept
    _, shown = trust.judge(VALID, _pose(yaw_deg=10.0 + 90.0 + 2.0), source=TRACK)  # flipped by a quarter turn
    np.testing.assert_allclose(shown, _pose(yaw_deg=12.0), atol=1e-5)
    np.testing.assert_allclose(trust.cam_from_mesh(shown), shown.astype(np.float64) @ trust.obj.centred_from_mesh)
