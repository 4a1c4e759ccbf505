"""``--spawn``: a tiny ``python -m server`` on a free loopback port for the length of a run."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tools.ports import free_port

__all__ = ["spawned_server"]

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def spawned_server(args: argparse.Namespace, api_key: str, extra_args: tuple[str, ...] = (),
                   ingest_workers: int = 0) -> Iterator[tuple[str, dict]]:
    """Run ``python -m server`` (tiny config, on a CPU without the start-up's warm-up, then ``extra_args``) on a
    free loopback port until the block exits; ``server_info`` has the command, port, ``pid`` and start-up seconds
    (and the exit code after).
    ``ingest_workers`` > 0: also ``--ingest-workers N --ingest-port P`` on another free port, ready once
    that port's ``/healthz`` answers too; ``server_info["track_url"]`` is its URL."""
    port = free_port(consecutive=2)
    ingest_port = port + 1 if ingest_workers > 0 else None
    with tempfile.TemporaryDirectory(prefix="fp-loadtest-") as tmp:
        objects = Path(tmp) / "objects"
        objects.mkdir()
        log_path = Path(tmp) / "server.log"
        command = [sys.executable, "-m", "server", "--objects", str(objects), "--host", "127.0.0.1", "--port", str(port),
                   "--device", args.device, "--hypotheses", str(args.hypotheses),
                   "--register-iterations", str(args.register_iterations),
                   "--track-iterations", str(args.track_iterations),
                   "--max-image", f"{args.image_hw[1]}x{args.image_hw[0]}", "--log-level", "WARNING"]
        if args.weights:
            command += ["--weights", args.weights]
        if ingest_port is not None:
            command += ["--ingest-workers", str(ingest_workers), "--ingest-port", str(ingest_port)]
        if args.device == "cpu":  # nothing is compiled or captured on a CPU: the warm-up's requests only cost cores
            settings = Path(tmp) / "settings.toml"
            settings.write_text("warmup = false\n", encoding="utf-8")
            command += ["--config", str(settings)]
        command += list(extra_args)
        env = {**os.environ, "FP_API_KEY": api_key}
        server_info = {"command": " ".join(command[1:]), "port": port}
        if ingest_port is not None:
            server_info.update(ingest_workers=ingest_workers, ingest_port=ingest_port,
                               track_url=f"http://127.0.0.1:{ingest_port}")
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
            server_info["pid"] = proc.pid
            try:
                url = f"http://127.0.0.1:{port}"
                started = time.monotonic()
                _wait_ready(url, api_key, proc, args.ready_timeout_s, log_path)
                if ingest_port is not None:  # the ingest workers may come up after the GPU process
                    _wait_ready(server_info["track_url"], api_key, proc, args.ready_timeout_s, log_path, "/healthz")
                server_info["startup_s"] = round(time.monotonic() - started, 1)
                yield url, server_info
            finally:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)  # uvicorn: graceful shutdown
                    try:
                        proc.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
                server_info["exit_code"] = proc.returncode


def _wait_ready(url: str, api_key: str, proc: subprocess.Popen, timeout_s: float, log_path: Path,
                path: str = "/readyz") -> None:
    """Poll ``url + path`` until it answers 200; RuntimeError if ``proc`` exits first, TimeoutError."""
    deadline = time.monotonic() + timeout_s
    headers = {"Authorization": f"Bearer {api_key}"}
    with httpx.Client(base_url=url, headers=headers, timeout=2.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode} during start-up:\n"
                                   + log_path.read_text(errors="replace")[-4000:])
            with contextlib.suppress(httpx.HTTPError):
                if client.get(path).status_code == 200:
                    return
            time.sleep(0.2)  # polling another process's readiness: nothing to wait on but time
    raise TimeoutError(f"{url}{path} did not answer 200 within {timeout_s} s:\n" + log_path.read_text(errors="replace")[-4000:])
