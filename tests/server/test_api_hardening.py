"""Adversarial inputs are answered 4xx naming the field, and the schema says what the routes do (issue 12, 5-12)."""

from __future__ import annotations

import io
import json
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from foundationpose.errors import InputError
from server import codecs, errors
from server.errors import SessionLimitError
from tests.server._helpers import FRAME_HW, assert_error, register


def _register(client, enc, *, K=None, object_id="block", **files):
    uploads = enc.register_files()
    uploads.update({name: (f"{name}.bin", data) for name, data in files.items()})
    return client.post("/register", data={"object_id": object_id, "K": enc.K_json if K is None else K}, files=uploads)


def _npy(header: str, body: bytes = b"") -> bytes:
    """A version 1.0 .npy file with this header dict text (padded as NumPy pads it) and body."""
    text = header.encode("latin1")
    pad = 64 - (10 + len(text) + 1) % 64
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text) + pad + 1) + text + b" " * pad + b"\n" + body


# -- 5: .npy depth is read defensively --------------------------------------------------------------------


def test_npy_with_a_huge_string_dtype_in_a_tiny_file_is_refused_from_the_header(client, enc):
    bomb = _npy("{'descr': '<U5000000', 'fortran_order': False, 'shape': (96, 128), }")
    assert len(bomb) <= 128  # declares 96 * 128 strings of 20 MB: 229 GiB
    with pytest.raises(InputError, match=r"^depth: expected a float32 \.npy in metres \(H, W\); got an \.npy of "
                                                r"dtype <U5000000$"):
        codecs.decode_depth(bomb, (120, 160))
    assert_error(_register(client, enc, depth=bomb), 422, "InputError", "depth", r"^depth: expected a float32 \.npy")


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        (_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (4, 5), }", b"\0" * 10),
         r"^depth: .*; got a truncated \.npy \(its header declares 80 bytes of data; 10 follow\)$"),
        (_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (4, 5), }", b"\0" * 88),
         r"^depth: .*; got an oversized \.npy \(its header declares 80 bytes of data; 88 follow\)$"),
        (_npy("{'descr': '<c16', 'fortran_order': False, 'shape': (4, 5), }", b"\0" * 320), r"dtype <c16$"),
        (_npy("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (4, 5), }", b"\0" * 80), r"dtype \|V4$"),
        (_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (4, -5), }"), r"corrupt \.npy header \(shape \(4, -5\)\)$"),
        (_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (4, 5)"), r"corrupt \.npy header"),
        (_npy("{'descr': 'no such type', 'fortran_order': False, 'shape': (4, 5), }"), r"corrupt \.npy header"),
        (b"\x93NUMPY\x07\x00\x10\x00", r"corrupt \.npy header \(format version 7\.0"),
        (_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (4, 5, 2), }", b"\0" * 160), r"shape \(4, 5, 2\)$"),
    ],
)
def test_npy_parse_errors_name_depth(data, pattern):
    with pytest.raises(InputError, match=pattern) as info:
        codecs.decode_depth(data, (120, 160))
    assert info.value.field == "depth"


def test_npy_byte_orders_layouts_and_channel_axis_decode_to_the_values():
    depth = np.random.default_rng(0).uniform(0.3, 2.0, (4, 5))
    for array in (depth.astype(">f8"), np.asfortranarray(depth.astype(np.float32)), depth[..., None].astype("<f2")):
        out = io.BytesIO()
        np.save(out, array)
        decoded = codecs.decode_depth(out.getvalue(), (10, 10))
        np.testing.assert_array_equal(decoded.reshape(array.shape), array)
    huge = _npy("{'descr': '<f4', 'fortran_order': False, 'shape': (100000, 100000), }")
    with pytest.raises(errors.ImageTooLargeError, match=r"^depth: expected an image of at most 10x10"):
        codecs.decode_depth(huge, (10, 10))


# -- 6: plausible K and poses -------------------------------------------------------------------------------


@pytest.mark.parametrize(("entry", "value"), [((0, 0), 1e300), ((0, 2), 1e308), ((0, 0), 1e-300), ((1, 2), -1e6)])
def test_absurd_but_finite_K_is_refused_naming_K(client, enc, entry, value):
    K = enc.frame.K.copy()
    K[entry] = value
    body = assert_error(_register(client, enc, K=json.dumps(K.tolist())), 422, "InputError", "K",
                        r"^K: expected (focal lengths|the principal point)")
    assert "128x96 image" in body["message"]


def test_stateless_pose_far_outside_the_working_range_is_refused_naming_pose(client, enc):
    pose = np.eye(4)
    pose[2, 3] = 1e30
    response = client.post("/track", data={"object_id": "block", "pose": json.dumps(pose.tolist()), "K": enc.K_json},
                           files=enc.track_files())
    assert_error(response, 422, "InputError", "pose", r"^pose: expected a translation within the working range "
                                                      r"\|t\| <= 50 m; got \|t\| = 1e\+30 m")


# -- 7: decoder bombs are size errors -------------------------------------------------------------------------


def _jpeg_claiming(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(out, format="JPEG")
    data = bytearray(out.getvalue())
    sof = data.index(b"\xff\xc0")  # baseline frame header: length, precision, height, width
    data[sof + 5:sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def _png_claiming(width: int, height: int) -> bytes:
    """A real 8x8 PNG whose header (with a valid CRC) claims another size."""
    data = bytearray(codecs.encode_rgb_png(np.zeros((8, 8, 3), np.uint8)))
    data[16:24] = struct.pack(">II", width, height)  # IHDR payload starts at byte 16
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def test_a_jpeg_header_of_65500x65500_is_413(client, enc):
    assert_error(_register(client, enc, rgb=_jpeg_claiming(65500, 65500)), 413, "ImageTooLargeError", "rgb",
                 r"^rgb: expected an image of at most 160x120 pixels \(WxH\); got an image whose header claims more "
                 r"than \d+ pixels$")


def test_a_texture_header_of_100000x100000_is_413(client):
    from tests.server.test_api_objects import _obj_bytes

    response = client.post("/objects", data={"object_id": "bomb_tex"},
                           files={"mesh": ("m.obj", _obj_bytes()), "texture": ("t.png", _png_claiming(100000, 100000))})
    assert_error(response, 413, "ImageTooLargeError", "texture",
                 r"^texture: expected at most 8192 pixels per side; got an image whose header claims more than")
    assert client.get("/objects/bomb_tex").status_code == 404


# -- 8: ids are matched whole ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_ids_with_a_trailing_newline_are_refused_everywhere(client, enc):
    from tests.server.test_api_objects import _obj_bytes

    upload = client.post("/objects", data={"object_id": "block_nl\n"}, files={"mesh": ("m.obj", _obj_bytes())})
    assert_error(upload, 422, "InputError", "object_id",
                 r"^object_id: expected 1 to 64 characters from A-Z a-z 0-9 _ -; got 'block_nl\\n'$")
    assert not (client.app.state.fp.objects.root / "block_nl\n").exists()
    assert_error(client.get("/objects/block%0A"), 422, "InputError", "object_id")
    assert_error(client.delete("/objects/block%0A"), 422, "InputError", "object_id")
    assert_error(_register(client, enc, object_id="block\n"), 422, "InputError", "object_id")
    sid = register(client, enc)["session_id"]
    assert_error(client.post("/track", data={"session_id": sid + "\n"}, files=enc.track_files()),
                 422, "InputError", "session_id", r"^session_id: expected 1 to 64 characters")
    assert_error(client.get(f"/sessions/{sid}%0A"), 422, "InputError", "session_id")
    assert client.get(f"/sessions/{sid}").status_code == 200
    with pytest.raises(InputError, match=r"^object_id: "):
        client.app.state.fp.objects.reserve("block\n")


def test_the_id_pattern_is_in_the_openapi_schema(client):
    schema = client.get("/openapi.json").json()
    pattern = r"^[A-Za-z0-9_-]{1,64}$"
    for path, method in (("/objects/{object_id}", "get"), ("/objects/{object_id}", "delete"),
                         ("/sessions/{session_id}", "get"), ("/sessions/{session_id}", "delete")):
        (param,) = schema["paths"][path][method]["parameters"]
        assert param["schema"]["pattern"] == pattern, (path, method)
    bodies = schema["components"]["schemas"]
    for path, field in (("/objects", "object_id"), ("/register", "object_id"), ("/track", "session_id"),
                        ("/track", "object_id")):
        ref = schema["paths"][path]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]["$ref"]
        prop = bodies[ref.rsplit("/", 1)[-1]]["properties"][field]
        patterns = [prop.get("pattern")] + [option.get("pattern") for option in prop.get("anyOf", [])]
        assert pattern in patterns, (path, field, prop)


# -- 9: a session's K belongs to its frame size ------------------------------------------------------------------


@pytest.mark.slow
def test_a_frame_of_another_size_must_bring_its_K(client, enc):
    sid = register(client, enc)["session_id"]
    h, w = FRAME_HW
    half = {"rgb": ("rgb.png", codecs.encode_rgb_png(enc.frame.rgb[::2, ::2])),
            "depth": ("depth.png", codecs.encode_depth_png_mm(enc.frame.depth_m[::2, ::2]))}
    refused = client.post("/track", data={"session_id": sid}, files=half)
    assert_error(refused, 422, "InputError", "K", rf"^K: expected the K of this {w // 2}x{h // 2} frame \(the "
                                                  rf"session's K is for {w}x{h} frames\); got no K\. Send K")
    assert client.get(f"/sessions/{sid}").json()["frames"] == 0
    K_half = enc.frame.K.copy()
    K_half[:2] *= 0.5
    ok = client.post("/track", data={"session_id": sid, "K": json.dumps(K_half.tolist())}, files=half)
    assert ok.status_code == 200, ok.text
    assert client.post("/track", data={"session_id": sid}, files=enc.track_files()).status_code == 200


# -- 10: the session cap is named ---------------------------------------------------------------------------------


def test_a_full_session_cap_is_named_in_the_answer():
    info = errors.classify(SessionLimitError("the session cap is reached: all 2 tracking sessions have a request "
                                             "in progress"), retry_after_s=3)
    assert info.status == 503 and info.type == "SessionLimitError" and ("Retry-After", "3") in info.headers
    assert info.message.startswith("the session cap is reached: all 2 tracking sessions") and "pipeline" not in info.message


# -- 11: the schema and the method answers tell the truth -----------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [("OPTIONS", "/objects", "GET, POST"), ("PUT", "/objects", "GET, POST"), ("OPTIONS", "/objects/block", "DELETE, GET"),
     ("OPTIONS", "/sessions/abc", "DELETE, GET"), ("GET", "/track", "POST")],
)
def test_405_lists_every_method_of_the_path(client, method, path, allow):
    response = client.request(method, path)
    assert response.status_code == 405 and response.headers["allow"] == allow


def test_an_empty_K_says_what_K_must_be(client, enc):
    assert_error(_register(client, enc, K=""), 422, "InputError", "K",
                 r"^K: expected a JSON 3x3 array \[\[fx, 0, cx\], \[0, fy, cy\], \[0, 0, 1\]\] in pixels; got nothing "
                 r"\(the field is missing or empty\)$")


def test_the_track_schema_states_that_session_id_excludes_the_stateless_fields(client):
    schema = client.get("/openapi.json").json()
    ref = schema["paths"]["/track"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]["$ref"]
    body = schema["components"]["schemas"][ref.rsplit("/", 1)[-1]]
    assert body["not"] == {"anyOf": [{"required": ["session_id", "pose"]}, {"required": ["session_id", "object_id"]}]}


def test_a_malformed_multipart_body_is_a_documented_422(client):
    response = client.post("/register", content=b"--x\r\nnot a part", headers={"Content-Type": "multipart/form-data"})
    assert_error(response, 422, "InputError", "body", r"^body: expected a multipart/form-data body; got one that "
                                                      r"cannot be parsed")
    documented = client.get("/openapi.json").json()["paths"]["/register"]["post"]["responses"]
    assert "400" not in documented and "malformed multipart" in documented["422"]["description"]


# -- 12: mesh errors in our words -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "data", "pattern"),
    [
        ("bad.obj", b"v 0 0 0\nv 1 0 0\nv 0 1 0\nf 1 2 9\n",
         r"^mesh: expected a mesh file in OBJ format; got faces that refer to vertices the file does not have$"),
        ("bad.ply", b"ply\nformat binary_little_endian 1.0\nelement vertex 3\nproperty float x\nproperty float y\n"
                    b"property float z\nelement face 1\nproperty list uchar int vertex_indices\nend_header\n\0\0",
         r"^mesh: expected a mesh file in PLY format; got a file that is not a valid PLY \(truncated or corrupt\)$"),
        ("points.obj", b"v 0 0 0\nv 1 0 0\nv 0 1 0\n",
         r"^mesh: expected a triangle mesh; got vertices without faces \(a point cloud\)$"),
    ],
)
def test_broken_meshes_are_described_not_dumped(client, caplog, name, data, pattern):
    with caplog.at_level("INFO", logger="server.objects"):
        response = client.post("/objects", data={"object_id": "broken"}, files={"mesh": (name, data)})
    body = assert_error(response, 422, "InputError", "mesh", pattern)
    assert "Error" not in body["message"] and "index" not in body["message"]
    if name != "points.obj":
        assert "trimesh could not read" in caplog.text  # the library's own words stay in the server log
    assert client.get("/objects/broken").status_code == 404


def test_a_look_alike_directory_with_a_newline_is_not_loaded_at_start(tmp_path, caplog):
    from foundationpose.synthetic.meshes import make_procedural_mesh
    from server.objects import ObjectRegistry

    make_procedural_mesh("plain_asym").export(tmp_path / "block.ply")
    (tmp_path / "block\n").mkdir()
    make_procedural_mesh("plain_asym").export(tmp_path / "block\n" / "model.obj")
    with caplog.at_level("WARNING", logger="server.objects"):
        assert ObjectRegistry(tmp_path).load_all() == ["block"]
    assert "does not match" in caplog.text
