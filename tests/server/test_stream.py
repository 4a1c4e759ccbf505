"""WS /track/stream: register + frames in order, bad frames answered and survived, newest frame wins,
auth on the upgrade, the session ends with the connection. Waits on states (gates, counters), never on time."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from fastapi.testclient import TestClient
from starlette.testclient import WebSocketDenialResponse
from starlette.websockets import WebSocketDisconnect

from server import create_app
from server.client import depth_mm, frame_message, register_message
from server.frames_raw import pack_message
from tests.server._helpers import (
    READY_TIMEOUT_S,
    assert_rigid,
    gated_estimator,
    tiny_config,
    write_objects_dir,
)


def _register(ws, enc, object_id: str = "block") -> dict:
    f = enc.frame
    ws.send_bytes(register_message(object_id, f.K, f.rgb, f.depth_m, f.mask))
    reply = ws.receive_json()
    assert reply["type"] == "registered", reply
    return reply


def _short_depth_message(f, frame: int) -> bytes:
    """A frame whose depth part declares (H, W) uint16 but carries one row less."""
    depth = depth_mm(f.depth_m)[:-1].tobytes()
    rgb = f.rgb.tobytes()
    header = json.dumps({"type": "frame", "frame": frame, "parts": [
        {"name": "rgb", "nbytes": len(rgb), "shape": list(f.rgb.shape), "dtype": "uint8"},
        {"name": "depth", "nbytes": len(depth), "shape": list(f.depth_m.shape), "dtype": "uint16"}]}).encode()
    return struct.pack("<I", len(header)) + header + rgb + depth


def test_register_then_frames_answered_in_order_and_the_session_ends_with_the_connection(client, enc):
    store = client.app.state.fp.sessions
    with client.websocket_connect("/track/stream") as ws:
        reg = _register(ws, enc)
        sid = reg["session_id"]
        assert_rigid(reg["pose"])
        assert sid in store and client.get(f"/sessions/{sid}").json()["frames"] == 0
        for n in (1, 2, 3):
            ws.send_bytes(frame_message(n, enc.frame.rgb, enc.frame.depth_m))
            reply = ws.receive_json()
            assert (reply["type"], reply["frame"], reply["frames"], reply["skipped"]) == ("pose", n, n, [])
            assert_rigid(reply["pose"])
            phases = reply["timings_ms"]
            assert {"decode", "validate", "queue", "submit", "pipeline", "resume", "batcher_wait"} <= set(phases)
            assert {"render_0", "refine_0", "total", "batch"} <= set(phases)  # the lane's stages stay
            assert all(v >= 0 for v in phases.values())
        assert client.get(f"/sessions/{sid}").json()["pose"] == reply["pose"]
    counters = client.app.state.fp.streams
    assert counters.wait_until(lambda c: c.open == 0, 5), (counters.open, counters.received)
    assert sid not in store
    assert 'fp_request_phase_seconds_count{endpoint="/track/stream",phase="decode"}' in client.get("/metrics").text


def test_a_bad_frame_is_answered_with_its_field_and_the_session_goes_on(client, enc):
    f = enc.frame
    with client.websocket_connect("/track/stream") as ws:
        ws.send_bytes(frame_message(1, f.rgb, f.depth_m))  # no register yet
        assert ws.receive_json()["error"]["field"] == "type"
        _register(ws, enc)
        ws.send_bytes(_short_depth_message(f, frame=2))
        err = ws.receive_json()
        assert err["type"] == "error" and err["frame"] == 2 and err["error"]["field"] == "depth"
        assert err["error"]["message"].startswith("depth: expected 24576 bytes of raw uint16 (96, 128); got 24320")
        ws.send_bytes(b"\x00\x01")
        assert ws.receive_json()["error"]["field"] == "message"
        ws.send_text("hello")
        assert ws.receive_json()["error"]["field"] == "message"
        ws.send_bytes(pack_message({"type": "frame", "frame": 3, "K": [[1, 0], [0, 1]]},
                                   {"rgb": f.rgb, "depth": depth_mm(f.depth_m)}))
        assert ws.receive_json()["error"]["field"] == "K"
        ws.send_bytes(frame_message(4, f.rgb, f.depth_m))
        reply = ws.receive_json()
        assert reply["type"] == "pose" and reply["frame"] == 4 and reply["frames"] == 1  # failures changed nothing


def test_png_parts_are_accepted_too(client, enc):
    f = enc.frame
    with client.websocket_connect("/track/stream") as ws:
        ws.send_bytes(pack_message({"type": "register", "object_id": "block", "K": f.K.tolist()},
                                   {"rgb": enc.rgb, "depth": enc.depth_png, "mask": enc.mask}))
        assert ws.receive_json()["type"] == "registered"
        ws.send_bytes(pack_message({"type": "frame", "frame": 1}, {"rgb": enc.rgb, "depth": enc.depth_png}))
        assert ws.receive_json()["type"] == "pose"


@pytest.fixture
def gated(tiny_estimator, tmp_path):
    estimator, gate = gated_estimator(tiny_estimator, "track_refiner")
    gate.opened.set()  # the warm-up track passes
    app = create_app(tiny_config(write_objects_dir(tmp_path / "objects"), api_key="s3cret"), estimator=estimator)
    with TestClient(app) as client:
        assert app.state.fp.wait_ready(READY_TIMEOUT_S), app.state.fp.failure
        try:
            yield client, gate
        finally:
            gate.opened.set()


def test_newest_frame_wins_when_frames_arrive_faster_than_answers(gated, enc):
    client, gate = gated
    counters = client.app.state.fp.streams
    f = enc.frame
    with client.websocket_connect("/track/stream", headers={"Authorization": "Bearer s3cret"}) as ws:
        _register(ws, enc)
        gate.opened.clear()
        gate.entered.clear()
        ws.send_bytes(frame_message(1, f.rgb, f.depth_m))
        assert gate.entered.wait(READY_TIMEOUT_S)  # frame 1 runs, parked in the refiner
        base = counters.received
        for n in (2, 3, 4):
            ws.send_bytes(frame_message(n, f.rgb, f.depth_m))
        assert counters.wait_until(lambda c: c.received == base + 3 and c.skipped >= 2, READY_TIMEOUT_S)
        gate.opened.set()
        first, second = ws.receive_json(), ws.receive_json()
        assert (first["frame"], first["skipped"]) == (1, [])
        assert (second["frame"], second["skipped"], second["frames"]) == (4, [2, 3], 2)
    assert 'fp_stream_frames_skipped_total 2' in client.get("/metrics", headers={"Authorization": "Bearer s3cret"}).text


def test_the_upgrade_needs_the_api_key(gated):
    client, _ = gated
    with pytest.raises(WebSocketDenialResponse) as denied:
        with client.websocket_connect("/track/stream"):
            pass
    assert denied.value.status_code == 401
    assert json.loads(denied.value.content)["error"]["message"].startswith("missing API key")
    with pytest.raises(WebSocketDenialResponse):
        with client.websocket_connect("/track/stream", headers={"Authorization": "Bearer wrong"}):
            pass


def test_idle_streams_are_closed(tiny_estimator, tmp_path, enc):
    app = create_app(tiny_config(write_objects_dir(tmp_path / "objects"), stream_idle_s=0.2, warmup=False),
                     estimator=tiny_estimator)
    with TestClient(app) as client:
        assert app.state.fp.wait_ready(READY_TIMEOUT_S)
        with client.websocket_connect("/track/stream") as ws:
            with pytest.raises(WebSocketDisconnect) as closed:
                ws.receive_json()  # nothing sent: the server closes after 0.2 s idle
            assert closed.value.code == 1001 and closed.value.reason.startswith("idle for 0.2 s")
        assert app.state.fp.streams.wait_until(lambda c: c.open == 0, READY_TIMEOUT_S)
    _ = np  # keep the import for readers of the assertions above
