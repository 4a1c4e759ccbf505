"""Shared helpers of the pipeline, queue and timing tests: gates, workers, thread checks.

Holds no tests; the test modules import it as ``tests.deploy_core.test_pipeline_support``. The autouse
"no ``fp-`` thread left behind" check lives in ``tests/deploy_core/conftest.py``, for every module.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

WAIT_S = 10.0  # bounded waits only ever fail a test; they never order one


class Gate:
    """A stage function that parks until the test opens it."""

    def __init__(self, name: str = "gate") -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.seen: list[Any] = []

    def __call__(self, pkg: Any) -> None:
        self.seen.append(pkg.data)
        self.entered.set()
        assert self.opened.wait(WAIT_S), "test never opened the gate"


class Worker:
    """Runs ``fn`` in a thread and keeps its outcome (value or exception)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(fn,), name="test-worker")
        self.thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.value = fn()
        except BaseException as exc:
            self.error = exc
        finally:
            self.done.set()

    def join(self) -> Worker:
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), "worker thread did not finish"
        return self


def fp_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("fp-")]
