"""Bad input gets a clear 4xx naming the field, before any pipeline work (and nothing is lost)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from server import codecs
from tests.server._helpers import FRAME_HW, MAX_IMAGE_HW, assert_error


def _post_register(client, enc, *, K=None, object_id="block", **files):
    uploads = enc.register_files()
    uploads.update({name: (f"{name}.bin", data) for name, data in files.items()})
    data = {"object_id": object_id, "K": enc.K_json if K is None else K}
    return client.post("/register", data=data, files=uploads)


def _jpeg(rgb: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(rgb).save(out, format="JPEG")
    return out.getvalue()


def test_undecodable_and_wrong_format_images(client, enc):
    assert_error(_post_register(client, enc, rgb=b"not an image at all"), 422, "InputError", "rgb",
                 r"^rgb: expected a PNG or JPEG colour image")
    assert_error(_post_register(client, enc, rgb=enc.rgb[:60]), 422, "InputError", "rgb", r"^rgb: expected ")
    assert_error(_post_register(client, enc, rgb=b""), 422, "InputError", "rgb", r"^rgb: .*got an empty file")
    assert_error(_post_register(client, enc, depth=_jpeg(enc.frame.rgb)), 422, "InputError", "depth",
                 r"^depth: expected .*; got a JPEG")
    assert_error(_post_register(client, enc, mask=enc.depth_npy), 422, "InputError", "mask", r"^mask: expected ")
    assert_error(_post_register(client, enc, mask=enc.rgb), 422, "InputError", "mask",
                 r"^mask: expected a single-channel PNG.*RGB PNG")


def test_eight_bit_depth_png_says_sixteen_bit_millimetres_expected(client, enc):
    eight_bit = codecs.encode_mask_png(np.ones(FRAME_HW, bool))  # a valid 8-bit grey PNG
    body = assert_error(_post_register(client, enc, depth=eight_bit), 422, "InputError", "depth",
                        r"^depth: expected a 16-bit single-channel PNG in millimetres")
    assert "8-bit" in body["message"]


def test_wrong_dtypes(client, enc):
    int_npy = io.BytesIO()
    np.save(int_npy, (enc.frame.depth_m * 1000).astype(np.uint16))
    assert_error(_post_register(client, enc, depth=int_npy.getvalue()), 422, "InputError", "depth",
                 r"^depth: expected float32 metres .*Millimetre depth\?")
    mm_floats = codecs.encode_depth_npy(enc.frame.depth_m * 1000)
    assert_error(_post_register(client, enc, depth=mm_floats), 422, "InputError", "depth", r"^depth: expected metres")
    rgb16 = io.BytesIO()
    Image.fromarray(np.zeros(FRAME_HW, np.uint16)).save(rgb16, format="PNG")
    assert_error(_post_register(client, enc, rgb=rgb16.getvalue()), 422, "InputError", "rgb",
                 r"^rgb: expected .*16-bit grey PNG")


def test_size_mismatch_between_rgb_depth_and_mask(client, enc):
    h, w = FRAME_HW
    small_depth = codecs.encode_depth_png_mm(enc.frame.depth_m[: h - 8])
    assert_error(_post_register(client, enc, depth=small_depth), 422, "InputError", "depth",
                 rf"^depth: expected the size of rgb and mask, {h}x{w} \(HxW\); got a {h - 8}x{w} 16-bit PNG "
                 rf"\(uint16 millimetres\)\. depth is {h - 8}x{w} while rgb and mask are {h}x{w}: ")
    small_mask = codecs.encode_mask_png(enc.frame.mask[:, : w - 4])
    assert_error(_post_register(client, enc, mask=small_mask), 422, "InputError", "mask",
                 rf"^mask: expected the size of rgb and depth, {h}x{w} \(HxW\); got a {h}x{w - 4} PNG\. ")


@pytest.mark.parametrize(
    ("K", "pattern"),
    [
        ("[[1, 0, 0], [0, 1, 0]]", r"^K: expected float \(3, 3\)"),
        ("[1, 0, 0, 0, 1, 0, 0, 0, 1]", r"^K: expected a JSON 3x3 array"),
        ("[[500, 0, 64], [0, NaN, 48], [0, 0, 1]]", r"^K: expected finite values"),
        ("[[-500, 0, 64], [0, 500, 48], [0, 0, 1]]", r"^K: expected positive focal lengths"),
        ("[[500, 0, 64], [0, 0, 48], [0, 0, 1]]", r"^K: expected positive focal lengths"),
        ("{'fx': 500}", r"^K: expected a JSON 3x3 array .*not JSON"),
        ('[["500", 0, 64], [0, 500, 48], [0, 0, 1]]', r"^K: expected .*non-number entry"),
    ],
)
def test_bad_K(client, enc, K, pattern):
    assert_error(_post_register(client, enc, K=K), 422, "InputError", "K", pattern)


@pytest.mark.slow
def test_empty_mask_and_no_depth_under_the_mask(client, enc):
    empty = codecs.encode_mask_png(np.zeros(FRAME_HW, bool))
    assert_error(_post_register(client, enc, mask=empty), 422, "InputError", "mask",
                 r"^mask: expected at least one object pixel; got an empty mask")
    no_depth = np.zeros(FRAME_HW, np.float32)
    assert_error(_post_register(client, enc, depth=codecs.encode_depth_png_mm(no_depth)), 422, "InputError", "depth",
                 r"^depth: expected at least 4 valid depth pixels .* under the mask; got 0")
    assert client.app.state.fp.service.stats().register_pool.leased == 0


@pytest.mark.slow
def test_masked_depth_is_judged_on_the_filtered_depth_like_the_algorithm(client, enc, tiny_estimator):
    """Raw depth with no reading under the mask, but valid around it: the depth filters fill the mask's rim
    (spec §2.3), so the algorithm registers it; the server must not refuse it on the raw depth."""
    holes = enc.frame.depth_m.copy()
    holes[enc.frame.mask] = 0.0
    depth_png = codecs.encode_depth_png_mm(holes)
    decoded = codecs.decode_depth(depth_png, MAX_IMAGE_HW)
    assert np.count_nonzero((decoded >= 0.001) & enc.frame.mask) == 0  # nothing valid in the raw depth
    model = client.app.state.fp.objects.get("block").model
    reference = tiny_estimator.register(model, enc.frame.rgb, decoded, enc.frame.mask, enc.frame.K)
    response = _post_register(client, enc, depth=depth_png)
    assert response.status_code == 200, response.text
    np.testing.assert_array_equal(np.asarray(response.json()["pose"]), reference.cam_from_mesh)


def test_missing_fields_and_unknown_object(client, enc):
    files = enc.register_files()
    del files["mask"]
    assert_error(client.post("/register", data={"object_id": "block", "K": enc.K_json}, files=files),
                 422, "InputError", "mask", r"^mask: expected a single-channel PNG, > 0 = object, or a box x0,y0,x1,y1 around the object; got nothing "
                 r"\(the field is missing or empty\)$")
    assert_error(client.post("/register", data={"object_id": "block"}, files=enc.register_files()),
                 422, "InputError", "K")
    assert_error(_post_register(client, enc, object_id="missing"), 404, "UnknownObjectError", "object_id",
                 r"^object_id: no object 'missing'")
    assert_error(_post_register(client, enc, object_id="../etc"), 422, "InputError", "object_id")


def test_images_over_the_maximum_resolution_are_refused_from_the_header(client, enc):
    max_h, max_w = MAX_IMAGE_HW
    big = np.zeros((max_h + 1, max_w, 3), np.uint8)
    body = assert_error(_post_register(client, enc, rgb=codecs.encode_rgb_png(big)), 413, "ImageTooLargeError", "rgb")
    assert f"at most {max_w}x{max_h}" in body["message"]
    big_npy = codecs.encode_depth_npy(np.zeros((max_h, max_w + 1), np.float32))
    assert_error(_post_register(client, enc, depth=big_npy), 413, "ImageTooLargeError", "depth")


def test_oversize_bodies_get_413_from_content_length_and_while_streaming(client, enc):
    limit = client.app.state.fp.config.max_upload_bytes
    huge = b"\0" * (limit + 1)
    body = assert_error(_post_register(client, enc, rgb=huge), 413, "PayloadTooLargeError", "body",
                        r"^body: expected at most \d+ bytes")
    assert "Content-Length" in body["message"]

    def chunks():  # no Content-Length: the limit is enforced on the stream
        boundary = b"--xyz\r\n"
        yield boundary + b'Content-Disposition: form-data; name="rgb"; filename="a.png"\r\n\r\n'
        for _ in range(limit // 65536 + 2):
            yield b"\0" * 65536

    response = client.post("/register", content=chunks(), headers={"Content-Type": "multipart/form-data; boundary=xyz"})
    body = assert_error(response, 413, "PayloadTooLargeError", "body")
    assert f"more than {limit} bytes" in body["message"]


def test_metrics_count_the_refusals(client, enc):
    before = client.app.state.fp.metrics.request_count("/register", 422)
    _post_register(client, enc, K="[]")
    assert client.app.state.fp.metrics.request_count("/register", 422) == before + 1
    text = client.get("/metrics").text
    assert 'fp_http_requests_total{endpoint="/register",method="POST",status="422"}' in text
