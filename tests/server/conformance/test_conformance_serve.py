"""The conformance cases through the Ray Serve ingress (multipart HTTP, ``/track/binary``, ``WS /track/stream``): the
outcomes and statuses the single-process server gives, and its poses (a local Ray with one CPU pose replica)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray", reason="ray[serve] is not installed (pip install -e '.[serve]')")
serve = pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install -e '.[serve]')")

from server.serve.settings import ServeSettings  # noqa: E402
from tests.server._helpers import serve_app, tiny_config, write_objects_dir  # noqa: E402
from tests.server.conformance.cases import CASES  # noqa: E402
from tests.server.conformance.conftest import socket_stream  # noqa: E402
from tests.server.conformance.harness import API_KEY, KEY, check_alike, make_context, run_case  # noqa: E402
from tests.server.conformance.transports import BinaryHttp, FormHttp, Transport  # noqa: E402

pytestmark = pytest.mark.slow  # a Ray instance and a replica's start: tens of seconds
ROOT = Path(__file__).resolve().parents[3]
APP = "fp_conformance"


@pytest.fixture(scope="module")
def served(ray_serve, tmp_path_factory) -> Iterator[list[Transport]]:
    objects_dir = write_objects_dir(tmp_path_factory.mktemp("serve_conformance_objects"))
    settings = ServeSettings(
        server=tiny_config(objects_dir, device="cpu", renderer="cpu", api_key=API_KEY, request_timeout_s=120.0,
                           max_upload_bytes=4 * 1024 * 1024, warmup=False),  # as the `local` server: no warm-up
        replicas=1, num_cpus=0.5, ingress_num_cpus=0.0, metrics_interval_s=0.5, app_name=APP)
    with serve_app(ray_serve, settings) as url, httpx.Client(base_url=url, timeout=120.0) as http:
        ws_url = url.replace("http://", "ws://") + "/track/stream"
        yield [
            Transport("serve-form", "form", "serve", lambda headers=KEY: _http(FormHttp, http, headers), http=http),
            Transport("serve-binary", "binary", "serve", lambda headers=KEY: _http(BinaryHttp, http, headers),
                      http=http),
            Transport("serve-stream", "stream", "serve", lambda headers=KEY: socket_stream(ws_url, headers),
                      http=http),
        ]


@contextmanager
def _http(cls, client, headers):
    yield cls(client, client, headers)


@pytest.fixture(scope="module")
def serve_ctx(served, frame):
    return make_context(served, frame, "cs")


@pytest.mark.parametrize("name", list(CASES))
def test_the_serve_ingress_answers_as_the_single_process_server(name, served, serve_ctx, local, ctx, frame):
    answers = run_case(name, served, frame, serve_ctx)
    check_alike(name, answers, served)
    if any("poses" in a.body for a in answers.values()):  # the same poses as the single-process server
        local_answers = run_case(name, local["transports"][:1], frame, ctx)
        check_alike(name, {**answers, **local_answers}, [*served, *local["transports"]])


def test_the_ingress_refuses_a_missing_key_and_a_json_body(served, frame):
    for t in served:
        if t.kind == "stream":
            continue
        with t.open({}) as conv:
            answer = conv.track({"session_id": "nosuchsession"}, frame.track_parts())
        assert (answer.status, answer.outcome) == (401, ("AuthError", None)), t.name
    http = served[0].http
    for path in ("/track", "/track/binary"):
        response = http.post(path, json={"object_id": "block"}, headers=KEY)
        assert response.status_code == 415 and response.json()["error"]["field"] == "Content-Type", response.text
