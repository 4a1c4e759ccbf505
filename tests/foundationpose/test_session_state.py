"""The session state machine: every transition, the reported validity and the remembered pose."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from foundationpose.session_state import SessionConfig, SessionState, State, advance, start_session

T, U, L, R = State.TRACKING, State.UNCERTAIN, State.LOST, State.RECOVERING
DEFAULT = SessionConfig()
POSE = np.diag([1.0, 1.0, 1.0, 1.0]).astype(np.float32)


def _run(events: list[str], config: SessionConfig = DEFAULT) -> list[tuple[State, bool]]:
    """Events: "F+"/"F-" forced register valid/invalid, "A+"/"A-" automatic register, "+"/"-" track frames."""
    s, out = start_session(), []
    for e in events:
        register, forced = e.startswith(("F", "A")), e.startswith("F")
        s, reported = advance(s, valid=e.endswith("+"), cam_from_centred=POSE, register=register, forced=forced,
                              config=config)
        out.append((s.state, reported))
    return out


def _states(events: list[str], config: SessionConfig = DEFAULT) -> list[State]:
    return [state for state, _ in _run(events, config)]


def test_a_new_session_is_lost_with_no_pose() -> None:
    s = start_session()
    assert s.state is L and s.frames_since_valid is None and s.last_valid_cam_from_centred is None


def test_tracking_stays_tracking_on_valid_frames() -> None:
    assert _run(["F+", "+", "+"]) == [(T, True), (T, True), (T, True)]


def test_tracking_to_uncertain_and_back() -> None:
    assert _run(["F+", "-", "+"]) == [(T, True), (U, False), (T, True)]


def test_uncertain_to_lost_after_three_invalid_frames_in_a_row() -> None:
    assert _states(["F+", "-", "-", "-", "-"]) == [T, U, U, L, L]
    assert _states(["F+", "-", "-", "+", "-", "-", "-"]) == [T, U, U, T, U, U, L]  # the run restarts


@pytest.mark.parametrize("lost_after", [1, 2, 4])
def test_lost_after_is_configurable(lost_after: int) -> None:
    states = _states(["F+"] + ["-"] * lost_after, SessionConfig(lost_after_invalid=lost_after))
    assert states[-1] is L and L not in states[:-1]


def test_lost_recovers_through_recovering_on_valid_track_frames() -> None:
    assert _run(["F+", "-", "-", "-", "+", "+"]) == [(T, True), (U, False), (U, False), (L, False),
                                                      (R, False), (T, True)]


def test_recovering_falls_back_to_lost_on_an_invalid_frame() -> None:
    assert _states(["F+", "-", "-", "-", "+", "-"]) == [T, U, U, L, R, L]


def test_automatic_register_starts_recovering_and_needs_confirmation() -> None:
    assert _run(["F+", "-", "-", "-", "A+", "+"]) == [(T, True), (U, False), (U, False), (L, False),
                                                       (R, False), (T, True)]
    assert _states(["F+", "-", "-", "-", "A-"]) == [T, U, U, L, L]
    assert _states(["F+", "-", "-", "-", "A+", "A+"]) == [T, U, U, L, R, R]  # each register restarts the count


def test_confirm_frames_one_trusts_the_recovery_at_once() -> None:
    config = SessionConfig(confirm_frames=1)
    assert _run(["F+", "-", "-", "-", "A+"], config)[-1] == (T, True)
    assert _run(["F+", "-", "-", "-", "+"], config)[-1] == (T, True)


@pytest.mark.parametrize("before", [["F+"], ["F+", "-"], ["F+", "-", "-", "-"], ["F+", "-", "-", "-", "+"], []])
def test_a_forced_register_decides_from_any_state(before: list[str]) -> None:
    assert _run(before + ["F+"])[-1] == (T, True)
    assert _run(before + ["F-"])[-1] == (L, False)


def test_a_lost_or_recovering_session_never_reports_a_valid_pose() -> None:
    config = SessionConfig(confirm_frames=3)
    for events in itertools.product(["+", "-", "A+", "A-"], repeat=5):
        for state, reported in _run(["F+", "-", "-", "-", *events], config):
            assert not reported or state is T


def test_the_last_valid_pose_and_the_time_since_it() -> None:
    s, _ = advance(start_session(), valid=True, cam_from_centred=POSE, register=True, forced=True)
    assert s.frames_since_valid == 0 and np.array_equal(s.last_valid_cam_from_centred, POSE)
    moved = POSE.copy()
    moved[0, 3] = 1.0
    for k in range(1, 4):
        s, reported = advance(s, valid=False, cam_from_centred=moved)
        assert not reported and s.frames_since_valid == k
    assert np.array_equal(s.last_valid_cam_from_centred, POSE)  # invalid poses are never remembered
    s, _ = advance(s, valid=True, cam_from_centred=moved)  # LOST -> RECOVERING: not reported, not remembered
    assert s.state is R and s.frames_since_valid == 4 and s.last_valid_cam_from_centred[0, 3] == 0.0
    s, _ = advance(s, valid=True, cam_from_centred=moved)
    assert s.state is T and s.frames_since_valid == 0 and s.last_valid_cam_from_centred[0, 3] == 1.0
    assert not s.last_valid_cam_from_centred.flags.writeable


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match=r"^forced=True describes a register"):
        advance(SessionState(), valid=True, forced=True)
    with pytest.raises(ValueError, match=r"^lost_after_invalid must be >= 1"):
        SessionConfig(lost_after_invalid=0)
    assert State("lost") is L and T.value == "tracking"
