"""One frame of a session: its plan (track, or a register on the next ranked recovery candidate) and its answer."""

from __future__ import annotations

import numpy as np
import trimesh

from foundationpose.mesh import load_object
from foundationpose.recovery import RecoveryConfig
from foundationpose.session_state import State
from foundationpose.session_step import answer, plan_frame, recovery_register
from foundationpose.session_trust import CLIENT_REGISTER, TRACK, SessionTrust
from foundationpose.symmetry import parse_symmetry
from foundationpose.validity import Judgement

VALID = Judgement(measurements=np.zeros(11, np.float32), confidence=0.9, valid=True)
INVALID = Judgement(measurements=np.zeros(11, np.float32), confidence=0.1, valid=False)
K = np.array([[500.0, 0, 80], [0, 500.0, 60], [0, 0, 1]])


class _Result:
    """What :func:`answer` reads of a register's or a track step's result."""

    def __init__(self, validity: Judgement | None, cam_from_centred: np.ndarray) -> None:
        self.validity = validity
        self.cam_from_centred = cam_from_centred


def _box(symmetries=()):
    return load_object(trimesh.creation.box(extents=(0.06, 0.06, 0.10)), symmetries=symmetries)


def _pose(yaw_deg: float = 0.0) -> np.ndarray:
    c, s = np.cos(np.radians(yaw_deg)), np.sin(np.radians(yaw_deg))
    pose = np.eye(4, dtype=np.float32)
    pose[:2, :2] = [[c, -s], [s, c]]
    pose[2, 3] = 0.5
    return pose


def _two_blocks() -> np.ndarray:
    """A depth image with two box-sized blocks in front of a table plane facing the camera."""
    depth = np.full((120, 160), 0.8, np.float32)
    depth[40:80, 60:100] = 0.55
    depth[75:115, 110:150] = 0.6
    return depth


def test_only_a_lost_session_that_recovers_plans_a_recovery() -> None:
    trust = SessionTrust(_box())
    answer(trust, _Result(VALID, _pose()), CLIENT_REGISTER)
    assert plan_frame(trust) is None  # tracking: a track step
    for _ in range(3):
        answer(trust, _Result(INVALID, _pose()), TRACK)
    assert trust.state.state is State.LOST and plan_frame(trust) is not None
    off = SessionTrust(_box(), recovery=None)
    answer(off, _Result(INVALID, _pose()), CLIENT_REGISTER)
    assert off.state.state is State.LOST and plan_frame(off) is None


def test_each_frame_registers_on_the_next_ranked_candidate() -> None:
    obj = _box()
    trust = SessionTrust(obj, recovery=RecoveryConfig(min_plane_fraction=0.3))
    depth = _two_blocks()
    first, second, third = (recovery_register(plan_frame(trust), depth, K, obj.diameter) for _ in range(3))
    assert first is not None and second is not None and third is not None
    assert trust.attempts == 3
    assert not np.array_equal(first.mask, second.mask) and np.array_equal(first.mask, third.mask)
    assert first.mask.shape == depth.shape and first.mask.dtype == np.bool_
    assert first.source == f"recovery register ({first.candidate.source} candidate)"
    report = answer(trust, _Result(VALID, _pose()), first.source).report
    assert (report.state, report.pose_valid, report.source) == (State.RECOVERING, False, first.source)
    assert recovery_register(plan_frame(SessionTrust(obj)), np.zeros((120, 160), np.float32), K, obj.diameter) is None


def test_the_answer_shows_the_symmetric_pose_nearest_the_last_in_the_mesh_frame() -> None:
    trust = SessionTrust(_box([parse_symmetry("z:4")]))
    first = answer(trust, _Result(VALID, _pose(yaw_deg=10.0)), CLIENT_REGISTER)
    assert (first.report.state, first.report.pose_valid, first.report.confidence) == (State.TRACKING, True, 0.9)
    flipped = answer(trust, _Result(VALID, _pose(yaw_deg=10.0 + 90.0 + 2.0)), TRACK)  # a quarter turn on
    want = _pose(yaw_deg=12.0).astype(np.float64) @ trust.obj.centred_from_mesh
    np.testing.assert_allclose(flipped.cam_from_mesh, want, atol=1e-5)
    assert flipped.cam_from_mesh.dtype == np.float64
    assert answer(trust, _Result(None, _pose()), TRACK).report.confidence is None  # no verdict: invalid
