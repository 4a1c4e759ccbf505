"""``python -m server`` with ingest workers and no port of their own: the workers take the server's port.

Every connection of the port reaches a worker (the GPU process binds nothing else): ``POST /track/binary`` and
``WS /track/stream`` are served by the worker (the GPU process's hub counts each it hands over), every other route is
relayed to the GPU process's app, which answers it as if it had received it; every answer names the worker that
received it (``X-Ingest-Worker``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from websockets.sync.client import connect

from server.client import BINARY_HEADERS, STREAM_CONNECT_OPTIONS, frame_message, register_message, track_body
from server.ingest.protocol import WORKER_HEADER
from tests.server._helpers import ROOT, SETUP_WAIT_S, wait_for, write_objects_dir
from tools.ports import free_port

pytestmark = pytest.mark.slow  # a python -m server of its own: networks on the CPU, two worker processes

ANSWER_TIMEOUT_S = 300.0  # the safety net of each answer (a CPU register on a loaded 2-core machine)


def _parent_of(pid: int) -> int:
    """The parent process id of ``pid`` (Linux: /proc/<pid>/stat, after the command's closing parenthesis)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[1])


def _ready(url: str, workers: int) -> bool:
    """Ready, with ``workers`` workers connected to the GPU process (a worker answers what reaches it before)."""
    try:
        answer = httpx.get(f"{url}/readyz", timeout=5.0)
    except httpx.HTTPError:
        return False
    return answer.status_code == 200 and (answer.json().get("ingest") or {}).get("connected") == workers


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[tuple[str, subprocess.Popen]]:
    """``python -m server`` on the CPU with two ingest workers and nothing else about its ports."""
    objects = write_objects_dir(tmp_path_factory.mktemp("one_port_objects"))
    # no request-path warm-up (test_ready_warm's subject): the app's and both workers' paths cost seconds of CPU
    settings = tmp_path_factory.mktemp("one_port_settings") / "settings.toml"
    settings.write_text("warmup = false\n", encoding="utf-8")
    port = free_port()
    cmd = [sys.executable, "-m", "server", "--objects", str(objects), "--device", "cpu", "--port", str(port),
           "--ingest-workers", "2", "--max-image", "160x120", "--hypotheses", "4", "--register-iterations", "1",
           "--track-iterations", "1", "--log-level", "WARNING", "--config", str(settings)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    log_path = tmp_path_factory.mktemp("one_port_log") / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: proc.poll() is not None or _ready(url, 2), "the server ready, both workers connected", SETUP_WAIT_S)
        assert proc.poll() is None, log_path.read_text()[-3000:]
        yield url, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log_path.read_text()[-3000:]


def _sample(text: str, sample: str) -> float:
    """The value of the exposition line starting with ``sample`` (name and labels), 0 when there is none."""
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"{sample} ")), 0.0)


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=ANSWER_TIMEOUT_S).text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(f"{name} ")))


def test_tracks_on_the_servers_port_are_served_by_its_workers_and_the_rest_by_its_app(server, enc):
    url, proc = server
    frame = enc.frame
    with httpx.Client(base_url=url, timeout=ANSWER_TIMEOUT_S) as client:
        ready = client.get("/readyz")
        assert _parent_of(int(ready.headers[WORKER_HEADER])) == proc.pid  # received by one of the server's workers
        ingest = ready.json()["ingest"]
        assert (ingest["port"], ingest["workers"], ingest["connected"]) == (int(url.rsplit(":", 1)[1]), 2, 2)
        warm = client.get("/metrics").text  # the counts before this test's requests
        registered = client.post("/register/binary", headers=BINARY_HEADERS, content=register_message(
            "block", frame.K, frame.rgb, frame.depth_m, frame.mask))
        assert registered.status_code == 200, registered.text
        session_id = registered.json()["session_id"]
        handed_over = _metric(url, "fp_ingest_requests_total")  # the hub's: a register is relayed, not handed over
        tracked = client.post("/track/binary", headers=BINARY_HEADERS,
                              content=track_body(frame.rgb, frame.depth_m, session_id=session_id))
        assert tracked.status_code == 200, tracked.text
        assert tracked.json()["session_id"] == session_id and tracked.json()["frame"] == 1
        assert _metric(url, "fp_ingest_requests_total") == handed_over + 1  # the worker parsed and handed it over
        assert _parent_of(int(tracked.headers[WORKER_HEADER])) == proc.pid
        assert client.get(f"/sessions/{session_id}").json()["frames"] == 1  # the app saw the worker's track
        unknown = client.get("/no/such/route")
        assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "HTTPError"
        metrics = client.get("/metrics").text
        for endpoint in ("/register/binary", "/track/binary"):
            sample = f'fp_http_requests_total{{endpoint="{endpoint}",method="POST",status="200"}}'
            assert _sample(metrics, sample) == _sample(warm, sample) + 1, endpoint


def test_a_stream_on_the_servers_port_is_served_by_a_worker(server, enc):
    url, _ = server
    frame = enc.frame
    relayed = _metric(url, "fp_ingest_requests_total")
    with connect(url.replace("http://", "ws://") + "/track/stream", open_timeout=ANSWER_TIMEOUT_S,
                 **STREAM_CONNECT_OPTIONS) as ws:
        ws.send(register_message("block", frame.K, frame.rgb, frame.depth_m, frame.mask))
        assert json.loads(ws.recv(ANSWER_TIMEOUT_S))["type"] == "registered"
        ws.send(frame_message(1, frame.rgb, frame.depth_m))
        assert json.loads(ws.recv(ANSWER_TIMEOUT_S))["type"] == "pose"
        assert _metric(url, "fp_streams_open") == 0  # the GPU process runs no stream of its own ...
    assert _metric(url, "fp_ingest_requests_total") == relayed + 2  # ... a worker relayed both messages to it
