"""A lone /track into an idle graphed track lane runs in its worker thread (ServiceConfig.track_inline): the
answer's phases book that run as ``pipeline`` (no ``submit`` lap), /metrics counts it, the pose equals the
batched path's."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from server import create_app
from tests.server._helpers import READY_TIMEOUT_S, register, tiny_config, write_objects_dir


def _inline_total(client: TestClient) -> float:
    text = client.get("/metrics").text
    match = re.search(r"^fp_track_inline_total (\S+)$", text, re.MULTILINE)
    assert match, "fp_track_inline_total missing from /metrics"
    return float(match.group(1))


@pytest.mark.slow
def test_lone_track_runs_inline_with_its_phases(tiny_estimator, enc, tmp_path) -> None:
    graphed = tiny_estimator
    # no request-path warm-up (test_ready_warm's subject; ~7 s of CPU): the first track is this test's
    app = create_app(tiny_config(write_objects_dir(tmp_path / "objects"), warmup=False), estimator=graphed)
    with TestClient(app) as client:
        assert app.state.fp.wait_ready(READY_TIMEOUT_S), app.state.fp.failure
        before = _inline_total(client)
        sid = register(client, enc)["session_id"]
        register(client, enc)  # a second session beside it: still alone in the lane
        response = client.post("/track", data={"session_id": sid}, files=enc.track_files())
        assert response.status_code == 200, response.text
        timings = response.json()["timings_ms"]
        assert timings["pipeline"] > 0.0 and "submit" not in timings and timings["batcher_wait"] == 0.0
        assert _inline_total(client) == before + 1
