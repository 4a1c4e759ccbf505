"""``POST /register/binary``: the register request as one binary body (the stream's register message), over a
real app: the same pose as the multipart register of the same pixels, a session that tracks, the errors."""

from __future__ import annotations

import numpy as np
import pytest

from server.client import BINARY_HEADERS, register_message
from server.flow.message import pack_message
from tests.server._helpers import assert_error, register


def _post(client, body: bytes, headers: dict | None = None):
    return client.post("/register/binary", content=body, headers=BINARY_HEADERS if headers is None else headers)


@pytest.mark.slow
def test_binary_register_equals_the_multipart_register_and_opens_a_session(client, enc):
    frame = enc.frame
    counter = 'fp_http_requests_total{endpoint="/register/binary",method="POST",status="200"} '
    before = _count(client.get("/metrics").text, counter)
    answer = _post(client, register_message("block", frame.K, frame.rgb, frame.depth_m, frame.mask))
    assert answer.status_code == 200, answer.text
    body = answer.json()
    reference = register(client, enc)  # PNG rgb and mm depth of the same pixels
    np.testing.assert_array_equal(np.array(body["pose"]), np.array(reference["pose"]))
    assert body["object_id"] == "block" and body["score"] == reference["score"]
    assert {"receive", "parse", "decode", "validate", "submit", "pipeline", "resume"} <= set(body["timings_ms"])
    tracked = client.post("/track", data={"session_id": body["session_id"]}, files=enc.track_files())
    assert tracked.status_code == 200 and tracked.json()["frame"] == 1
    assert _count(client.get("/metrics").text, counter) == before + 1


def _count(metrics: str, prefix: str) -> float:
    """The value of the sample line starting with ``prefix`` (0 when the series does not exist yet)."""
    line = next((line for line in metrics.splitlines() if line.startswith(prefix)), None)
    return 0.0 if line is None else float(line[len(prefix):])


def test_binary_register_errors_name_the_field(client, enc):
    frame = enc.frame
    good = {"rgb": frame.rgb, "depth": (frame.depth_m * 1000).astype(np.uint16), "mask": frame.mask}
    no_mask = {k: v for k, v in good.items() if k != "mask"}
    cases = [
        (pack_message({"object_id": "block", "K": frame.K.tolist()}, no_mask), 422, "InputError", "mask"),
        (pack_message({"K": frame.K.tolist()}, good), 422, "InputError", "object_id"),
        (pack_message({"object_id": "block"}, good), 422, "InputError", "K"),
        (pack_message({"type": "frame", "object_id": "block", "K": frame.K.tolist()}, good), 422, "InputError", "type"),
        (pack_message({"object_id": "nope", "K": frame.K.tolist()}, good), 404, "UnknownObjectError", None),
        (b"\x01\x00", 422, "InputError", None),
    ]
    for body, status, kind, field in cases:
        assert_error(_post(client, body), status, kind, field)
    wrong_type = _post(client, register_message("block", frame.K, frame.rgb, frame.depth_m, frame.mask),
                       headers={"Content-Type": "multipart/form-data; boundary=x"})
    assert_error(wrong_type, 415, "UnsupportedMediaTypeError", "Content-Type",
                 match=r"^Content-Type: expected application/octet-stream \(multipart forms go to POST /register\)")
    assert "/register/binary" in client.get("/openapi.json").json()["paths"]
