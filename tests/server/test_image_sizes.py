"""Images of different sizes in one request (PNG uploads): the error names the image whose size disagrees with the
others and with K, says which image is which size, and names what was sent (a 16-bit PNG, not the float32 the
server decodes it to)."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from server import codecs
from tests.server._helpers import FRAME_HW, assert_error, register

H, W = FRAME_HW  # 96x128; the frame's K has its principal point at the centre of that size


def _half(image: np.ndarray) -> np.ndarray:
    return cv2.resize(image, (W // 2, H // 2), interpolation=cv2.INTER_NEAREST)


def _register(client, enc, **files: bytes):
    uploads = enc.register_files()
    uploads.update({name: (f"{name}.png", data, "image/png") for name, data in files.items()})
    return client.post("/register", data={"object_id": "block", "K": enc.K_json}, files=uploads)


def test_a_resized_rgb_is_named_not_the_depth(client, enc):
    small_rgb = codecs.encode_rgb_png(_half(enc.frame.rgb))
    body = assert_error(_register(client, enc, rgb=small_rgb), 422, "InputError", "rgb")
    assert body["message"] == (
        f"rgb: expected the size of depth, mask and K, {H}x{W} (HxW); got a {H // 2}x{W // 2} PNG. "
        f"rgb is {H // 2}x{W // 2} while depth and mask are {H}x{W}: send every image at one size (resize them "
        "together, and scale K with them)")


def test_a_resized_depth_png_is_named_with_what_was_sent(client, enc):
    small_depth = codecs.encode_depth_png_mm(_half(enc.frame.depth_m))
    body = assert_error(_register(client, enc, depth=small_depth), 422, "InputError", "depth")
    assert body["message"].startswith(
        f"depth: expected the size of rgb, mask and K, {H}x{W} (HxW); got a {H // 2}x{W // 2} 16-bit PNG (uint16 "
        f"millimetres). depth is {H // 2}x{W // 2} while rgb and mask are {H}x{W}: ")
    assert "float32" not in body["message"]


def test_a_float32_npy_depth_is_named_as_such(client, enc):
    small_npy = codecs.encode_depth_npy(_half(enc.frame.depth_m))
    uploads = {**enc.register_files(), "depth": ("depth.npy", small_npy, "application/octet-stream")}
    response = client.post("/register", data={"object_id": "block", "K": enc.K_json}, files=uploads)
    body = assert_error(response, 422, "InputError", "depth")
    assert f"got a {H // 2}x{W // 2} float32 .npy (metres). " in body["message"]


@pytest.mark.slow
def test_a_track_with_a_resized_rgb_names_the_rgb_before_the_sessions_K(client, enc):
    """The session's K is for 96x128 frames: the small rgb is the odd one (not 'the K of this 64x48 frame')."""
    sid = register(client, enc)["session_id"]
    files = {**enc.track_files(), "rgb": ("rgb.png", codecs.encode_rgb_png(_half(enc.frame.rgb)), "image/png")}
    response = client.post("/track", data={"session_id": sid}, files=files)
    body = assert_error(response, 422, "InputError", "rgb")
    assert body["message"].startswith(f"rgb: expected the size of depth and K, {H}x{W} (HxW); got a "
                                      f"{H // 2}x{W // 2} PNG. rgb is {H // 2}x{W // 2} while depth is {H}x{W}: ")
    assert client.post("/track", data={"session_id": sid}, files=enc.track_files()).status_code == 200  # not lost
