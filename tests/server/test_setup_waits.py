"""The tests' set-up waits (tests/server/_helpers.py): they return once the state holds and fail naming it."""

from __future__ import annotations

import pytest

from tests.server._helpers import READY_TIMEOUT_S, SETUP_WAIT_S, assert_ready, wait_for


def test_set_up_waits_have_a_safety_net_that_holds_on_a_loaded_machine():
    assert SETUP_WAIT_S >= 300 and READY_TIMEOUT_S >= 300


def test_wait_for_returns_once_the_state_holds():
    polls = iter([False, False, True])
    wait_for(lambda: next(polls), "the third poll")
    assert next(polls, None) is None  # polled exactly three times


def test_wait_for_names_the_state_it_waited_for():
    with pytest.raises(AssertionError, match=r"^not reached within 0 s: every worker \(2\) connected to the hub$"):
        wait_for(lambda: False, "every worker (2) connected to the hub", timeout=0.0)


class _State:
    def __init__(self, phase: str, failure: str | None) -> None:
        self.phase, self.failure, self.waited = phase, failure, None

    def wait_ready(self, timeout: float) -> bool:
        self.waited = timeout
        return self.phase == "ready"


def test_assert_ready_passes_a_ready_app_and_waits_with_the_set_up_limit():
    state = _State("ready", None)
    assert_ready(state, "the app")
    assert state.waited == SETUP_WAIT_S


@pytest.mark.parametrize(("state", "reason"), [
    (_State("failed", "FileExistsError: objects"), r"FileExistsError: objects"),
    (_State("starting", None), r"still 'starting' after 5 s"),
])
def test_assert_ready_names_what_it_waited_for_and_why_it_is_not_ready(state, reason):
    with pytest.raises(AssertionError, match=rf"^not ready: the app with 1 ingest workers \({reason}\)$"):
        assert_ready(state, "the app with 1 ingest workers", timeout=5.0)
    assert state.waited == 5.0
