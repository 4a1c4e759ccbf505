"""WS /track/stream: register (or start from a given pose) + frames in order, bad frames answered and
survived, newest frame wins, auth on the upgrade, the session ends with the connection. Waits on states (gates, counters), never on time."""

from __future__ import annotations

import json
import re
import struct

import numpy as np
import pytest
from fastapi.testclient import TestClient
from starlette.testclient import WebSocketDenialResponse
from starlette.websockets import WebSocketDisconnect

from server import create_app
from server.client import depth_mm, frame_message, register_message, start_message
from server.flow.message import pack_message
from tests.server._helpers import (
    FRAME_HW,
    READY_TIMEOUT_S,
    assert_rigid,
    gated_estimator,
    register,
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


@pytest.mark.slow
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
            assert {"decode", "validate", "queue", "pipeline", "resume", "batcher_wait"} <= set(phases)
            assert {"step", "total", "batch"} <= set(phases)  # the lane's stages stay
            assert all(v >= 0 for v in phases.values())
        assert client.get(f"/sessions/{sid}").json()["pose"] == reply["pose"]
    counters = client.app.state.fp.streams
    assert counters.wait_until(lambda c: c.open == 0, 5), (counters.open, counters.received)
    assert sid not in store
    assert 'fp_request_phase_seconds_count{endpoint="/track/stream",phase="decode"}' in client.get("/metrics").text


@pytest.mark.slow
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


@pytest.mark.slow
def test_png_parts_are_accepted_too(client, enc):
    f = enc.frame
    with client.websocket_connect("/track/stream") as ws:
        ws.send_bytes(pack_message({"type": "register", "object_id": "block", "K": f.K.tolist()},
                                   {"rgb": enc.rgb, "depth": enc.depth_png, "mask": enc.mask}))
        assert ws.receive_json()["type"] == "registered"
        ws.send_bytes(pack_message({"type": "frame", "frame": 1}, {"rgb": enc.rgb, "depth": enc.depth_png}))
        assert ws.receive_json()["type"] == "pose"


@pytest.mark.slow
def test_a_start_message_opens_a_session_from_a_given_pose_without_a_register(client, enc):
    """The streaming twin of a stateless POST /track: its first frame's pose is the stateless track's."""
    f, state = enc.frame, client.app.state.fp
    pose = register(client, enc)["pose"]
    registers = state.metrics.request_count("/register", 200)
    with client.websocket_connect("/track/stream") as ws:
        ws.send_bytes(start_message("block", f.K, pose))
        started = ws.receive_json()
        assert (started["type"], started["object_id"], started["pose"], started["score"], started["skipped"]) == \
            ("started", "block", pose, None, [])
        assert "validate" in started["timings_ms"]
        sid = started["session_id"]
        info = client.get(f"/sessions/{sid}").json()
        assert (info["frames"], info["pose"], info["score"]) == (0, pose, None)
        assert state.sessions.peek(sid).image_hw is None  # no frame yet: K belongs to the first frame's size
        ws.send_bytes(frame_message(1, f.rgb, f.depth_m))
        first = ws.receive_json()
        assert (first["type"], first["frame"], first["frames"]) == ("pose", 1, 1), first
        assert state.sessions.peek(sid).image_hw == FRAME_HW
        stateless = client.post("/track", data={"object_id": "block", "pose": json.dumps(pose), "K": enc.K_json},
                                files=enc.track_files())
        assert stateless.status_code == 200, stateless.text
        # the same start state (the pose in the centred frame, float32) and the same frame: the same step
        assert first["pose"] == stateless.json()["pose"]
        ws.send_bytes(frame_message(2, f.rgb, f.depth_m))
        assert ws.receive_json()["frames"] == 2
    assert state.metrics.request_count("/register", 200) == registers  # no register ran for the stream
    assert state.streams.wait_until(lambda c: c.open == 0, READY_TIMEOUT_S)
    assert state.sessions.peek(sid) is None  # the session ended with the connection


@pytest.mark.slow
def test_a_bad_start_is_answered_naming_the_field_and_the_connection_goes_on(client, enc):
    f = enc.frame
    far = np.eye(4)
    far[2, 3] = 1e4  # millimetres for metres: outside the working range
    skewed = np.eye(4)
    skewed[0, 1] = 0.5
    start = {"type": "start", "object_id": "block", "K": f.K.tolist(), "pose": np.eye(4).tolist()}
    with client.websocket_connect("/track/stream") as ws:
        for header, parts, field, message in [
            ({**start, "pose": far.tolist()}, {}, "pose", r"pose: expected a translation within the working range"),
            ({**start, "pose": skewed.tolist()}, {}, "pose", r"pose: expected a rotation in the top-left 3x3"),
            ({**start, "pose": [[1, 0, 0], [0, 1, 0]]}, {}, "pose", r"pose: expected "),
            ({k: v for k, v in start.items() if k != "pose"}, {}, "pose", r"pose: .*got nothing"),
            ({**start, "K": f.K.ravel().tolist()}, {}, "K", r"K: expected "),
            ({**start, "K": (f.K * [[1], [1], [0]]).tolist()}, {}, "K", r"K: expected last rows"),
            ({**start, "object_id": 7}, {}, "object_id", r"object_id: expected the id of a loaded object"),
            (start, {"rgb": f.rgb}, "parts", r"parts: expected no parts in a start message"),
        ]:
            ws.send_bytes(pack_message(header, parts))
            err = ws.receive_json()
            assert (err["type"], err["error"]["type"], err["error"]["field"]) == ("error", "InputError", field), err
            assert re.match(message, err["error"]["message"]), err["error"]["message"]
        ws.send_bytes(pack_message({**start, "object_id": "no_such_object"}, {}))
        assert ws.receive_json()["error"]["type"] == "UnknownObjectError"
        ws.send_bytes(frame_message(1, f.rgb, f.depth_m))  # nothing was started by the failures
        assert ws.receive_json()["error"]["message"].startswith("type: expected a register or start message")
        ws.send_bytes(start_message("block", f.K, np.eye(4)))
        started = ws.receive_json()
        assert (started["type"], started["state"]) == ("started", "tracking")  # a client's pose is trusted
        ws.send_bytes(start_message("block", f.K, np.eye(4)))
        assert ws.receive_json()["error"]["message"].startswith("type: expected one register or start per connection")
        ws.send_bytes(register_message("block", f.K, f.rgb, f.depth_m, f.mask))  # a mask: re-registers the session
        again = ws.receive_json()
        assert (again["type"], again["session_id"], again["source"]) == ("registered", started["session_id"],
                                                                         "register (client mask)")


@pytest.fixture
def gated(tiny_estimator, tmp_path):
    estimator, gate = gated_estimator(tiny_estimator, "track_refiner")
    gate.opened.set()  # open until a test closes it
    # no request-path warm-up (test_ready_warm's subject): it cost each of these apps ~5 s of CPU
    app = create_app(tiny_config(write_objects_dir(tmp_path / "objects"), api_key="s3cret", warmup=False),
                     estimator=estimator)
    with TestClient(app) as client:
        assert app.state.fp.wait_ready(READY_TIMEOUT_S), app.state.fp.failure
        try:
            yield client, gate
        finally:
            gate.opened.set()


@pytest.mark.slow
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


# -- the waiting queue, without a server ---------------------------------------------------------------------------
class _Counters:
    def change(self, **_: int) -> None:
        pass


def _stream():
    from server.flow.stream import Stream

    return Stream(None, None, "unit", max_message_bytes=2**24, idle_s=60.0, metrics=None, counters=_Counters())


def test_only_a_newer_frame_replaces_a_waiting_frame_and_errors_are_bounded(enc):
    """Frames replace frames (the replaced listed in ``skipped``); a start and the error answers of bad messages
    keep their places; more bad messages waiting than MAX_WAITING_ERRORS ends the connection (1008)."""
    from server.flow.stream import CLOSE_POLICY, MAX_WAITING_ERRORS

    f = enc.frame
    stream = _stream()
    stream.take(start_message("block", f.K, np.eye(4)))
    stream.take(frame_message(1, f.rgb, f.depth_m))
    stream.take(b"\0\0")  # not a message: its error answer waits
    stream.take(start_message("block", f.K, np.eye(4)))  # a second opening while one waits: an error answer
    stream.take(frame_message(2, f.rgb, f.depth_m))
    assert [(i.kind, i.frame, i.skipped) for i in stream.waiting] == [
        ("start", None, []), ("error", None, []), ("error", None, []), ("frame", 2, [1])]
    assert stream.closing is None
    for _ in range(MAX_WAITING_ERRORS - 2):
        stream.take(b"\0\0")
    assert stream.closing is None
    stream.take(b"\0\0")
    assert stream.closing == (CLOSE_POLICY, f"more than {MAX_WAITING_ERRORS} bad messages waiting for their answers")
