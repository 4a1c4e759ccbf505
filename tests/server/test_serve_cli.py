"""``python -m server.serve`` as an operator runs it: it comes up on a local Ray, and SIGTERM shuts it down cleanly."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install -e '.[serve]')")

from tests.server._helpers import SETUP_WAIT_S, free_port, write_objects_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
UP_TIMEOUT_S = SETUP_WAIT_S  # a safety net: Ray and a replica start in about a minute on an idle 2-core machine
STOP_TIMEOUT_S = 90.0


def _lines_of(proc: subprocess.Popen) -> queue.Queue:
    """The process's output lines, as they come (a reader thread), so a test can wait for one with a deadline."""
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def _wait_for_line(lines: queue.Queue, needle: str, timeout_s: float, seen: list[str]) -> bool:
    while True:
        try:
            line = lines.get(timeout=timeout_s)
        except queue.Empty:
            return False
        if line is None:
            return False
        seen.append(line)
        if needle in line:
            return True


def _group_gone(pgid: int, timeout_s: float) -> bool:
    """Whether every process of the group ``pgid`` (the CLI and the Ray processes it started) has exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow  # a Ray instance: ~15 s
def test_sigterm_stops_the_serve_application_and_ray_with_status_0(tmp_path):
    """Before, ``ray.init`` replaced the CLI's SIGTERM handler with Ray's own, which aborts the process (status 134)
    without deleting the application; now the CLI's handler is put back and the shutdown runs."""
    objects = write_objects_dir(tmp_path / "objects")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.serve", "--objects", str(objects), "--device", "cpu", "--tiny",
         "--replicas", "1", "--host", "127.0.0.1", "--port", str(port)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen: list[str] = []
    try:
        lines = _lines_of(proc)
        assert _wait_for_line(lines, "serving 1 pose replicas", UP_TIMEOUT_S, seen), \
            f"no 'serving 1 pose replicas' within {UP_TIMEOUT_S:.0f} s; its output: " + "".join(seen)[-4000:]
        ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=60.0)
        assert ready.status_code == 200 and ready.json()["ready"] is True
        proc.send_signal(signal.SIGTERM)  # the main process only, as `docker stop` or `kill PID` does
        assert proc.wait(timeout=STOP_TIMEOUT_S) == 0, "".join(seen)[-4000:]
        _wait_for_line(lines, "(the end of the output)", 10.0, seen)  # the rest, up to the end of the output
        assert any("shutting down (SIGTERM)" in line for line in seen), "".join(seen)[-4000:]
        assert _group_gone(proc.pid, 30.0), "Ray processes of the stopped service are still running"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
