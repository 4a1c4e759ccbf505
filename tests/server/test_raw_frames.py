"""Raw frames (no codec) over multipart, the binary message container, OpenCV decode == Pillow decode,
and the per-request host phases in timings_ms, Server-Timing and /metrics."""

from __future__ import annotations

import io
import json
import struct

import numpy as np
import pytest
from PIL import Image

from foundationpose.errors import InputError
from server import codecs
from server.client import depth_mm, raw_track_form
from server.errors import ImageTooLargeError
from server.flow.frames import FrameBytes, decode_frame
from server.flow.message import pack_message, unpack_message
from server.phases import Phases
from tests.server._helpers import MAX_IMAGE_HW, assert_error, assert_rigid, register

HW = (96, 128)


def _raw_register(client, enc, **overrides):
    f = enc.frame
    fields, files = raw_track_form(f.rgb, f.depth_m)
    fields = {**fields, "mask_shape": f"{HW[0]},{HW[1]}", "object_id": "block", "K": enc.K_json, **overrides}
    files["mask"] = ("mask.raw", (f.mask > 0).astype(np.uint8).tobytes())
    return client.post("/register", data=fields, files=files)


@pytest.mark.slow
def test_raw_register_and_track_give_the_same_poses_as_png(client, enc):
    f = enc.frame
    raw = _raw_register(client, enc)
    assert raw.status_code == 200, raw.text
    png = register(client, enc)
    np.testing.assert_array_equal(raw.json()["pose"], png["pose"])  # same pixels, same numbers
    fields, files = raw_track_form(f.rgb, f.depth_m)
    tracked_raw = client.post("/track", data={"session_id": raw.json()["session_id"], **fields}, files=files)
    tracked_png = client.post("/track", data={"session_id": png["session_id"]}, files=enc.track_files())
    assert tracked_raw.status_code == 200, tracked_raw.text
    np.testing.assert_array_equal(assert_rigid(tracked_raw.json()["pose"]), assert_rigid(tracked_png.json()["pose"]))
    # float32 metres, stateless
    files["depth"] = ("depth.raw", f.depth_m.astype("<f4").tobytes())
    stateless = client.post("/track", data={**fields, "depth_dtype": "float32", "object_id": "block", "K": enc.K_json,
                                            "pose": json.dumps(png["pose"])}, files=files)
    assert stateless.status_code == 200, stateless.text


@pytest.mark.parametrize("fields, status, field, match", [
    ({"rgb_shape": "96,128"}, 422, "rgb_shape", r"^rgb_shape: expected 3 comma-separated"),
    ({"rgb_shape": "96,128,4"}, 422, "rgb_shape", r"^rgb_shape: expected 3 comma-separated positive integers H,W,3"),
    ({"rgb_shape": "96,127,3"}, 422, "rgb", r"^rgb: expected 36576 bytes of raw uint8 \(96, 127, 3\); got 36864"),
    ({"rgb_shape": "9600,128,3"}, 413, "rgb", r"^rgb: expected an image of at most 160x120 pixels"),
    ({"depth_dtype": "float64"}, 422, "depth_dtype", r"^depth_dtype: expected uint16 \(millimetres\) or float32"),
    ({"depth_dtype": "float32"}, 422, "depth", r"^depth: expected 49152 bytes of raw float32 \(96, 128\); got 24576"),
    ({"depth_shape": "-1,128"}, 422, "depth_shape", r"^depth_shape: expected 2 comma-separated"),
    ({"depth_shape": None, "depth_dtype": "uint16"}, 422, "depth_shape", r"^depth_shape: expected H,W"),
])
@pytest.mark.slow
def test_raw_field_errors_name_the_field(client, enc, fields, status, field, match):
    f = enc.frame
    sid = register(client, enc)["session_id"]
    base, files = raw_track_form(f.rgb, f.depth_m)
    data = {k: v for k, v in {**base, **fields, "session_id": sid}.items() if v is not None}
    assert_error(client.post("/track", data=data, files=files), status,
                 "ImageTooLargeError" if status == 413 else "InputError", field, match)


def _raw_depth(data: bytes, shape, dtype: str):
    """The depth of a frame whose rgb is a small PNG (it decodes first) and whose depth is raw."""
    rgb = codecs.encode_rgb_png(np.zeros((*HW, 3), np.uint8))
    return decode_frame(FrameBytes(rgb, data, depth_shape=shape, depth_dtype=dtype), MAX_IMAGE_HW, Phases()).depth


def test_sizes_are_checked_before_anything_is_allocated():
    huge = FrameBytes(b"\x89PNG", b"", depth_shape="100000,100000", depth_dtype="float32", rgb_shape="100000,100000,3")
    with pytest.raises(ImageTooLargeError, match=r"^rgb: expected an image of at most"):
        decode_frame(huge, MAX_IMAGE_HW, Phases())  # 120 GB declared, 4 bytes sent
    with pytest.raises(ImageTooLargeError, match=r"^depth: expected an image of at most"):
        _raw_depth(b"", "100000,100000", "float32")  # 40 GB declared, 0 sent
    with pytest.raises(InputError, match=r"^depth: expected 38400 bytes"):
        _raw_depth(b"\0" * 10, "120,160", "uint16")
    depth = _raw_depth(np.full(HW, 1234, "<u2").tobytes(), [96, 128], "uint16")
    assert depth.dtype == np.float32 and depth[0, 0] == np.float32(1234) / np.float32(1000)
    rgb_bytes = np.arange(96 * 128 * 3, dtype=np.uint32).astype(np.uint8).tobytes()
    rgb = decode_frame(FrameBytes(rgb_bytes, np.full(HW, 1234, "<u2").tobytes(), rgb_shape="96,128,3",
                                  depth_shape="96,128", depth_dtype="uint16"), MAX_IMAGE_HW, Phases()).rgb
    assert rgb.base is not None and not rgb.flags.writeable  # a view of the received bytes, no copy


def test_message_container_round_trip_and_framing_errors():
    rgb = np.zeros((4, 5, 3), np.uint8)
    blob = pack_message({"type": "frame", "frame": 7}, {"rgb": rgb, "depth": b"PNGBYTES"})
    message = unpack_message(blob)
    assert message.header == {"type": "frame", "frame": 7}
    assert message.parts["rgb"].shape == [4, 5, 3] and message.parts["rgb"].dtype == "uint8"
    assert bytes(message.parts["depth"].data) == b"PNGBYTES" and not message.parts["depth"].raw
    with pytest.raises(InputError, match=r"^message: expected a header of at most"):
        unpack_message(struct.pack("<I", 10**6) + b"{}")
    with pytest.raises(InputError, match=r"^message: expected \d+ bytes \(header \+ declared parts\); got"):
        unpack_message(blob + b"x")
    with pytest.raises(InputError, match=r"^rgb: expected nbytes within"):
        unpack_message(blob[:-20])
    head = json.dumps({"parts": [{"name": "a", "nbytes": 0}, {"name": "a", "nbytes": 0}]}).encode()
    with pytest.raises(InputError, match=r"^a: expected each part once"):
        unpack_message(struct.pack("<I", len(head)) + head)


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "LA", "P"])
def test_opencv_png_decode_equals_pillow(mode):
    rng = np.random.default_rng(3)
    rgb = rng.integers(0, 256, (HW[0], HW[1], 3), dtype=np.uint8)
    image = Image.fromarray(rgb).convert(mode)
    out = io.BytesIO()
    image.save(out, format="PNG")
    decoded = codecs.decode_rgb(out.getvalue(), MAX_IMAGE_HW)
    np.testing.assert_array_equal(decoded, np.asarray(image.convert("RGB")))


def test_opencv_jpeg_and_depth_decode_match_pillow():
    rng = np.random.default_rng(4)
    rgb = rng.integers(0, 256, (HW[0], HW[1], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(rgb).save(out, format="JPEG", quality=90)
    decoded = codecs.decode_rgb(out.getvalue(), MAX_IMAGE_HW).astype(int)
    pillow = np.asarray(Image.open(io.BytesIO(out.getvalue())).convert("RGB")).astype(int)
    # Two libjpeg builds may round the IDCT differently: measured here max 1 level apart (the two agree
    # exactly when they share libjpeg-turbo); allow 2.
    assert np.abs(decoded - pillow).max() <= 2
    depth_m = rng.uniform(0.3, 2.0, HW).astype(np.float32)
    got = codecs.decode_depth(codecs.encode_depth_png_mm(depth_m), MAX_IMAGE_HW)
    np.testing.assert_array_equal(got, depth_mm(depth_m).astype(np.float32) / np.float32(1000.0))


@pytest.mark.slow
def test_host_phases_are_in_the_answer_the_header_and_metrics(client, enc):
    sid = register(client, enc)["session_id"]
    response = client.post("/track", data={"session_id": sid}, files=enc.track_files())
    timings = response.json()["timings_ms"]
    phases = {"receive", "parse", "decode", "validate", "queue", "batcher_wait", "pipeline", "resume"}
    assert phases <= set(timings) and all(timings[p] >= 0 for p in phases)
    assert {"step", "total", "batch"} <= set(timings)  # the lane's own stages stay beside the phases
    assert timings["pipeline"] >= timings["batcher_wait"]
    header = dict(item.split(";dur=") for item in response.headers["server-timing"].split(", "))
    assert phases | {"encode"} <= set(header)
    metrics = client.get("/metrics").text
    for phase in ("receive", "decode", "pipeline", "encode"):
        assert f'fp_request_phase_seconds_count{{endpoint="/track",phase="{phase}"}}' in metrics
    assert 'fp_pose_stage_duration_seconds_count{endpoint="/track",stage="batcher_wait"}' not in metrics


def test_client_messages_take_uint16_millimetres_as_they_are():
    """server.client's messages: a uint16 depth is sent as the millimetres it is (no float round trip), and gives
    the same bytes as the float metres it converts from; a float depth is converted by depth_mm."""
    from server.client import depth_mm, depth_part, frame_message, register_message, track_body

    rng = np.random.default_rng(5)
    rgb = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
    millimetres = rng.integers(0, 4000, (6, 8)).astype(np.uint16)
    metres = millimetres.astype(np.float64) / 1000.0
    K = np.array([[500.0, 0, 4], [0, 500.0, 3], [0, 0, 1]])
    mask = np.ones((6, 8), np.uint8)
    assert depth_part(millimetres) is millimetres
    np.testing.assert_array_equal(depth_part(metres), depth_mm(metres))
    np.testing.assert_array_equal(depth_mm(metres), millimetres)
    assert frame_message(3, rgb, millimetres) == frame_message(3, rgb, metres)
    assert track_body(rgb, millimetres, session_id="s") == track_body(rgb, metres, session_id="s")
    assert register_message("o", K, rgb, millimetres, mask) == register_message("o", K, rgb, metres, mask)
    parts = unpack_message(frame_message(3, rgb, millimetres)).parts
    assert parts["depth"].dtype == "uint16" and bytes(parts["depth"].data) == millimetres.tobytes()
