"""``python -m tools.first_requests``: first request against steady latency per transport, against a live server
(CPU, tiny settings: the figures are real, their ratio is not judged here)."""

from __future__ import annotations

import pytest

from server import create_app
from tests.server._helpers import MAX_IMAGE_HW, live_uvicorn, tiny_config, write_objects_dir
from tools.first_requests import TRANSPORTS, build_parser, measure


@pytest.mark.slow
def test_the_report_has_every_transport_first_and_steady(tiny_estimator, tmp_path):
    app = create_app(tiny_config(write_objects_dir(tmp_path / "objects")), estimator=tiny_estimator)
    with live_uvicorn(app) as address:
        report = measure(f"http://{address}", image_hw=MAX_IMAGE_HW, requests=2, ready_timeout_s=60.0)
    assert report["object_id"] == "block" and report["image_wh"] == [MAX_IMAGE_HW[1], MAX_IMAGE_HW[0]]
    assert set(report["transports"]) == set(TRANSPORTS)
    for name, figures in report["transports"].items():
        assert figures["requests"] == 3, name
        assert figures["first_ms"] > 0 and figures["p50_ms"] > 0 and figures["p99_ms"] >= figures["p50_ms"]
        assert figures["within_2x"] == (figures["first_ms"] <= 2 * figures["p50_ms"])
    assert report["all_within_2x"] == all(t["within_2x"] for t in report["transports"].values())
    assert report["server_warmup_paths_ms"]["requests"] > 0


def test_the_command_line_defaults_to_the_local_server_at_640x480():
    args = build_parser().parse_args([])
    assert args.url == "http://127.0.0.1:8000" and args.image_hw == (480, 640) and args.requests == 50
