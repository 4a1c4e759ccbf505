"""The ingest worker processes: their port's listening socket, the workers on it, restarts and shutdown.

The GPU process binds the port itself (the server's own unless ``ingest_port`` names another; a port already in
use fails the start-up with that message, not a worker's log line), then starts ``workers`` processes of
``python -m server.ingest.worker``. It accepts the connections itself and hands each to the worker with the fewest
open ones (:mod:`server.ingest.dispatch`; where every worker accepted on one shared socket, the kernel spread
long-lived connections unevenly: on the H200 under 64 clients one of 8 workers used 0.7-0.9 of a core while
another used 0.06-0.3). A worker that exits while the server runs is started again (its in-flight requests fail
with the connection; at most ``max_restarts`` within a minute, then the port is left with fewer workers and a log
line says so). :meth:`stop` ends them with SIGTERM (graceful: requests in progress are answered), then SIGKILL
after ``stop_timeout_s``.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from deploy_core.memory.ring import check_room, remove_rings_of, remove_stale_rings
from server.ingest.dispatch import ConnectionDispatcher

__all__ = ["IngestConfig", "IngestWorkers"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class IngestConfig:
    """workers: processes on the port. host / port: where they listen (port 0: any free port).
    slots: frames each worker may hand to the GPU process at once (its ring; a request beyond gets 503).
    loop_stall_s: a worker's event loop that runs no timer for this long is logged with its stack (0: off)."""

    workers: int
    host: str = "127.0.0.1"
    port: int = 0
    slots: int = 32
    loop_stall_s: float = 2.0
    max_restarts: int = 5  # per worker, within a minute
    stop_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"ingest workers must be >= 1, got {self.workers!r}")
        if self.slots < 1:
            raise ValueError(f"ingest slots must be >= 1, got {self.slots!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"ingest port must be in 0..65535, got {self.port!r}")


class IngestWorkers:
    """Runs ``config.workers`` worker processes for the hub at ``hub_path``."""

    def __init__(self, config: IngestConfig, *, hub_path: Path, max_image_hw: tuple[int, int], api_key: str | None,
                 max_upload_bytes: int, retry_after_s: int, request_timeout_s: float, stream_idle_s: float = 60.0,
                 log_level: str = "WARNING", fallback: Callable[[socket.socket], None] | None = None) -> None:
        """fallback: serves a connection no worker can take, in the GPU process (:class:`ConnectionDispatcher`)."""
        self.config = config
        self._fallback = fallback
        self.hub_path = Path(hub_path)
        self._max_image_hw = (int(max_image_hw[0]), int(max_image_hw[1]))
        self._worker_args = [
            "--hub", str(self.hub_path), "--max-image", f"{max_image_hw[1]}x{max_image_hw[0]}",
            "--slots", str(config.slots), "--max-upload-bytes", str(max_upload_bytes),
            "--retry-after-s", str(retry_after_s), "--request-timeout-s", str(request_timeout_s),
            "--stream-idle-s", str(stream_idle_s), "--graceful-s", str(config.stop_timeout_s),
            "--log-level", log_level,
            "--loop-stall-s", str(config.loop_stall_s),
        ]
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._env.pop("FP_API_KEY", None)
        if api_key is not None:
            self._env["FP_API_KEY"] = api_key  # not on the command line, where ps shows it
        self._sock: socket.socket | None = None
        self.dispatcher: ConnectionDispatcher | None = None  # hands the port's connections out (start())
        self._procs: list[subprocess.Popen | None] = [None] * config.workers
        self._starts: list[deque[float]] = [deque() for _ in range(config.workers)]
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._monitor: threading.Thread | None = None
        self.restarts = 0
        self.port: int | None = None

    def start(self) -> None:
        """Bind the port (OSError naming it when taken) and start the workers (OSError when their frame rings
        do not fit in shared memory)."""
        stale = remove_stale_rings()
        if stale:
            log.info("ingest: removed %d frame ring files of processes that no longer exist", stale)
        check_room(self.config.workers, self.config.slots, self._max_image_hw)
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.config.host, self.config.port))
        except OSError as exc:
            sock.close()
            raise OSError(exc.errno, f"ingest workers' port {self.config.host}:{self.config.port}: {exc.strerror}") from exc
        sock.listen(2048)
        self._sock = sock
        self.port = int(sock.getsockname()[1])
        self.dispatcher = ConnectionDispatcher(sock, self._fallback)
        for i in range(self.config.workers):
            self._spawn(i)
        self.dispatcher.start()
        self._monitor = threading.Thread(target=self._watch, name="fp-ingest-monitor", daemon=True)
        self._monitor.start()
        log.info("ingest: %d workers on http://%s:%d", self.config.workers, self.config.host,
                 self.port)

    @property
    def pids(self) -> list[int]:
        with self._lock:
            return [p.pid for p in self._procs if p is not None and p.poll() is None]

    def _spawn(self, i: int) -> None:
        assert self.dispatcher is not None
        channel = self.dispatcher.attach(i)  # its connections come over a channel of its own
        fd = channel.fileno()
        cmd = [sys.executable, "-m", "server.ingest.worker", "--channel-fd", str(fd), *self._worker_args]
        try:
            proc = subprocess.Popen(cmd, pass_fds=(fd,), env=self._env, cwd=Path(__file__).resolve().parents[2])
        finally:
            channel.close()  # the worker holds its end now
        with self._lock:
            self._procs[i] = proc
        self._starts[i].append(time.monotonic())

    def _watch(self) -> None:
        """Start a worker again when it exits while the server runs (bounded per minute)."""
        while not self._stopping.wait(0.2):
            for i in range(self.config.workers):
                with self._lock:
                    proc = self._procs[i]
                if proc is None or proc.poll() is None:
                    continue
                starts = self._starts[i]
                now = time.monotonic()
                while starts and now - starts[0] > 60.0:
                    starts.popleft()
                if len(starts) > self.config.max_restarts:
                    self._remove_rings(proc.pid)
                    log.error("ingest worker %d exited %d times within a minute (last status %s); not restarting it",
                              i, len(starts), proc.returncode)
                    with self._lock:
                        self._procs[i] = None
                    continue
                log.warning("ingest worker %d (pid %d) exited with status %s; starting it again", i, proc.pid,
                            proc.returncode)
                self._remove_rings(proc.pid)
                self.restarts += 1
                self._spawn(i)

    def stop(self) -> None:
        """Stop handing out connections, SIGTERM every worker, SIGKILL what is left after ``stop_timeout_s``; close the
        socket."""
        self._stopping.set()
        if self._monitor is not None:
            self._monitor.join()
        if self.dispatcher is not None:
            self.dispatcher.stop()
        with self._lock:
            procs = [p for p in self._procs if p is not None]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.config.stop_timeout_s + 2.0  # the workers' graceful window is stop_timeout_s
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("ingest worker pid %d did not stop in %.0f s; killing it", proc.pid,
                            self.config.stop_timeout_s)
                proc.kill()
                proc.wait()
        for proc in procs:
            self._remove_rings(proc.pid)
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    @staticmethod
    def _remove_rings(pid: int) -> None:
        """The ring file of a worker that exited before the GPU process mapped (and unlinked) it."""
        if remove_rings_of(pid):
            log.info("ingest: removed the frame ring file of worker pid %d (it exited before connecting)", pid)
