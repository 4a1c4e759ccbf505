"""A lone /track into an idle graphed track lane runs in its worker thread: the answer's phases book that run as
``pipeline`` (no ``submit`` lap), /metrics counts it, the pose equals the batched path's."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
from fastapi.testclient import TestClient

from foundationpose.estimator import PoseEstimator
from server import create_app
from server.flow.frames import FrameBytes
from server.flow.inputs import parse_K
from server.flow.validation import track_request
from server.phases import Phases
from tests.server._helpers import READY_TIMEOUT_S, register, tiny_config, write_objects_dir


def _inline_total(client: TestClient) -> float:
    text = client.get("/metrics").text
    match = re.search(r"^fp_track_inline_total (\S+)$", text, re.MULTILINE)
    assert match, "fp_track_inline_total missing from /metrics"
    return float(match.group(1))


def test_lone_track_runs_inline_with_its_phases(tiny_estimator, enc, tmp_path) -> None:
    graphed = PoseEstimator(tiny_estimator.networks, tiny_estimator.renderer, device="cpu",
                            config=dataclasses.replace(tiny_estimator.config, track_graphs=True))
    app = create_app(tiny_config(write_objects_dir(tmp_path / "objects")), estimator=graphed)
    with TestClient(app) as client:
        assert app.state.fp.wait_ready(READY_TIMEOUT_S), app.state.fp.failure
        before = _inline_total(client)  # the warm-up's track is queued (submit_track), not inline
        sid = register(client, enc)["session_id"]
        stateless_pose = register(client, enc)["pose"]
        response = client.post("/track", data={"session_id": sid}, files=enc.track_files())
        assert response.status_code == 200, response.text
        timings = response.json()["timings_ms"]
        assert timings["pipeline"] > 0.0 and "submit" not in timings and timings["batcher_wait"] == 0.0
        assert _inline_total(client) == before + 1
        # the same step through the batcher gives the same pose
        state = app.state.fp
        request = track_request(FrameBytes(enc.rgb, enc.depth_png), parse_K(enc.K_json), np.array(stateless_pose),
                                "mesh", session_K=None, session_hw=None, max_hw=state.config.max_image_hw,
                                limits=state.service.limits, phases=Phases())
        queued = state.service.submit(state.objects.get("block").model, request, inline_if_idle=False).result(60)
        np.testing.assert_array_equal(np.asarray(queued.cam_from_mesh, np.float64), np.array(response.json()["pose"]))
