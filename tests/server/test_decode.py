"""The PNG decode of a request: fast paths == their reference twins bit for bit, concurrent == sequential,
the same first error either way, and never on the event loop."""

from __future__ import annotations

import asyncio
import io
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from foundationpose.errors import InputError
from server import codecs
from server.client import depth_mm
from server.flow.frames import FrameBytes, decode_frame
from server.phases import Phases
from tests.server._helpers import MAX_IMAGE_HW, register

HW = (48, 64)


def _png(array: np.ndarray, **save) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG", **save)
    return out.getvalue()


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(2, thread_name_prefix="test-decode") as executor:
        yield executor


def _rgb(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*HW, 3), dtype=np.uint8)


def _depth_png(seed: int = 0) -> bytes:
    depth_m = np.random.default_rng(seed).uniform(0.3, 2.0, HW).astype(np.float32)
    depth_m[:4] = 0.0  # no reading
    return _png(depth_mm(depth_m))


@pytest.mark.parametrize("decoder", ["imagecodecs", "opencv"])
@pytest.mark.parametrize("kind", ["RGB", "RGBA", "RGB+tRNS", "L", "P", "JPEG"])
def test_rgb_decode_equals_the_reference_twin(kind, decoder, monkeypatch):
    if decoder == "imagecodecs" and not codecs.FAST_PNG:
        pytest.skip("imagecodecs is not installed (the server extra)")
    monkeypatch.setattr(codecs, "FAST_PNG", decoder == "imagecodecs")
    rgb = _rgb(1)
    if kind == "JPEG":
        out = io.BytesIO()
        Image.fromarray(rgb).save(out, format="JPEG", quality=90)
        data = out.getvalue()
    elif kind == "RGB+tRNS":
        data = _png(rgb, transparency=tuple(int(v) for v in rgb[0, 0]))
    else:
        data = _png(np.asarray(Image.fromarray(rgb).convert(kind)))
    decoded = codecs.decode_rgb(data, MAX_IMAGE_HW)
    assert decoded.shape == (*HW, 3) and decoded.dtype == np.uint8 and decoded.flags.writeable
    np.testing.assert_array_equal(decoded, codecs.rgb_pixels_reference(data))


@pytest.mark.parametrize("decoder", ["imagecodecs", "opencv"])
def test_depth_decode_equals_the_reference_twin(decoder, monkeypatch):
    if decoder == "imagecodecs" and not codecs.FAST_PNG:
        pytest.skip("imagecodecs is not installed (the server extra)")
    monkeypatch.setattr(codecs, "FAST_PNG", decoder == "imagecodecs")
    data = _depth_png(2)
    decoded = codecs.decode_depth(data, MAX_IMAGE_HW)
    assert decoded.dtype == np.float32 and decoded.shape == HW
    np.testing.assert_array_equal(decoded, codecs.depth_pixels_reference(data))
    assert (decoded[:4] == 0).all() and decoded[4:].min() >= 0.3 - 5e-4


def test_millimetres_to_metres_in_one_pass_equals_astype_then_divide():
    mm = np.arange(0, 65536, dtype=np.uint16).reshape(256, 256)
    np.testing.assert_array_equal(codecs.depth_m_from_mm(mm), mm.astype(np.float32) / np.float32(1000.0))
    big_endian = mm.astype(">u2")  # a raw frame's view keeps its declared byte order
    np.testing.assert_array_equal(codecs.depth_m_from_mm(big_endian), mm.astype(np.float32) / np.float32(1000.0))


@pytest.mark.parametrize("depth_kind", ["png", "npy", "raw_uint16", "raw_float32"])
def test_concurrent_decode_equals_sequential_bit_for_bit(pool, depth_kind):
    rgb = _rgb(3)
    depth_m = np.random.default_rng(3).uniform(0.3, 2.0, HW).astype(np.float32)
    depth = {"png": _png(depth_mm(depth_m)), "npy": codecs.encode_depth_npy(depth_m),
             "raw_uint16": depth_mm(depth_m).tobytes(), "raw_float32": depth_m.tobytes()}[depth_kind]
    raw = depth_kind.startswith("raw")
    frame = FrameBytes(_png(rgb), depth, codecs.encode_mask_png(depth_m > 1.0),
                                 depth_shape=f"{HW[0]},{HW[1]}" if raw else None,
                                 depth_dtype=depth_kind.removeprefix("raw_") if raw else None)
    sequential = decode_frame(frame, MAX_IMAGE_HW, Phases(), with_mask=True)
    for _ in range(3):
        concurrent = decode_frame(frame, MAX_IMAGE_HW, Phases(), with_mask=True, pool=pool)
        for a, b in zip(sequential, concurrent, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(concurrent.rgb, rgb)


def test_the_first_error_is_the_same_with_and_without_the_pool(pool):
    good_rgb, good_depth = _png(_rgb()), _depth_png()
    cases = {"rgb": FrameBytes(b"not an image", b"not a depth map either"),
             "depth": FrameBytes(good_rgb, good_rgb),  # an 8-bit colour PNG as depth
             "mask": FrameBytes(good_rgb, good_depth, b"")}
    for field, frame in cases.items():
        messages = []
        for executor in (None, pool):
            with pytest.raises(InputError) as info:
                decode_frame(frame, MAX_IMAGE_HW, Phases(), with_mask=True, pool=executor)
            assert info.value.field == field
            messages.append(str(info.value))
        assert messages[0] == messages[1]


def test_a_shut_down_pool_decodes_in_the_calling_thread():
    executor = ThreadPoolExecutor(1)
    executor.shutdown()
    frame = FrameBytes(_png(_rgb()), _depth_png())
    rgb, depth, _ = decode_frame(frame, MAX_IMAGE_HW, Phases(), pool=executor)
    np.testing.assert_array_equal(rgb, _rgb())
    np.testing.assert_array_equal(depth, codecs.depth_pixels_reference(_depth_png()))


@pytest.mark.slow
def test_decoding_runs_off_the_event_loop_in_the_servers_decode_pool(client, enc, monkeypatch):
    """The rgb decodes in a worker thread, the depth in the app's decode pool; neither runs an event loop."""
    seen: list[tuple[str, str, bool]] = []
    lock = threading.Lock()

    def spy(name, real):
        def decode(*args, **kwargs):
            with lock:
                seen.append((name, threading.current_thread().name, _loop_running()))
            return real(*args, **kwargs)
        return decode

    monkeypatch.setattr(codecs, "decode_rgb", spy("rgb", codecs.decode_rgb))
    monkeypatch.setattr(codecs, "decode_depth", spy("depth", codecs.decode_depth))
    sid = register(client, enc)["session_id"]
    response = client.post("/track", data={"session_id": sid}, files=enc.track_files())
    assert response.status_code == 200, response.text
    assert len(seen) == 4 and not any(running for _, _, running in seen)
    assert client.app.state.fp.decode_pool is not None
    assert all(thread.startswith("fp-decode") for name, thread, _ in seen if name == "depth")
    assert all(not thread.startswith("fp-decode") and thread != "MainThread" for name, thread, _ in seen if name == "rgb")


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def test_mm_in_range_is_the_range_check_of_the_converted_map_for_every_uint16_value():
    """The ingest workers' range check of a raw uint16 depth (from its largest pixel) against the check of the
    metres it converts to, for every value a pixel can hold as the map's largest, and on maps mixing in-range and
    out-of-range values: too far (millimetres passed as metres) and too near (metres written as millimetres) are
    both "not in range", so the GPU process validates those fully."""
    from foundationpose.validate import depth_in_range

    every = np.arange(65536, dtype=np.uint16)
    metres = codecs.depth_m_from_mm(every)
    per_value = np.array([codecs.mm_in_range(int(v)) for v in every[::7]])
    assert (per_value == np.array([depth_in_range(metres[i:i + 1]) for i in range(0, 65536, 7)])).all()
    assert not codecs.mm_in_range(19) and codecs.mm_in_range(20) and codecs.mm_in_range(0)  # 0: no reading at all
    rng = np.random.default_rng(3)
    for largest in (5, 20, 49999, 50000, 50001, 65535):
        depth = rng.integers(0, largest + 1, (6, 9)).astype(np.uint16)
        depth[2, 3] = largest
        assert codecs.mm_in_range(int(depth.max())) == depth_in_range(codecs.depth_m_from_mm(depth))
    assert codecs.mm_in_range(50000) and not codecs.mm_in_range(50001)


@pytest.mark.parametrize("largest_mm", [1, 2, 19])
def test_metres_saved_as_millimetres_are_refused_with_a_hint(largest_mm):
    """A 16-bit depth whose readings all lie within 20 mm holds metres written as integers (0.5 m -> 0 or 1 "mm"):
    refused by the validation step, PNG or raw, naming depth."""
    from foundationpose.validate import InputLimits
    from server.flow.validation import track_request

    depth = np.zeros(HW, np.uint16)
    depth[10:20, 10:20] = largest_mm
    K = np.array([[100.0, 0, HW[1] / 2], [0, 100.0, HW[0] / 2], [0, 0, 1]])
    pose = np.eye(4)
    pose[2, 3] = 0.5
    for frame in (FrameBytes(_png(_rgb()), _png(depth)),
                  FrameBytes(_png(_rgb()), depth.tobytes(), depth_shape=list(HW), depth_dtype="uint16")):
        with pytest.raises(InputError, match=r"^depth: .*Depth in metres saved as millimetres\?") as info:
            track_request(frame, K, pose, "mesh", session_K=None, session_hw=None, max_hw=MAX_IMAGE_HW,
                          limits=InputLimits(max_image_hw=MAX_IMAGE_HW), phases=Phases())
        assert info.value.field == "depth"
