"""Health, readiness, metrics, authentication, the 500 path and the OpenAPI document."""

from __future__ import annotations

import json
import logging
import re

import numpy as np
import pytest
from fastapi.testclient import TestClient

from server import create_app
from tests.server._helpers import assert_error, tiny_config, write_objects_dir


def test_healthz_and_readyz_when_ready(client):
    assert client.get("/healthz").json() == {"status": "ok", "phase": "ready"}
    ready = client.get("/readyz")
    assert ready.status_code == 200
    body = ready.json()
    assert body["ready"] is True and body["device"] == "cpu" and body["random_weights"] is True
    assert body["objects"] >= 2


def test_metrics_exposition_has_the_expected_families(client, enc):
    start = np.eye(4)
    start[2, 3] = 0.45
    tracked = client.post("/track", data={"object_id": "block", "pose": json.dumps(start.tolist()), "K": enc.K_json},
                          files=enc.track_files())
    assert tracked.status_code == 200
    response = client.get("/metrics")
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    text = response.text
    for family, kind in [
        ("fp_http_requests_total", "counter"),
        ("fp_http_request_duration_seconds", "histogram"),
        ("fp_http_requests_in_flight", "gauge"),
        ("fp_pose_stage_duration_seconds", "histogram"),
        ("fp_pipeline_stage_seconds", "summary"),
        ("fp_pipeline_queue_depth", "gauge"),
        ("fp_pipeline_in_flight", "gauge"),
        ("fp_pool_leases_in_use", "gauge"),
        ("fp_track_batcher_waiting", "gauge"),
        ("fp_sessions_active", "gauge"),
        ("fp_objects_loaded", "gauge"),
        ("fp_ready", "gauge"),
    ]:
        assert f"# TYPE {family} {kind}\n" in text, family
    assert 'fp_http_requests_total{endpoint="/track",method="POST",status="200"}' in text
    assert 'fp_http_request_duration_seconds_bucket{endpoint="/track",method="POST",status="200",le="+Inf"}' in text
    assert 'fp_pose_stage_duration_seconds_count{endpoint="/track",stage="step"}' in text
    assert 'fp_pipeline_stage_seconds{lane="register",stage="refine_score",quantile="0.5"}' in text
    assert 'fp_pool_leases_in_use{lane="track"} 0' in text
    assert "fp_ready 1\n" in text
    for line in text.splitlines():  # every sample line is "name{labels} number"
        if not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])


def test_unexpected_errors_answer_500_with_a_request_id_and_no_details(client, monkeypatch, caplog):
    def explode():
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(client.app.state.fp.objects, "entries", explode)
    with caplog.at_level(logging.ERROR, logger="server.errors"):
        response = client.get("/objects", headers={"X-Request-ID": "req-123"})
    body = assert_error(response, 500, "InternalError")
    assert body["request_id"] == "req-123"
    assert "secret" not in response.text and "RuntimeError" not in response.text
    assert any("req-123" in r.getMessage() and r.exc_info for r in caplog.records)  # logged once, with traceback


def test_unknown_route_and_method_use_the_error_envelope(client):
    assert_error(client.get("/nope"), 404, "HTTPError")
    assert_error(client.put("/register"), 405, "HTTPError")


def test_openapi_documents_every_route(client):
    spec = client.get("/openapi.json").json()
    paths = spec["paths"]
    for path, method in [("/register", "post"), ("/track", "post"), ("/objects", "post"), ("/objects", "get"),
                         ("/objects/{object_id}", "delete"), ("/sessions/{session_id}", "delete"),
                         ("/healthz", "get"), ("/readyz", "get"), ("/metrics", "get")]:
        assert method in paths[path], (path, method)
    assert "curl" in paths["/register"]["post"]["description"]
    assert "422" in paths["/register"]["post"]["responses"] and "503" in paths["/track"]["post"]["responses"]
    binary = paths["/track/binary"]["post"]
    assert "application/octet-stream" in binary["requestBody"]["content"] and "track_body" in binary["description"]
    assert {"401", "413", "422", "503"} <= set(binary["responses"])


@pytest.fixture
def auth_client(tiny_estimator, tmp_path):
    app = create_app(tiny_config(write_objects_dir(tmp_path / "objects"), api_key="s3cret", warmup=False),
                     estimator=tiny_estimator)
    with TestClient(app) as c:
        assert app.state.fp.wait_ready(30), app.state.fp.failure
        yield c


def test_api_key_is_required_on_every_route_but_healthz(auth_client, enc):
    assert auth_client.get("/healthz").status_code == 200
    for method, path in [("get", "/readyz"), ("get", "/metrics"), ("get", "/objects"), ("post", "/register"),
                         ("post", "/track"), ("post", "/track/binary"), ("delete", "/sessions/x"), ("post", "/readyz/retry"), ("get", "/nope")]:
        response = getattr(auth_client, method)(path)
        assert_error(response, 401, "AuthError", match=r"^missing API key")
        assert response.headers["www-authenticate"] == "Bearer"
    for header in ("Bearer wrong", "Bearer s3cret2", "Basic czNjcmV0", "s3cret", "Bearer "):
        response = auth_client.get("/objects", headers={"Authorization": header})
        assert response.status_code == 401, header
    good = {"Authorization": "Bearer s3cret"}
    assert auth_client.get("/objects", headers=good).status_code == 200
    assert auth_client.get("/readyz", headers=good).status_code == 200
    # refused before the body is read: an oversize upload without a key is a 401, not a 413
    assert auth_client.post("/register", content=b"\0" * 64, headers={"Content-Length": str(1 << 40)}).status_code == 401
    metrics = auth_client.get("/metrics", headers=good).text  # refusals before routing keep their route label
    assert 'fp_http_requests_total{endpoint="/objects",method="GET",status="401"}' in metrics
    assert 'fp_http_requests_total{endpoint="unmatched",method="GET",status="401"} 1' in metrics  # /nope
    spec = auth_client.get("/openapi.json", headers=good).json()
    assert spec["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert spec["paths"]["/register"]["post"]["security"] == [{"bearer": []}]
    assert "security" not in spec["paths"]["/healthz"]["get"]


def test_docs_are_served_offline_and_reachable_in_a_browser_with_an_api_key(auth_client):
    page = auth_client.get("/docs")  # a browser sends no Authorization header
    assert page.status_code == 200 and "swagger-ui-bundle.js" in page.text
    assert "cdn." not in page.text and "unpkg" not in page.text  # no asset from the network
    asset_urls = re.findall(r"""(?:src|href)=['"]([^'"]+)['"]""", page.text)
    assert asset_urls and all(url.startswith("/docs-assets/") for url in asset_urls), asset_urls
    for url in asset_urls:
        assert auth_client.get(url).status_code == 200, url
    redoc = auth_client.get("/redoc")
    assert redoc.status_code == 200 and "/docs-assets/redoc.standalone.js" in redoc.text
    assert auth_client.get("/openapi.json").status_code == 200  # what the page reads
    # the page's API calls still need the key (Authorize button)
    assert_error(auth_client.get("/objects"), 401, "AuthError", match=r"^missing API key")


def test_docs_can_be_turned_off(tiny_estimator, tmp_path):
    app = create_app(tiny_config(write_objects_dir(tmp_path / "objects"), warmup=False, docs=False),
                     estimator=tiny_estimator)
    with TestClient(app) as c:
        for path in ("/docs", "/redoc", "/openapi.json", "/docs-assets/swagger-ui-bundle.js"):
            assert c.get(path).status_code == 404, path


def test_without_api_key_no_authorization_is_needed(client):
    assert client.get("/objects").status_code == 200
    assert client.get("/objects", headers={"Authorization": "Bearer anything"}).status_code == 200


def test_failed_start_up_is_reported_by_healthz_and_readyz(tiny_estimator, tmp_path):
    not_a_dir = tmp_path / "objects"
    not_a_dir.write_text("a file where the objects directory should be")
    app = create_app(tiny_config(not_a_dir, warmup=False), estimator=tiny_estimator)
    with TestClient(app) as c:
        assert app.state.fp.wait_ready(30) is False
        assert c.get("/healthz").status_code == 503
        ready = c.get("/readyz")
        assert ready.status_code == 503 and ready.headers["retry-after"] == "1"
        assert ready.json()["phase"] == "failed" and "FileExistsError" in ready.json()["reason"]
        response = c.get("/objects")
        assert_error(response, 503, "NotReadyError", match=r"^the server is not ready: start-up failed")
        assert response.headers["retry-after"] == "1"


def test_openapi_descriptions_cite_no_spec(client):
    text = client.get("/openapi.json").text  # users read it in /docs; they do not have the spec
    found = re.search(r"\bspec\b|\u00a7|§", text, re.IGNORECASE)
    assert found is None, text[max(0, found.start() - 200):found.start() + 50]
