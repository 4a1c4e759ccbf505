"""A real overload: one register slot, a scorer gated by the test, and a second register that gets 503.

The gate also holds the start-up warm-up, which shows the not-ready answers. No sleeps: the test waits
for the gate's ``entered`` event (bounded) and opens it itself.
"""

from __future__ import annotations

import json
import math
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from fastapi.testclient import TestClient

from server import create_app
from tests.server._helpers import (
    READY_TIMEOUT_S,
    assert_error,
    assert_rigid,
    gated_estimator,
    tiny_config,
    write_objects_dir,
)


@pytest.mark.slow
def test_full_register_lane_answers_503_with_retry_after_and_track_still_flows(tiny_estimator, tmp_path, enc):
    gated, gate = gated_estimator(tiny_estimator, "scorer")  # the scorer runs in register only
    config = tiny_config(write_objects_dir(tmp_path / "objects"), frames_in_flight=1, submit_timeout_s=0.05,
                         retry_after_s=2)
    app = create_app(config, estimator=gated)
    with TestClient(app) as client, ThreadPoolExecutor(max_workers=2) as pool:
        try:
            # start-up: the warm-up register is parked in the scorer -> not ready yet
            assert gate.entered.wait(READY_TIMEOUT_S)
            assert client.get("/healthz").json() == {"status": "ok", "phase": "starting"}
            assert client.get("/readyz").status_code == 503
            not_ready = client.post("/register", data={"object_id": "block", "K": enc.K_json},
                                    files=enc.register_files())
            assert_error(not_ready, 503, "NotReadyError", match=r"^the server is not ready: still loading")
            assert not_ready.headers["retry-after"] == "2"
            gate.opened.set()
            assert app.state.fp.wait_ready(READY_TIMEOUT_S), app.state.fp.failure

            # overload: request A holds the only register slot inside the scorer
            gate.rearm()
            first = pool.submit(client.post, "/register", data={"object_id": "block", "K": enc.K_json},
                                files=enc.register_files())
            assert gate.entered.wait(READY_TIMEOUT_S)
            busy = client.post("/register", data={"object_id": "block", "K": enc.K_json}, files=enc.register_files())
            # the start-up's request-path warm-up measured the register's service time: the hint is that estimate
            message = assert_error(busy, 503, "OverloadedError",
                                   match=r"^the register pipeline is full; retry in about \d+ ms")["message"]
            hint_ms = int(re.search(r"(\d+) ms", message)[1])
            header_ms = int(busy.headers["retry-after-ms"])  # rounded up; the message rounds to nearest
            assert hint_ms >= 1 and hint_ms <= header_ms <= hint_ms + 1
            assert busy.headers["retry-after"] == str(max(1, math.ceil(header_ms / 1000)))

            # the track lane is separate: a track is answered while the register lane is full
            start = np.eye(4)
            start[2, 3] = 0.45
            tracked = client.post("/track", data={"object_id": "block", "pose": json.dumps(start.tolist()),
                                                  "K": enc.K_json}, files=enc.track_files())
            assert tracked.status_code == 200, tracked.text
            assert app.state.fp.service.stats().register_pool.leased == 1
        finally:
            gate.opened.set()
        response = first.result(timeout=READY_TIMEOUT_S)
        assert response.status_code == 200, response.text
        assert_rigid(response.json()["pose"])
        assert app.state.fp.metrics.request_count("/register", 503) == 2
        assert app.state.fp.service.stats().register_pool.leased == 0


@pytest.mark.slow  # waits out an 8 s request timeout
def test_a_register_the_client_gave_up_on_is_dropped_at_the_next_stage_boundary(tiny_estimator, tmp_path, enc):
    """request_timeout_s is also the service deadline: the 504'd register parked in the scorer never reaches
    ``select``, and its slot goes to the next register (frames_in_flight=1)."""
    gated, gate = gated_estimator(tiny_estimator, "scorer")
    # 8 s: long enough for the register to reach the gated scorer on a loaded CI machine before the 504
    config = tiny_config(write_objects_dir(tmp_path / "objects"), frames_in_flight=1, request_timeout_s=8.0,
                         submit_timeout_s=READY_TIMEOUT_S, warmup=False)
    app = create_app(config, estimator=gated)
    with TestClient(app) as client:
        try:
            assert app.state.fp.wait_ready(READY_TIMEOUT_S), app.state.fp.failure
            assert not gate.entered.is_set()  # no warm-up: the next register is the first to reach the scorer
            before = app.state.fp.service.stats().register
            given_up = client.post("/register", data={"object_id": "block", "K": enc.K_json},
                                   files=enc.register_files())
            assert_error(given_up, 504, "RequestTimeoutError", match=r"^no pose within 8 s")
            assert gate.entered.is_set()  # it was parked in the scorer when the server gave up
        finally:
            gate.opened.set()
        answered = client.post("/register", data={"object_id": "block", "K": enc.K_json}, files=enc.register_files())
        assert answered.status_code == 200, answered.text  # it got the slot the dropped one returned
        after = app.state.fp.service.stats().register
        assert after.stage("refine_score").count == before.stage("refine_score").count + 2
        assert after.stage("select").count == before.stage("select").count + 1  # the dropped one never selected
        assert after.in_flight == 0 and app.state.fp.service.stats().register_pool.leased == 0
