"""A register shown by a box instead of a mask: multipart, binary body, the stream, and a re-register of a session."""

from __future__ import annotations

import numpy as np
import pytest

from foundationpose.errors import InputError
from foundationpose.recovery import mask_from_box
from server import codecs
from server.client import BINARY_HEADERS, register_message
from server.flow.inputs import parse_box
from tests.server._helpers import FRAME_HW, assert_error, assert_rigid


def _box_around(mask: np.ndarray, pad: int = 4) -> tuple[int, int, int, int]:
    ys, xs = np.nonzero(mask)
    h, w = mask.shape
    return (max(int(xs.min()) - pad, 0), max(int(ys.min()) - pad, 0), min(int(xs.max()) + 1 + pad, w),
            min(int(ys.max()) + 1 + pad, h))


def _box_text(box) -> str:
    return ",".join(str(v) for v in box)


@pytest.fixture(scope="module")
def box_and_mask(app_client, enc):
    """The box around the object and the mask the server finds in it (from the depth as the server decodes it)."""
    box = _box_around(enc.frame.mask)
    diameter = app_client.get("/objects/block").json()["diameter_m"]
    depth = codecs.decode_depth(enc.depth_png, FRAME_HW)
    return box, mask_from_box(depth, enc.frame.K, diameter, box)


@pytest.mark.slow
def test_a_register_with_a_box_equals_the_register_with_the_mask_found_in_it(client, enc, box_and_mask):
    box, mask = box_and_mask
    assert mask.any()
    files = {k: v for k, v in enc.register_files().items() if k != "mask"}
    boxed = client.post("/register", data={"object_id": "block", "K": enc.K_json, "box": _box_text(box)}, files=files)
    assert boxed.status_code == 200, boxed.text
    masked = client.post("/register", data={"object_id": "block", "K": enc.K_json},
                         files={**files, "mask": ("m.png", codecs.encode_mask_png(mask), "image/png")})
    assert masked.status_code == 200, masked.text
    assert boxed.json()["pose"] == masked.json()["pose"] and boxed.json()["score"] == masked.json()["score"]
    assert_rigid(boxed.json()["pose"])
    sid = boxed.json()["session_id"]
    tracked = client.post("/track", data={"session_id": sid}, files=enc.track_files())
    assert tracked.status_code == 200 and tracked.json()["frame"] == 1

    again = client.post("/register", data={"object_id": "block", "K": enc.K_json, "box": _box_text(box),
                                           "session_id": sid}, files=files)  # a forced re-register, in place
    assert again.status_code == 200, again.text
    assert again.json()["session_id"] == sid and again.json()["pose"] == masked.json()["pose"]
    assert again.json()["source"] == "register (client mask)"


@pytest.mark.slow
def test_the_binary_body_and_the_stream_take_a_box(client, enc, box_and_mask):
    box, _ = box_and_mask
    f = enc.frame
    reference = client.post("/register", data={"object_id": "block", "K": enc.K_json, "box": _box_text(box)},
                            files={k: v for k, v in enc.register_files().items() if k != "mask"}).json()
    body = register_message("block", f.K, f.rgb, f.depth_m, box=box)
    binary = client.post("/register/binary", content=body, headers=BINARY_HEADERS)
    assert binary.status_code == 200, binary.text
    assert binary.json()["pose"] == reference["pose"]
    with client.websocket_connect("/track/stream") as ws:
        ws.send_bytes(body)
        reply = ws.receive_json()
    assert reply["type"] == "registered" and reply["pose"] == reference["pose"]
    with pytest.raises(ValueError, match="a mask or a box"):
        register_message("block", f.K, f.rgb, f.depth_m, f.mask, box=box)


def test_a_box_is_refused_with_its_field(client, enc, box_and_mask):
    box, _ = box_and_mask
    files = {k: v for k, v in enc.register_files().items() if k != "mask"}
    h, w = FRAME_HW

    def post(data, files=files):
        return client.post("/register", data={"object_id": "block", "K": enc.K_json, **data}, files=files)

    assert_error(post({}), 422, "InputError", "mask", r"^mask: expected a single-channel PNG, > 0 = object, or a box ")
    assert_error(post({"box": _box_text(box)}, enc.register_files()), 422, "InputError", "mask",
                 r"^mask: expected a mask or a box, not both; got both$")
    assert_error(post({"box": f"0,0,{w + 1},{h}"}), 422, "InputError", "box",
                 rf"^box: expected a box within the {w}x{h} image")
    assert_error(post({"box": "5,5,5,9"}), 422, "InputError", "box")  # empty
    assert_error(post({"box": "1,2,3"}), 422, "InputError", "box")  # the form's pattern
    no_depth = np.zeros(FRAME_HW, np.float32)
    no_depth[:, w // 2:] = enc.frame.depth_m[:, w // 2:]  # readings only in the right half
    assert_error(post({"box": f"0,0,{w // 4},{h // 4}"},
                      {**files, "depth": ("d.npy", codecs.encode_depth_npy(no_depth), "application/octet-stream")}),
                 422, "InputError", "box", r"^box: expected a box around the object's depth readings")


def test_the_box_parser():
    assert parse_box("1,2,30,40") == (1, 2, 30, 40) and parse_box([0, 0, 5, 6]) == (0, 0, 5, 6)
    assert parse_box(None) is None
    for bad in ("1,2,3", "1, 2,3,4", "-1,0,4,4", [0, 0, 5, True], "4,0,2,3", 7):
        with pytest.raises(InputError) as caught:
            parse_box(bad)
        assert caught.value.field == "box"
