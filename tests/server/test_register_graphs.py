"""The server's registers run the register step (on CPU the register runner runs it eagerly on its buffers): a
register answers with the lane's stages and the estimator's pose, and ``/metrics`` counts the register captures by
outcome."""

from __future__ import annotations

import re

import numpy as np
import pytest
from fastapi.testclient import TestClient

from foundationpose.estimator import PoseEstimator
from server import create_app
from tests.server._helpers import READY_TIMEOUT_S, register, tiny_config, write_objects_dir


def _metric(client: TestClient, name: str, labels: str) -> float:
    match = re.search(rf"^{name}{re.escape(labels)} (\S+)$", client.get("/metrics").text, re.MULTILINE)
    assert match, f"{name}{labels} missing from /metrics"
    return float(match.group(1))


def _register_with(estimator: PoseEstimator, enc, objects) -> tuple[dict, TestClient]:
    app = create_app(tiny_config(objects, warmup=False), estimator=estimator)
    client = TestClient(app)
    client.__enter__()
    assert app.state.fp.wait_ready(READY_TIMEOUT_S), app.state.fp.failure
    return register(client, enc), client


@pytest.mark.slow
def test_register_lane_answers_with_its_stages_and_counts_captures(tiny_estimator, enc, tmp_path) -> None:
    objects = write_objects_dir(tmp_path / "objects")
    got, client = _register_with(tiny_estimator, enc, objects)
    try:
        assert {"upload", "hypotheses", "refine_score", "total"} <= set(got["timings_ms"])
        # CPU: nothing is captured, nothing failed
        assert _metric(client, "fp_register_graph_captures_total", '{outcome="captured"}') == 0
        assert _metric(client, "fp_register_graph_captures_total", '{outcome="failed"}') == 0
        assert _metric(client, "fp_track_driver_launches_total", "") == 0  # no CUDA driver here: PyTorch launches
        assert np.isfinite(np.asarray(got["pose"])).all() and got["score"] is not None
    finally:
        client.__exit__(None, None, None)
