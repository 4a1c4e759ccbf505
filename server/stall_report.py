"""A warning with every thread's stack when a step runs for too long.

A start-up step that never ends (a lock nobody releases, a GPU wait that never completes) otherwise leaves
``/readyz`` at 503 and nothing in the log until ``warmup_timeout_s``. :class:`StallReport` wraps such a step: a
daemon thread waits ``after_s``, and while the step still runs it logs a warning naming the step, how long it has
run, and the current stack of every Python thread of the process, then again every ``after_s`` (at most
``max_reports`` times). The thread needs the GIL to report: a step blocked in a call that holds the GIL is reported
once that call returns.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from types import TracebackType

__all__ = ["StallReport", "thread_stacks"]

log = logging.getLogger(__name__)


def thread_stacks() -> str:
    """The current stack of every Python thread of this process, each headed by its name and id."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sorted(sys._current_frames().items()):
        stack = "".join(traceback.format_stack(frame))
        parts.append(f"--- thread {names.get(ident, '?')} ({ident}):\n{stack}")
    return "".join(parts)


class StallReport:
    """``with StallReport("warm-up step 'requests'", 60.0): ...``: warnings with every thread's stack each ``after_s``
    the body runs past, at most ``max_reports``. ``reports``: how many were logged."""

    def __init__(self, what: str, after_s: float, max_reports: int = 3) -> None:
        if after_s <= 0:
            raise ValueError(f"after_s must be > 0, got {after_s}")
        self.what = what
        self.after_s = after_s
        self.max_reports = max_reports
        self.reports = 0
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = 0.0

    def __enter__(self) -> StallReport:
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._watch, name="fp-stall-report", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        while self.reports < self.max_reports and not self._done.wait(self.after_s):
            self.reports += 1
            log.warning("%s has run %.0f s and is still running; the threads now:\n%s", self.what,
                        time.monotonic() - self._started, thread_stacks())
