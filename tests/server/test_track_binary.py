"""``POST /track/binary``: the track request as one binary body (the stream's container), over a real app."""

from __future__ import annotations

import json
import re
import struct

import numpy as np
import pytest

from server.client import BINARY_HEADERS, depth_mm, track_body
from server.flow.message import pack_message
from tests.server._helpers import MAX_IMAGE_HW, assert_error, assert_rigid, register


def _post(client, body: bytes, headers: dict | None = None):
    return client.post("/track/binary", content=body, headers=BINARY_HEADERS if headers is None else headers)


def _metric(metrics: str, series: str) -> float:
    """The value of one series (name and labels) in a /metrics text; 0 when absent."""
    found = re.search(re.escape(series) + r" (\S+)", metrics)
    return float(found[1]) if found else 0.0


@pytest.mark.slow
def test_session_tracks_advance_the_session_like_multipart_tracks(client, enc):
    metrics_before = client.get("/metrics").text
    sid = register(client, enc)["session_id"]
    frame = enc.frame
    first = _post(client, track_body(frame.rgb, frame.depth_m, session_id=sid))
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["session_id"] == sid and body["frame"] == 1 and body["object_id"] == "block"
    assert_rigid(body["pose"])
    np.testing.assert_allclose(client.get(f"/sessions/{sid}").json()["pose"], body["pose"])
    # a multipart track of the same session goes on from there, and a binary one after it
    assert client.post("/track", data={"session_id": sid}, files=enc.track_files()).json()["frame"] == 2
    with_K = _post(client, track_body(frame.rgb, frame.depth_m, session_id=sid, K=frame.K))
    assert with_K.json()["frame"] == 3
    timings = with_K.json()["timings_ms"]
    assert {"receive", "parse", "decode", "validate", "queue", "pipeline", "resume"} <= set(timings)
    metrics = client.get("/metrics").text  # this test's two binary tracks (the start-up's warm-up sent its own)
    for series in ('fp_request_phase_seconds_count{endpoint="/track/binary",phase="decode"}',
                   'fp_http_requests_total{endpoint="/track/binary",method="POST",status="200"}'):
        assert _metric(metrics, series) - _metric(metrics_before, series) == 2, series


@pytest.mark.slow
def test_a_stateless_binary_track_equals_the_multipart_one_bit_for_bit(client, enc):
    start = register(client, enc)["pose"]
    frame = enc.frame
    multipart = client.post("/track", data={"object_id": "block", "pose": json.dumps(start), "K": enc.K_json},
                            files=enc.track_files())
    assert multipart.status_code == 200, multipart.text
    # raw pixels of the same frame (the PNG depth is millimetres: the same values raw)
    binary = _post(client, track_body(frame.rgb, frame.depth_m, object_id="block", pose=np.asarray(start), K=frame.K))
    assert binary.status_code == 200, binary.text
    assert binary.json()["session_id"] is None and binary.json()["frame"] is None
    assert binary.json()["pose"] == multipart.json()["pose"]
    # encoded parts (PNG) in the container work too, with the pose and K as JSON text
    png = pack_message({"object_id": "block", "pose": json.dumps(start), "K": enc.K_json},
                       {"rgb": enc.rgb, "depth": enc.depth_png})
    assert _post(client, png).json()["pose"] == multipart.json()["pose"]


@pytest.mark.slow
def test_errors_name_the_field_as_multipart_track_does(client, enc):
    sid = register(client, enc)["session_id"]
    frame = enc.frame
    good = track_body(frame.rgb, frame.depth_m, session_id=sid)
    assert_error(_post(client, good, {"Content-Type": "multipart/form-data; boundary=x"}), 415,
                 "UnsupportedMediaTypeError", "Content-Type", r"^Content-Type: expected application/octet-stream")
    assert_error(_post(client, b"\x05\x00"), 422, "InputError", "message", r"^message: expected uint32")
    assert_error(_post(client, pack_message({"session_id": sid}, {"rgb": frame.rgb})), 422, "InputError", "depth",
                 r"^depth: expected a part named 'depth'")
    both = track_body(frame.rgb, frame.depth_m, session_id=sid, pose=np.eye(4), object_id="block")
    assert_error(_post(client, both), 422, "InputError", "session_id",
                 r"^session_id: expected either session_id, or pose and object_id")
    assert_error(_post(client, track_body(frame.rgb, frame.depth_m)), 422, "InputError", "session_id",
                 r"^session_id: expected a session_id, or pose and object_id .*; got neither")
    assert_error(_post(client, track_body(frame.rgb, frame.depth_m, session_id="../x")), 422, "InputError",
                 "session_id", r"^session_id: expected 1 to 64 characters")
    assert_error(_post(client, track_body(frame.rgb, frame.depth_m, session_id="nosuchsession")), 404,
                 "UnknownSessionError")
    short = pack_message({"session_id": sid}, {"rgb": frame.rgb[:-1], "depth": depth_mm(frame.depth_m)[:-1]})
    assert_error(_post(client, short), 422, "InputError", "K", r"^K: expected the K of this 128x95 frame")
    mismatch = pack_message({"session_id": sid}, {"rgb": frame.rgb, "depth": depth_mm(frame.depth_m)[:-1]})
    assert_error(_post(client, mismatch), 422, "InputError", "depth",
                 r"^depth: expected the size of rgb, 96x128 \(HxW\); got a 95x128 raw uint16 array\. "
                 r"depth is 95x128 while rgb is 96x128: ")
    far = np.eye(4)
    far[2, 3] = 500.0
    stateless = track_body(frame.rgb, frame.depth_m, object_id="block", pose=far, K=frame.K)
    assert_error(_post(client, stateless), 422, "InputError", "pose", r"^pose: expected a translation within")
    h, w = MAX_IMAGE_HW
    empty = struct.pack("<I", 2) + b"{}"  # the framing is fine, the parts are missing
    assert_error(_post(client, empty), 422, "InputError", "rgb", r"^rgb: expected a part named 'rgb'; got parts \[\]$")
    too_big = pack_message({"session_id": sid}, {"rgb": np.zeros((h + 1, w, 3), np.uint8),
                                                 "depth": np.zeros((h + 1, w), np.uint16)})
    assert_error(_post(client, too_big), 413, "ImageTooLargeError", "rgb")
    assert client.get(f"/sessions/{sid}").json()["frames"] == 0  # no failed request changed the session
