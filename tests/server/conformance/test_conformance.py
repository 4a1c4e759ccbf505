"""Every way in answers alike: each case of :mod:`.cases` through every transport of its kinds (multipart HTTP,
``/track/binary``, ``WS /track/stream``, on the main port and on the ingest worker's port, where tracks and streams
are the worker's and the forms and registers are relayed to the app), with identical outcomes (error type and field), HTTP statuses and poses. A stream stays open after a
refused message (or closes when the case says so). The Ray Serve ingress runs the same cases in
:mod:`.test_conformance_serve`."""

from __future__ import annotations

import logging
import re
import socket
import time

import pytest
from starlette.testclient import WebSocketDenialResponse
from websockets.exceptions import InvalidStatus

from tests.server.conformance.cases import CASES, error_fields
from tests.server.conformance.harness import KEY, check_alike, run_case

WAIT_S = 300.0  # the safety net of a wait for a state (a worker's report: normally < 1 s; a loaded 2-core machine)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_every_transport_answers_alike(name, local, frame, ctx):
    check_alike(name, run_case(name, local["transports"], frame, ctx), local["transports"])


def test_the_suite_covers_every_transport(local):
    names = {t.name for t in local["transports"]}
    assert names == {"main-form", "main-binary", "main-stream", "ingest-form", "ingest-binary", "ingest-stream"}
    for kind in ("form", "binary", "stream"):
        assert any(kind in case.kinds for case in CASES.values())


@pytest.mark.parametrize("key", [None, "wrong"])
def test_every_transport_refuses_a_missing_or_a_wrong_key(local, frame, key):
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    for t in local["transports"]:
        if t.kind == "stream":
            with pytest.raises((WebSocketDenialResponse, InvalidStatus)) as info:
                with t.open(headers):
                    pass
            denied = info.value
            status = denied.status_code if isinstance(denied, WebSocketDenialResponse) else denied.response.status_code
            assert status == 401, t.name
            continue
        with t.open(headers) as conv:
            answer = conv.track({"session_id": "nosuchsession"}, frame.track_parts())
        assert (answer.status, answer.outcome) == (401, ("AuthError", None)), (t.name, error_fields(answer))


def test_a_body_of_the_wrong_kind_is_told_which_body_the_route_reads(local):
    """A JSON body sent to a form route (or to a binary one) answers 415 naming Content-Type, not a missing field."""
    main = local["served"].client
    clients = {"main": main, "ingest": local["served"].ingest}
    seen = {}
    for port, path in (("main", "/register"), ("main", "/track"), ("main", "/track/binary"),
                       ("main", "/register/binary"), ("ingest", "/track/binary")):
        response = clients[port].post(path, json={"object_id": "block", "K": [[1, 0, 0]]}, headers=KEY)
        error = response.json()["error"]
        seen[(port, path)] = (response.status_code, error["type"], error["field"])
        twin = "/binary" if "binary" not in path else ""
        assert ("multipart/form-data" if twin else "application/octet-stream") in error["message"], error
    assert set(seen.values()) == {(415, "UnsupportedMediaTypeError", "Content-Type")}, seen


def _http_count(text: str, family: str, endpoint: str, status: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(family + "{") and f'endpoint="{endpoint}"' in line and f'status="{status}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"not reached within {WAIT_S:.0f} s: {what}"
        time.sleep(0.02)


def _cut_upload(port: int, path: str, content_type: str) -> None:
    """Send a request's headers and part of its body, then close the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: {KEY['Authorization']}\r\n"
                f"Content-Type: {content_type}\r\nContent-Length: 100000\r\n\r\n")
        sock.sendall(head.encode() + b"x" * 1000)


def test_a_client_that_goes_away_mid_upload_is_no_server_error(local, caplog):
    """The main port (forms and binary bodies, in process) and the track port (a real socket): counted as 499 (the
    client closed the request), logged without a traceback, never a 500."""
    served = local["served"]
    main = served.client
    for path, content_type in (("/track/binary", "application/octet-stream"),
                               ("/track", "multipart/form-data; boundary=xyz")):
        with caplog.at_level(logging.DEBUG):
            _asgi_cut_upload(main, path, content_type)
        metrics = main.get("/metrics", headers=KEY).text
        assert _http_count(metrics, "fp_http_requests_total", path, "499") >= 1, path
        assert _http_count(metrics, "fp_http_requests_total", path, "500") == 0, path
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    port = served.state.ingest_workers.port
    _cut_upload(port, "/track/binary", "application/octet-stream")

    def counted() -> bool:
        text = main.get("/metrics", headers=KEY).text
        return _http_count(text, "fp_ingest_http_requests_total", "/track/binary", "499") >= 1

    _until(counted, "the worker's report of the request its client left")
    text = main.get("/metrics", headers=KEY).text
    assert _http_count(text, "fp_ingest_http_requests_total", "/track/binary", "500") == 0


def _asgi_cut_upload(client, path: str, content_type: str) -> None:
    """Call the app as a server would for a request whose client leaves after 1000 of 100000 bytes (a form: inside
    its first file part)."""
    start = b'--xyz\r\nContent-Disposition: form-data; name="rgb"; filename="rgb.png"\r\n\r\n' if "form" in content_type \
        else b""
    messages = iter([{"type": "http.request", "body": start + b"x" * 1000, "more_body": True},
                     {"type": "http.disconnect"}])
    sent: list[dict] = []
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"testserver"), (b"content-type", content_type.encode()),
                         (b"content-length", b"100000"), (b"authorization", KEY["Authorization"].encode())],
             "client": ("127.0.0.1", 5000), "server": ("testserver", 80), "state": {}}

    async def receive() -> dict:
        return next(messages, {"type": "http.disconnect"})

    async def send(message: dict) -> None:
        sent.append(message)

    client.portal.call(client.app, scope, receive, send)
    started = [m for m in sent if m["type"] == "http.response.start"]
    assert not started or started[0]["status"] != 500, started


def test_the_access_log_has_one_line_per_request_with_its_id_and_status(local, caplog):
    """One INFO line per request (4xx included), naming the request id the client got and the error's field."""
    main = local["served"].client
    with caplog.at_level(logging.INFO, logger="server.access"):
        response = main.post("/track/binary", content=b"\0\0", headers={**KEY, "Content-Type": "application/octet-stream"})
    assert response.status_code == 422
    request_id = response.headers["x-request-id"]
    lines = [r.getMessage() for r in caplog.records if r.name == "server.access" and request_id in r.getMessage()]
    assert len(lines) == 1, lines
    assert re.search(r"status=422 .*error=InputError field=message$", lines[0]), lines[0]


def test_an_answered_frame_is_logged_at_debug_and_a_register_at_info(local, frame, caplog):
    """Tracks answered on either port leave a DEBUG access line (a camera's every frame); the register before them,
    and a refused track, an INFO line."""
    for t in local["transports"]:
        if t.kind != "binary":
            continue
        with caplog.at_level(logging.DEBUG, logger="server.access"), t.open() as conv:
            caplog.clear()
            registered = conv.register(frame.header(), frame.register_parts())
            tracked = conv.track({}, frame.track_parts())
            refused = conv.track({"session_id": "nosuchsession"}, frame.track_parts())
        assert (registered.status, tracked.status, refused.status) == (200, 200, 404), t.name
        levels = {}
        for record in caplog.records:
            if record.name == "server.access":
                endpoint, status = re.search(r"endpoint=(\S+) status=(\d+)", record.getMessage()).groups()
                levels.setdefault((endpoint, status), set()).add(record.levelname)
        assert levels.get(("/register/binary", "200")) == {"INFO"}, (t.name, levels)
        assert levels.get(("/track/binary", "200")) == {"DEBUG"}, (t.name, levels)
        assert levels.get(("/track/binary", "404")) == {"INFO"}, (t.name, levels)
