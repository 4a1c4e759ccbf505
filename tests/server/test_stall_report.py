"""A step that runs too long logs every thread's stack, so a start-up that never ends says where it waits."""

from __future__ import annotations

import logging
import threading

import pytest

from server.stall_report import StallReport, thread_stacks

from ._helpers import SETUP_WAIT_S


class _Records(logging.Handler):
    """Collects the stall reports and signals each one."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self.arrived = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        self.arrived.set()


@pytest.fixture
def reports():
    handler = _Records()
    logger = logging.getLogger("server.stall_report")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def _stuck_here(released: threading.Event, reports: _Records) -> None:
    """The stalled step: waits until a report came, as a step blocked on a lock would."""
    assert reports.arrived.wait(SETUP_WAIT_S), "no stall report came"
    released.set()


def test_a_step_past_its_time_logs_the_stack_of_every_thread(reports) -> None:
    released = threading.Event()
    other = threading.Thread(target=released.wait, name="fp-other-worker", daemon=True)
    other.start()
    with StallReport("warm-up step 'requests'", after_s=0.01, max_reports=1) as stall:
        _stuck_here(released, reports)
    other.join()
    assert stall.reports == 1 and len(reports.messages) == 1
    message = reports.messages[0]
    assert message.startswith("warm-up step 'requests' has run ")
    assert "in _stuck_here" in message  # the stalled thread's own frame
    assert "--- thread fp-other-worker" in message and "in wait" in message  # and every other thread's


def test_a_step_that_ends_in_time_reports_nothing_and_stops_its_watcher(reports) -> None:
    with StallReport("warm-up step 'objects'", after_s=3600.0) as stall:
        pass
    assert stall.reports == 0 and reports.messages == []
    assert stall._thread is not None and not stall._thread.is_alive()


def test_reports_stop_at_their_limit(reports) -> None:
    with StallReport("step", after_s=0.001, max_reports=2) as stall:
        thread = stall._thread
        thread.join(SETUP_WAIT_S)  # the watcher ends by itself after its last report
        assert not thread.is_alive()
    assert stall.reports == 2 and len(reports.messages) == 2


def test_the_stacks_name_each_thread_once() -> None:
    text = thread_stacks()
    assert text.count(f"({threading.main_thread().ident})") == 1
    assert "in test_the_stacks_name_each_thread_once" in text


def test_a_report_needs_a_positive_time() -> None:
    with pytest.raises(ValueError, match="after_s must be > 0, got 0"):
        StallReport("step", after_s=0)
