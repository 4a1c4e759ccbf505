"""Ingest workers (:mod:`server.ingest`): the frame ring and the socket protocol as units, then real worker
processes on a real track port in front of the tiny CPU app: answers equal to the main port's (``POST /track/binary``
and ``WS /track/stream``), the errors, a full ring, concurrency, restart after a kill and a clean shutdown.

One app with two workers serves most tests (a worker process costs ~1-2 s to start); the API-key / one-slot
app and the lifecycle app are started once each.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from deploy_core.memory.ring import FrameRing, check_room, default_ring_dir, slot_bytes
from server import create_app
from server.client import BINARY_HEADERS, depth_mm, track_body
from server.flow import wire
from server.flow.inputs import TrackInput
from server.flow.message import pack_message
from server.ingest.protocol import MAX_HEADER_BYTES, WORKER_HEADER, ProtocolError, pack, read_message
from tests.server._helpers import (
    FRAME_HW,
    MAX_IMAGE_HW,
    READY_TIMEOUT_S,
    SETUP_WAIT_S,
    assert_error,
    assert_ready,
    assert_rigid,
    register,
    tiny_config,
    write_objects_dir,
)

KEY = {"Authorization": "Bearer s3cret"}
MAX_UPLOAD = 256 * 1024  # a 96x128 raw track body is ~61 kB
# the safety net of every wait for a state in a test (normally reached in < 2 s): a worker's (re)start on a loaded
# 2-core machine running the full suite can take over 30 s; set-up waits use SETUP_WAIT_S
WAIT_S = 300.0


def _until(predicate: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    """Poll ``predicate`` until it holds; fail naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout:.0f} s: {what}")
        time.sleep(0.01)


def _answers_200(url: str) -> bool:
    """Whether ``url`` answers 200 now (a connection refused or a reply slower than 30 s, on a loaded machine:
    not yet)."""
    try:
        return httpx.get(url, timeout=30.0).status_code == 200
    except httpx.TransportError:
        return False


def _rings() -> set[Path]:
    return set(default_ring_dir().glob("fp-ingest-*.ring"))


def _is_worker(pid: int) -> bool:
    """Whether ``pid`` is (still) a running ingest worker (a reaped pid may be reused by anything else)."""
    try:
        return b"server.ingest.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False


@dataclass
class Served:
    """An app with ingest workers: the main port's TestClient and an httpx client on the track port."""

    app: object
    client: TestClient
    ingest: httpx.Client

    @property
    def state(self):
        return self.app.state.fp

    def on_loop(self, fn: Callable[[], object]) -> object:
        """``fn()`` on the app's event loop (the hub's sets are the loop's to read)."""
        return self.client.portal.call(fn)

    def track(self, body: bytes, headers: dict | None = None, client: httpx.Client | None = None) -> httpx.Response:
        return (client or self.ingest).post("/track/binary", content=body,
                                            headers=BINARY_HEADERS if headers is None else headers)


@contextlib.contextmanager
def _serve(estimator, objects_dir: Path, **overrides) -> Iterator[Served]:
    config = tiny_config(objects_dir, ingest_port=0, warmup=False, track_latency_budget_s=0, **overrides)
    app = create_app(config, estimator=estimator)
    with TestClient(app) as client:
        state = app.state.fp
        assert_ready(state, f"the app with {config.ingest_workers} ingest workers")
        _until(lambda: client.portal.call(lambda: state.ingest.connected) == config.ingest_workers,
               f"every worker ({config.ingest_workers}) connected to the hub", timeout=SETUP_WAIT_S)
        with httpx.Client(base_url=f"http://127.0.0.1:{state.ingest_workers.port}", timeout=60.0) as ingest:
            yield Served(app, client, ingest)


@pytest.fixture(scope="module")
def served(tiny_estimator, tmp_path_factory) -> Iterator[Served]:
    """Two workers, eight slots each, no API key."""
    with _serve(tiny_estimator, write_objects_dir(tmp_path_factory.mktemp("objects")), ingest_workers=2,
                max_upload_bytes=MAX_UPLOAD) as s:
        yield s


# -- units: the ring ---------------------------------------------------------------------------------------------------
def test_rings_that_do_not_fit_in_shared_memory_are_refused_before_the_workers_start(tmp_path):
    st = os.statvfs(tmp_path)
    free_mib = st.f_bavail * st.f_frsize / 2**20
    slots = int(free_mib * 2**20 // slot_bytes((480, 640))) + 1  # one slot more than fits
    with pytest.raises(OSError, match=rf"^ingest frame rings: \d+ MiB needed in {re.escape(str(tmp_path))} \(1 workers x "
                                      rf"{slots} slots of 640x480\), \d+ MiB free: fewer ingest_slots \(--config file\)"):
        check_room(1, slots, (480, 640), tmp_path)
    check_room(1, 1, (480, 640), tmp_path)  # one slot fits


def test_ring_round_trip_between_two_mappings_with_independent_slots(tmp_path):
    ring = FrameRing.create(3, (8, 10), directory=tmp_path)
    try:
        assert ring.path.parent == tmp_path and ring.path.name.startswith("fp-ingest-")
        # rgb 240 -> 256, depth 320 aligned, mask 80 -> 128
        assert ring.path.stat().st_size == 3 * slot_bytes((8, 10)) == 3 * (256 + 320 + 128)
        peer = FrameRing.open(ring.path, 3, (8, 10))
        rng = np.random.default_rng(0)
        frames = {}
        for slot, hw in ((0, (8, 10)), (2, (5, 7))):  # a full-size frame and a smaller one
            rgb = rng.integers(0, 256, (*hw, 3), dtype=np.uint8)
            depth = rng.random(hw, dtype=np.float32)
            ring.write(slot, rgb, depth)
            frames[slot] = (rgb, depth)
        for slot, (rgb, depth) in frames.items():  # the other mapping sees each slot as written
            np.testing.assert_array_equal(peer.rgb(slot, rgb.shape[:2]), rgb)
            np.testing.assert_array_equal(peer.depth(slot, depth.shape), depth)
        assert not peer.rgb(1, (8, 10)).any() and not peer.depth(1, (8, 10)).any()  # slot 1 untouched
        ring.write(1, np.full((8, 10, 3), 7, np.uint8), np.full((8, 10), 2.5, np.float32))
        np.testing.assert_array_equal(peer.rgb(0, (8, 10)), frames[0][0])  # writing a slot leaves the others
        np.testing.assert_array_equal(peer.depth(2, (5, 7)), frames[2][1])
        assert (peer.rgb(1, (8, 10)) == 7).all() and (peer.depth(1, (8, 10)) == 2.5).all()
        with pytest.raises(ValueError, match=r"^slot 3 out of range 0\.\.2$"):
            peer.rgb(3, (8, 10))
        with pytest.raises(ValueError, match=r"^frame 11x8 does not fit the ring's 10x8 slots$"):
            peer.depth(0, (8, 11))
    finally:
        ring.unlink()


@pytest.mark.parametrize("depth_dtype", ["uint16", "float32"])
def test_raw_frames_decode_straight_into_a_slot_as_the_main_port_decodes_them(tmp_path, enc, depth_dtype):
    from server.flow.frames import FrameBytes, decode_frame
    from server.ingest.relay import slot_views
    from server.phases import Phases

    frame = enc.frame
    h, w = frame.depth_m.shape
    depth = depth_mm(frame.depth_m) if depth_dtype == "uint16" else frame.depth_m.astype(np.float32)
    mask = (frame.mask > 0).astype(np.uint8)
    raw = FrameBytes(rgb=frame.rgb.tobytes(), depth=depth.tobytes(), mask=mask.tobytes(), rgb_shape=[h, w, 3],
                     depth_shape=[h, w], depth_dtype=depth_dtype, mask_shape=[h, w])
    ring = FrameRing.create(2, MAX_IMAGE_HW, directory=tmp_path)
    try:
        phases = Phases()
        into = decode_frame(raw, MAX_IMAGE_HW, phases, with_mask=True, into=partial(slot_views, ring, 1, with_mask=True))
        assert (into.hw, into.in_range) == ((h, w), True)  # depth in range
        assert set(phases.ms) == {"decode", "validate"}
        ref = decode_frame(raw, MAX_IMAGE_HW, Phases(), with_mask=True)  # the main port's
        np.testing.assert_array_equal(ring.rgb(1, (h, w)), ref.rgb)
        assert np.array_equal(ring.depth(1, (h, w)), ref.depth)  # bit for bit (the same float32 mm / 1000)
        np.testing.assert_array_equal(ring.mask(1, (h, w)), ref.mask)
        for bad in (np.nan, -0.5, 1e4):  # the GPU process's validation then checks (and answers) the values
            odd = frame.depth_m.astype(np.float32)
            odd[1, 2] = bad
            odd_raw = FrameBytes(rgb=frame.rgb.tobytes(), depth=odd.tobytes(), rgb_shape=[h, w, 3], depth_shape=[h, w],
                                 depth_dtype="float32")
            out = decode_frame(odd_raw, MAX_IMAGE_HW, Phases(), into=partial(slot_views, ring, 0))
            assert (out.hw, out.in_range) == ((h, w), False), bad
    finally:
        ring.unlink()


def test_a_worker_decodes_raw_frames_on_its_loop_and_encoded_ones_in_a_thread(tmp_path, enc, monkeypatch):
    """Raw frames are copied on the event loop's thread, with the result a thread gives; a PNG frame decodes in a
    worker thread (the codecs run for milliseconds without the GIL)."""
    from server.flow.frames import FrameBytes
    from server.ingest import relay
    from server.phases import Phases

    frame = enc.frame
    h, w = frame.depth_m.shape
    raw = FrameBytes(rgb=frame.rgb.tobytes(), depth=depth_mm(frame.depth_m).tobytes(), rgb_shape=[h, w, 3],
                     depth_shape=[h, w], depth_dtype="uint16")
    png = FrameBytes(rgb=enc.rgb, depth=enc.depth_png)
    ring = FrameRing.create(4, MAX_IMAGE_HW, directory=tmp_path)
    where: list[str] = []
    real = relay.decode_frame

    def spy(*args, **kwargs):
        where.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(relay, "decode_frame", spy)

    async def go() -> list:
        loop_thread = threading.current_thread().name
        out = [await relay.decode_into_slot(ring, slot, f, MAX_IMAGE_HW, Phases()) for slot, f in ((0, raw), (2, png))]
        return [loop_thread, *out]

    try:
        loop_thread, raw_out, png_out = asyncio.run(go())
        assert where[0] == loop_thread and where[1] != loop_thread
        assert (raw_out.hw, raw_out.in_range) == (png_out.hw, png_out.in_range) == ((h, w), True)
        assert np.array_equal(ring.rgb(0, (h, w)), ring.rgb(2, (h, w)))  # the PNG holds the same pixels
        assert np.array_equal(ring.depth(0, (h, w)), ring.depth(2, (h, w)))
    finally:
        ring.unlink()


def test_ring_acquire_release_size_check_and_unlink(tmp_path):
    ring = FrameRing.create(2, (4, 4), directory=tmp_path)
    assert slot_bytes((4, 4)) == 64 + 64 + 64  # rgb 48 bytes -> one 64-byte line, depth 64, mask 16 -> 64
    a, b = ring.acquire(), ring.acquire()
    assert {a, b} == {0, 1} and ring.busy == 2
    assert ring.acquire() is None  # all busy
    ring.release(a)
    assert ring.busy == 1 and ring.acquire() == a
    ring.release(b)
    with pytest.raises(ValueError, match=rf"^slot {b} is not a busy slot of this ring$"):
        ring.release(b)  # already free
    with pytest.raises(ValueError, match=r"^slot 2 is not a busy slot"):
        ring.release(2)
    with pytest.raises(ValueError, match=r"ingest frame ring .*: 384 bytes, expected 576 \(3 slots of \(4, 4\)\)"):
        FrameRing.open(ring.path, 3, (4, 4))
    with pytest.raises(ValueError, match=r"^slots must be >= 1, got 0$"):
        FrameRing.create(0, (4, 4), directory=tmp_path)
    peer = FrameRing.open(ring.path, 2, (4, 4))
    ring.unlink()
    assert not ring.path.exists()
    ring.unlink()  # a missing file is fine
    ring.write(1, np.full((4, 4, 3), 9, np.uint8), np.full((4, 4), 0.75, np.float32))  # both mappings live on
    assert (peer.rgb(1, (4, 4)) == 9).all() and (peer.depth(1, (4, 4)) == 0.75).all()
    assert list(tmp_path.iterdir()) == []


# -- units: the protocol -----------------------------------------------------------------------------------------------
def _read(data: bytes, eof: bool = True):
    async def go():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        if eof:
            reader.feed_eof()
        return [await read_message(reader), await read_message(reader) if eof else None]

    return asyncio.run(go())


def test_protocol_round_trip_and_clean_end():
    track = {"op": "track", "id": 7, "slot": 2, "hw": [96, 128], "K": None, "phases": {"decode": 1.5}}
    answer = {"op": "answer", "id": 7, "status": 200, "headers": [["x-request-id", "abc"]]}

    async def go():
        reader = asyncio.StreamReader()
        reader.feed_data(pack(track) + pack(answer, b'{"pose": []}'))
        reader.feed_eof()
        return [await read_message(reader) for _ in range(3)]

    assert asyncio.run(go()) == [(track, b""), (answer, b'{"pose": []}'), None]  # then None: a clean end
    message = pack({"op": "ready"}, b"xyz")
    assert struct.unpack_from("<II", message) == (len(b'{"op":"ready"}'), 3)


def test_answers_of_one_loop_iteration_reach_their_worker_in_one_write(caplog):
    """The hub's connection queues answers and writes those of one event-loop iteration together (a batch of poses
    completes at once); the next iteration's go in their own write; a connection closing meanwhile drops them,
    logged."""
    from server.ingest.hub import _Connection

    class Writer:
        def __init__(self) -> None:
            self.writes: list[bytes] = []
            self.closing = False

        def write(self, data: bytes) -> None:
            self.writes.append(data)

        def is_closing(self) -> bool:
            return self.closing

    async def go() -> Writer:
        writer = Writer()
        conn = _Connection(123, ring=None, writer=writer, pinned=False)
        for i in range(3):
            conn.send(pack({"op": "answer", "id": i}))
        assert writer.writes == []  # nothing written inside the iteration that queued them
        await asyncio.sleep(0)  # one loop iteration
        conn.send(pack({"op": "answer", "id": 3}))
        await asyncio.sleep(0)
        writer.closing = True
        conn.send(pack({"op": "answer", "id": 4}))
        await asyncio.sleep(0)
        return writer

    with caplog.at_level(logging.INFO, logger="server.ingest.hub"):
        writer = asyncio.run(go())
    assert writer.writes == [b"".join(pack({"op": "answer", "id": i}) for i in range(3)), pack({"op": "answer", "id": 3})]
    assert "ingest worker 123 went away before" in caplog.text


def test_protocol_errors_are_protocol_errors():
    whole = pack({"op": "answer", "id": 1}, b"body")
    for cut in (3, 9, len(whole) - 1):  # inside the prefix, inside the header, inside the body
        with pytest.raises(ProtocolError, match=r"^connection closed inside a message"):
            _read(whole[:cut])
    with pytest.raises(ProtocolError, match=r"^header is not JSON"):
        _read(struct.pack("<II", 5, 0) + b"{nope")
    with pytest.raises(ProtocolError, match=r"^header must be a JSON object with an 'op'$"):
        _read(struct.pack("<II", 2, 0) + b"[]")
    with pytest.raises(ProtocolError, match=r"^header must be a JSON object with an 'op'$"):
        _read(struct.pack("<II", 9, 0) + b'{"op": 1}')
    # an oversize length is refused from the prefix alone, before waiting for (or buffering) that many bytes
    with pytest.raises(ProtocolError, match=rf"^message too large: header {MAX_HEADER_BYTES + 1} bytes, body 0"):
        _read(struct.pack("<II", MAX_HEADER_BYTES + 1, 0), eof=False)
    with pytest.raises(ProtocolError, match=r"^message too large: header 2 bytes, body 4294967295 bytes$"):
        _read(struct.pack("<II", 2, 2**32 - 1), eof=False)


def test_the_hub_page_locks_for_the_configured_device_while_the_networks_still_load(tmp_path):
    """Workers connect during start-up, before the estimator exists: the hub's device is then the configured one
    (it was None, and no ring was ever page-locked on the H200)."""
    import torch

    from deploy_core.memory.ring import pin_ring
    from server.config import ServerConfig
    from server.ingest.hub import IngestHub
    from server.state import ServerState

    loading = ServerState(ServerConfig(objects_dir=".", device="cpu"))  # not started: no estimator yet
    assert loading.estimator is None
    hub = IngestHub(loading, tmp_path / "hub.sock")
    assert hub._device() == torch.device("cpu")
    if not torch.cuda.is_available():  # a device that cannot be had: no page-locking, the start-up says why
        no_cuda = ServerState(ServerConfig(objects_dir=".", device="cuda"))
        assert IngestHub(no_cuda, tmp_path / "other.sock")._device() is None
    ring = FrameRing.create(1, (4, 4), tmp_path)
    try:
        assert pin_ring(ring, hub._device()) is False  # the CPU: frames are staged as they are
    finally:
        ring.unlink()


# -- parity with the main port -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_readyz_names_the_track_port_and_its_workers(served, client):
    ready = served.client.get("/readyz").json()
    assert ready["ingest"] == {"port": served.state.ingest_workers.port, "workers": 2, "connected": 2,
                              "page_locked": 0}  # CPU: frames are staged as they are
    assert client.get("/readyz").json()["ingest"] is None  # a server without ingest workers


@pytest.mark.slow
def test_a_stateless_track_answers_as_on_the_main_port(served, enc):
    frame = enc.frame
    start = register(served.client, enc)["pose"]
    body = track_body(frame.rgb, frame.depth_m, object_id="block", pose=np.asarray(start), K=frame.K)
    main = served.client.post("/track/binary", content=body, headers=BINARY_HEADERS)
    assert main.status_code == 200, main.text
    ingest = served.track(body)
    assert ingest.status_code == 200, ingest.text
    assert ingest.headers["content-type"] == "application/json"
    assert ingest.json()["pose"] == main.json()["pose"]  # the CPU path is bit-identical
    assert ingest.json()["session_id"] is None and ingest.json()["frame"] is None
    assert_rigid(ingest.json()["pose"])
    timings = ingest.json()["timings_ms"]  # the worker's receive/parse/decode, then the GPU process's phases
    assert {"receive", "parse", "decode", "validate", "queue", "pipeline"} <= set(timings)
    assert ingest.headers["x-request-id"] and ingest.headers["x-request-id"] != main.headers["x-request-id"]


@pytest.mark.slow
def test_a_session_registered_on_the_main_port_tracks_through_the_ingest_port(served, enc):
    frame = enc.frame
    sid = register(served.client, enc)["session_id"]
    before = served.on_loop(lambda: served.state.ingest.requests)
    poses = []
    for expected in (1, 2, 3):
        K = frame.K if expected == 2 else None  # K is optional with a session
        response = served.track(track_body(frame.rgb, frame.depth_m, session_id=sid, K=K))
        assert response.status_code == 200, response.text
        assert (response.json()["session_id"], response.json()["frame"]) == (sid, expected)
        poses.append(assert_rigid(response.json()["pose"]))
    session = served.client.get(f"/sessions/{sid}").json()
    assert session["frames"] == 3
    np.testing.assert_array_equal(session["pose"], poses[-1])
    # the main port's track goes on from the ingest port's frames
    assert served.client.post("/track", data={"session_id": sid}, files=enc.track_files()).json()["frame"] == 4
    assert served.on_loop(lambda: served.state.ingest.requests) == before + 3
    metrics = served.client.get("/metrics").text
    assert "fp_ingest_workers_connected 2" in metrics
    assert 'fp_http_requests_total{endpoint="/track/binary",method="POST",status="200"}' in metrics


# -- errors ------------------------------------------------------------------------------------------------------------
def _error(response: httpx.Response, status: int, type_: str, field: str | None, match: str) -> dict:
    body = assert_error(response, status, type_, field, match)
    assert set(body) <= {"type", "message", "request_id", "field"}, body
    assert response.headers["content-type"] == "application/json"
    return body


@pytest.mark.slow
def test_errors_are_the_main_ports_answers(served, enc):
    frame = enc.frame
    sid = register(served.client, enc)["session_id"]
    far = np.eye(4)
    far[2, 3] = 500.0
    negative, millimetres = frame.depth_m.astype(np.float32), frame.depth_m.astype(np.float32) * 1000
    negative[3, 4] = -0.25
    cases = [  # (body, headers, status, type, field, message): found by the worker, then by the GPU process
        (b"\x05\x00", None, 422, "InputError", "message", r"^message: expected uint32"),
        (pack_message({"session_id": sid}, {"rgb": frame.rgb}), None, 422, "InputError", "depth",
         r"^depth: expected a part named 'depth'"),
        (track_body(frame.rgb, frame.depth_m, session_id=sid),
         {"Content-Type": "multipart/form-data; boundary=x"}, 415, "UnsupportedMediaTypeError", "Content-Type",
         r"^Content-Type: expected application/octet-stream"),
        (track_body(frame.rgb, frame.depth_m, session_id=sid), {}, 415, "UnsupportedMediaTypeError",
         "Content-Type", r"^Content-Type: expected application/octet-stream"),
        (pack_message({"session_id": sid}, {"rgb": np.zeros((MAX_IMAGE_HW[0] + 1, MAX_IMAGE_HW[1], 3), np.uint8),
                                            "depth": np.zeros((MAX_IMAGE_HW[0] + 1, MAX_IMAGE_HW[1]), np.uint16)}),
         None, 413, "ImageTooLargeError", "rgb", r"^rgb"),
        (pack_message({"session_id": sid}, {"rgb": frame.rgb, "depth": depth_mm(frame.depth_m)[:-1]}), None, 422,
         "InputError", "depth", r"^depth: expected the size of rgb, 96x128 \(HxW\); got a 95x128 raw uint16 array"),
        (pack_message({"session_id": sid}, {"rgb": enc.rgb, "depth": enc.depth_png[:40]}), None, 422,
         "InputError", "depth", r"^depth"),  # a cut PNG: found by the worker's decode
        (pack_message({"session_id": sid}, {"rgb": frame.rgb[:-1], "depth": depth_mm(frame.depth_m)[:-1]}), None,
         422, "InputError", "K", r"^K: expected the K of this 128x95 frame"),  # found by the GPU process
        (_raw_message(sid, frame.rgb.tobytes()[:-3], [*frame.rgb.shape], depth_mm(frame.depth_m)), None, 422,
         "InputError", "rgb", r"^rgb: expected \d+ bytes of raw uint8"),  # a declared size the bytes do not fill
        (pack_message({"session_id": sid}, {"rgb": frame.rgb, "depth": negative}), None, 422, "InputError", "depth",
         r"^depth: expected non-negative metres"),  # out of range in the worker: checked by the GPU process
        (pack_message({"session_id": sid}, {"rgb": frame.rgb, "depth": millimetres}), None, 422, "InputError", "depth",
         r"^depth: expected metres \(median valid depth"),
        (track_body(frame.rgb, frame.depth_m, session_id="nosuchsession"), None, 404, "UnknownSessionError",
         None, r"^session_id: no session 'nosuchsession'"),
        (track_body(frame.rgb, frame.depth_m, object_id="block", pose=far, K=frame.K), None, 422, "InputError",
         "pose", r"^pose: expected a translation within"),
        (track_body(frame.rgb, frame.depth_m, object_id="nosuchobject", pose=np.eye(4), K=frame.K), None, 404,
         "UnknownObjectError", None, r"^object_id: no object 'nosuchobject'"),
    ]
    for body, headers, status, type_, field, match in cases:
        ingest = _error(served.track(body, headers), status, type_, field, match)
        main = served.client.post("/track/binary", content=body, headers=BINARY_HEADERS if headers is None else headers)
        assert {k: v for k, v in ingest.items() if k != "request_id"} == \
            {k: v for k, v in main.json()["error"].items() if k != "request_id"}, (ingest, main.text)
    assert served.client.get(f"/sessions/{sid}").json()["frames"] == 0  # no failed request changed the session


def _raw_message(session_id: str, rgb_bytes: bytes, rgb_shape: list[int], depth: np.ndarray) -> bytes:
    """A track message in the stream's container whose raw rgb part declares ``rgb_shape`` over ``rgb_bytes``."""
    parts = [{"name": "rgb", "nbytes": len(rgb_bytes), "shape": rgb_shape, "dtype": "uint8"},
             {"name": "depth", "nbytes": depth.nbytes, "shape": list(depth.shape), "dtype": "uint16"}]
    header = json.dumps({"session_id": session_id, "parts": parts}).encode()
    return struct.pack("<I", len(header)) + header + rgb_bytes + depth.tobytes()


def test_a_server_that_is_not_serving_answers_503_through_the_track_port(served, enc):
    frame = enc.frame
    state = served.state
    body = track_body(frame.rgb, frame.depth_m, object_id="block", pose=np.eye(4), K=frame.K)
    served.on_loop(lambda: setattr(state, "phase", "stopping"))  # what shutdown sets first
    try:
        refused = served.track(body)
    finally:
        served.on_loop(lambda: setattr(state, "phase", "ready"))
    _error(refused, 503, "NotReadyError", None, r"^the server is not ready: shutting down")
    assert refused.headers["retry-after"] == "1"
    assert served.track(body).status_code == 200  # serving again


def test_a_body_over_the_upload_limit_is_413(served):
    response = served.track(b"\0" * (MAX_UPLOAD + 1))
    _error(response, 413, "PayloadTooLargeError", None, rf".*{MAX_UPLOAD}")
    # a declared length over the limit is refused from the headers, before any of the body is sent
    status, body = _raw_post(served.state.ingest_workers.port, 1 << 40)
    assert status.startswith(b"HTTP/1.1 413 ") and body["error"]["type"] == "PayloadTooLargeError", (status, body)


def _error_but_its_id(answer: httpx.Response) -> dict:
    return {k: v for k, v in answer.json()["error"].items() if k != "request_id"}


def test_relayed_routes_are_refused_as_the_app_refuses_them(served):
    """Requests a worker does not serve go to the app whole: its 413 (the body read only to one byte over the
    limit), 404 and 405 (with every method of the path in Allow), with the app's request ids."""
    for method, path, body in (("POST", "/register/binary", b"\0" * (MAX_UPLOAD + 1)), ("GET", "/no/such/route", b""),
                               ("DELETE", "/readyz", b""), ("GET", "/track/binary", b"")):
        main = served.client.request(method, path, content=body, headers=BINARY_HEADERS)
        relayed = served.ingest.request(method, path, content=body, headers=BINARY_HEADERS)
        assert (relayed.status_code, relayed.headers.get("allow")) == (main.status_code, main.headers.get("allow"))
        assert main.status_code in (404, 405, 413), (path, main.text)
        assert _error_but_its_id(relayed) == _error_but_its_id(main), path
        assert relayed.json()["error"]["request_id"] == relayed.headers["x-request-id"]
        assert int(relayed.headers[WORKER_HEADER]) in served.state.ingest_workers.pids


def _ingest_http_count(served, status: int) -> int:
    """fp_ingest_http_requests_total of /track/binary with ``status`` on the main port's /metrics (0 when absent)."""
    text = served.client.get("/metrics").text
    found = re.search(rf'^fp_ingest_http_requests_total{{endpoint="/track/binary",status="{status}"}} (\d+)', text,
                      re.MULTILINE)
    return int(found.group(1)) if found else 0


@pytest.mark.slow
def test_the_workers_own_refusals_reach_the_main_ports_metrics(served):
    def refused() -> None:  # by the worker itself: the GPU process never sees it
        assert served.ingest.post("/track/binary", content=b"x", headers={"Content-Type": "text/plain"}).status_code == 415

    before = _ingest_http_count(served, 415)
    refused()  # once a report counts this one, it counts every earlier request too (reports are cumulative)
    _until(lambda: _ingest_http_count(served, 415) > before, "a first 415 reported")
    base = _ingest_http_count(served, 415)
    for _ in range(3):
        refused()
    _until(lambda: _ingest_http_count(served, 415) == base + 3, "the workers' three 415s counted on /metrics")


def test_the_workers_event_loops_reach_the_main_ports_metrics(served):
    """Each worker watches its own event loop (server.loop_watch) and reports the lag and stalls with its answer
    counts: /metrics sums them over the workers (two here, one beat each per 0.1 s)."""
    _until(lambda: _metric(served, "fp_ingest_event_loop_lag_seconds_count") >= 20,
           "both workers' loop beats on /metrics")
    text = served.client.get("/metrics").text
    assert re.search(r'^fp_ingest_event_loop_lag_seconds_bucket\{le="\+Inf"\} [1-9]', text, re.MULTILINE)
    assert _metric(served, "fp_ingest_event_loop_stalls_total") == 0
    assert _metric(served, "fp_ingest_event_loop_stalled") == 0
    assert _metric(served, "fp_event_loop_lag_seconds_count") > 0  # the GPU process's own loop, apart


def _raw_post(port: int, content_length: int) -> tuple[bytes, dict]:
    """(status line, JSON body) of the answer to a POST /track/binary that declares ``content_length`` and sends
    no body (httpx will not send a request whose body is shorter than its Content-Length)."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as raw:
        raw.sendall(b"POST /track/binary HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                    b"Content-Length: %d\r\n\r\n" % content_length)
        data = b""
        while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < int(
                re.search(rb"content-length: (\d+)", data.lower()).group(1)):
            chunk = raw.recv(65536)
            assert chunk, f"connection closed after {data!r}"
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0], json.loads(body)


@pytest.fixture(scope="module")
def guarded(tiny_estimator, tmp_path_factory) -> Iterator[Served]:
    """One worker with one slot, behind an API key."""
    with _serve(tiny_estimator, write_objects_dir(tmp_path_factory.mktemp("objects")), ingest_workers=1,
                ingest_slots=1, api_key="s3cret") as s:
        s.client.headers.update(KEY)  # the main port's requests (register); the ingest ones say what they send
        yield s


@pytest.mark.slow
def test_the_api_key_is_checked_by_the_worker(guarded, enc):
    frame = enc.frame
    body = track_body(frame.rgb, frame.depth_m, session_id="nosuchsession")
    for auth, message in ((None, r"^missing API key: send 'Authorization: Bearer <key>'$"),
                          ("s3cret", r"^missing API key"), ("Bearer wrong", r"^invalid API key$")):
        response = guarded.track(body, {**BINARY_HEADERS, **({"Authorization": auth} if auth else {})})
        _error(response, 401, "AuthError", None, message)
        assert response.headers["www-authenticate"] == "Bearer"
    # refused before the body is read: an oversize declared length without the key is a 401, not a 413
    status, answer = _raw_post(guarded.state.ingest_workers.port, 1 << 40)
    assert status.startswith(b"HTTP/1.1 401 ") and answer["error"]["type"] == "AuthError", (status, answer)
    # with the key the request reaches the GPU process (which knows no such session)
    _error(guarded.track(body, {**BINARY_HEADERS, **KEY}), 404, "UnknownSessionError", None, r"^session_id: no session")
    # the other routes are relayed to the app, which checks the key itself: /healthz is public, /readyz is not
    health = guarded.ingest.get("/healthz")
    assert health.status_code == 200 and health.json() == guarded.client.get("/healthz").json()
    assert int(health.headers[WORKER_HEADER]) in guarded.state.ingest_workers.pids  # the worker that relayed it
    _error(guarded.ingest.get("/readyz"), 401, "AuthError", None, r"^missing API key")
    assert guarded.ingest.get("/readyz", headers=KEY).json() == guarded.client.get("/readyz", headers=KEY).json()


# -- a full ring -------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_full_ring_answers_503_with_retry_after(guarded, enc):
    frame = enc.frame
    sid = register(guarded.client, enc)["session_id"]
    session = guarded.state.sessions.peek(sid)
    hub = guarded.state.ingest
    headers = {**BINARY_HEADERS, **KEY}
    guarded.client.portal.call(session.lock.acquire)  # the GPU-side work of this session waits for the test
    first: dict[str, httpx.Response] = {}
    try:
        thread = threading.Thread(target=lambda: first.setdefault(
            "r", guarded.track(track_body(frame.rgb, frame.depth_m, session_id=sid), headers)), name="test-held")
        thread.start()
        _until(lambda: guarded.on_loop(lambda: hub.in_flight) == 1, "the held request in the GPU process")
        with httpx.Client(base_url=guarded.ingest.base_url, timeout=60.0) as other:
            refused = guarded.track(track_body(frame.rgb, frame.depth_m, object_id="block", pose=np.eye(4),
                                               K=frame.K), headers, client=other)
        _error(refused, 503, "OverloadedError", None, r"^ingest worker \d+: all 1 frame slots are busy")
        # the wait is the track lane's measured service time, as the hub last told the worker (no track ended since)
        track_ms = guarded.on_loop(lambda: guarded.state.service_times.ms("track"))
        assert refused.headers["retry-after-ms"] == str(max(1, math.ceil(track_ms)))
        assert refused.headers["retry-after"] == str(max(1, math.ceil(track_ms / 1e3)))
        assert "r" not in first and thread.is_alive()  # the held request still waits
    finally:
        guarded.client.portal.call(session.lock.release)
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert first["r"].status_code == 200, first["r"].text
    assert first["r"].json()["frame"] == 1
    again = guarded.track(track_body(frame.rgb, frame.depth_m, session_id=sid), headers)  # the slot is free again
    assert again.status_code == 200 and again.json()["frame"] == 2
    assert guarded.on_loop(lambda: hub.in_flight) == 0


# -- concurrency -------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_concurrent_session_tracks_are_answered_once_in_order(served, enc):
    frame = enc.frame
    sessions = [register(served.client, enc)["session_id"] for _ in range(2)]
    threads_per_session, tracks_per_thread = 2, 3  # one running + one waiting per session: within session_waiting
    before = served.on_loop(lambda: served.state.ingest.requests)
    results: dict[tuple[str, int], list[int]] = {}
    failures: list[str] = []
    body = {sid: track_body(frame.rgb, frame.depth_m, session_id=sid) for sid in sessions}
    go = threading.Barrier(len(sessions) * threads_per_session)

    def client_thread(sid: str, i: int) -> None:
        frames = results.setdefault((sid, i), [])
        with httpx.Client(base_url=served.ingest.base_url, timeout=60.0) as own:  # own connection: any worker
            go.wait(WAIT_S)
            for _ in range(tracks_per_thread):
                response = served.track(body[sid], client=own)
                if response.status_code != 200 or response.json()["session_id"] != sid:
                    failures.append(f"{sid}: {response.status_code} {response.text}")
                    return
                frames.append(response.json()["frame"])

    threads = [threading.Thread(target=client_thread, args=(sid, i), name=f"test-ingest-{n}-{i}")
               for n, sid in enumerate(sessions) for i in range(threads_per_session)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(READY_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads) and failures == []
    total = threads_per_session * tracks_per_thread
    for sid in sessions:
        per_thread = [results[(sid, i)] for i in range(threads_per_session)]
        for frames in per_thread:
            assert frames == sorted(frames) and len(set(frames)) == tracks_per_thread  # strictly increasing
        assert sorted(f for frames in per_thread for f in frames) == list(range(1, total + 1))  # each frame once
        assert served.client.get(f"/sessions/{sid}").json()["frames"] == total
    assert served.on_loop(lambda: served.state.ingest.requests) == before + len(sessions) * total
    assert served.on_loop(lambda: served.state.ingest.in_flight) == 0


# -- the hub's end of the socket, spoken to directly --------------------------------------------------------------------
def _recv_message(sock: socket.socket) -> tuple[dict, bytes] | None:
    """One message from ``sock`` (blocking), or None when the hub closed the connection."""
    def exactly(n: int) -> bytes | None:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                return None
            data += chunk
        return data

    prefix = exactly(8)
    if prefix is None:
        return None
    head_len, body_len = struct.unpack("<II", prefix)
    head, body = exactly(head_len), exactly(body_len) if body_len else b""
    return json.loads(head), body


def test_the_hub_refuses_bad_hellos_and_drops_a_broken_peer(served, enc, tmp_path):
    hub = served.state.ingest
    ring = FrameRing.create(1, MAX_IMAGE_HW, directory=tmp_path)
    good = {"op": "hello", "pid": 4242, "ring": str(ring.path), "slots": 1, "max_hw": list(MAX_IMAGE_HW)}
    refusals = [
        ({**good, "max_hw": [8, 8]}, rf"^worker max_hw \(8, 8\) != the server's \({MAX_IMAGE_HW[0]}, {MAX_IMAGE_HW[1]}\)$"),
        ({**good, "slots": 2}, r"^ingest frame ring .*: \d+ bytes, expected \d+ \(2 slots of"),
        ({**good, "ring": str(tmp_path / "nope.ring")}, r"No such file"),
        ({"op": "track", "slot": 0}, r"^first message must be hello, got 'track'$"),
    ]
    refused_before = served.on_loop(lambda: hub.refused_hellos)
    for hello, reason in refusals:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(WAIT_S)
            sock.connect(str(hub.socket_path))
            sock.sendall(pack(hello))
            answer, _ = _recv_message(sock)
            assert answer["op"] == "refused" and re.search(reason, answer["reason"]), answer
            assert _recv_message(sock) is None  # and the connection is closed
    assert served.on_loop(lambda: hub.refused_hellos) == refused_before + len(refusals)
    assert ring.path.exists()  # a refused ring is the worker's to remove

    errors_before = served.on_loop(lambda: hub.protocol_errors)
    frame = enc.frame
    ring.write(0, frame.rgb, frame.depth_m)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(WAIT_S)
        sock.connect(str(hub.socket_path))
        sock.sendall(pack(good))
        track_ms = served.on_loop(lambda: round(float(served.state.service_times.ms("track")), 3))
        assert _recv_message(sock) == ({"op": "ready", "track_ms": track_ms}, b"")  # the Retry-After of a full ring
        assert not ring.path.exists()  # mapped by the hub, then unlinked
        _until(lambda: served.on_loop(lambda: hub.connected) == 3, "the hand-made worker counted as connected")
        sock.sendall(pack({"op": "track", "id": 99, "slot": 0, "hw": list(FRAME_HW), "request_id": "rid-hub",
                           "input": wire.fields_of(TrackInput(None, session_id="nosuchsession")),
                           "phases": {"decode": 1.0}}))
        answer, body = _recv_message(sock)
        assert (answer["op"], answer["id"], answer["status"]) == ("answer", 99, 404)
        assert json.loads(body)["error"] == {"type": "UnknownSessionError", "request_id": "rid-hub",
                                             "field": "session_id", "message": "session_id: no session 'nosuchsession' (never created, "
                                                        "expired or deleted)"}
        sock.sendall(pack({"op": "bogus"}))  # an unknown op: a broken peer, dropped
        assert _recv_message(sock) is None
    _until(lambda: served.on_loop(lambda: hub.connected) == 2, "the broken peer dropped")
    assert served.on_loop(lambda: hub.protocol_errors) == errors_before + 1


# -- WS /track/stream on the track port --------------------------------------------------------------------------------
def _stream_pair(served, enc, frames: int, box: tuple[int, int, int, int] | None = None):
    """The same register (with the frame's mask, or ``box``) + ``frames`` frames over the main port's stream
    (TestClient) and the track port's (a real socket, each message sent as WebSocket fragments of 4 KiB, as
    ``server.client`` sends them): both lists of answers."""
    from websockets.sync.client import connect

    from server.client import STREAM_CONNECT_OPTIONS, fragments, frame_message, register_message

    frame = enc.frame
    reg = (register_message("block", frame.K, frame.rgb, frame.depth_m, frame.mask) if box is None
           else register_message("block", frame.K, frame.rgb, frame.depth_m, box=box))
    main, ingest = [], []
    with served.client.websocket_connect("/track/stream") as ws:
        ws.send_bytes(reg)
        main.append(ws.receive_json())
        for n in range(1, frames + 1):
            ws.send_bytes(frame_message(n, frame.rgb, frame.depth_m))
            main.append(ws.receive_json())
    with connect(f"ws://127.0.0.1:{served.state.ingest_workers.port}/track/stream", **STREAM_CONNECT_OPTIONS) as ws:
        ws.send(fragments(reg, 4096))
        ingest.append(json.loads(ws.recv(WAIT_S)))
        for n in range(1, frames + 1):
            ws.send(fragments(frame_message(n, frame.rgb, frame.depth_m), 4096))
            ingest.append(json.loads(ws.recv(WAIT_S)))
    return main, ingest


def _metric(served, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", served.client.get("/metrics").text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


@pytest.mark.slow
def test_a_stream_on_the_track_port_answers_as_the_main_ports(served, enc):
    received = _metric(served, "fp_ingest_stream_frames_received_total")
    main, ingest = _stream_pair(served, enc, frames=3)
    assert [a["type"] for a in ingest] == ["registered", "pose", "pose", "pose"]
    assert [a.get("frame") for a in ingest[1:]] == [1, 2, 3] and [a["frames"] for a in ingest[1:]] == [1, 2, 3]
    for ours, theirs in zip(ingest, main, strict=True):  # CPU: the same pipeline work, bit-identical poses
        assert ours["pose"] == theirs["pose"] and ours["skipped"] == theirs["skipped"] == []
    assert ingest[0]["score"] == main[0]["score"]
    assert {"decode", "validate", "pipeline"} <= set(ingest[1]["timings_ms"])  # the worker's and the GPU side's
    for sid in (main[0]["session_id"], ingest[0]["session_id"]):  # each connection's session ended with it
        _until(lambda sid=sid: served.client.get(f"/sessions/{sid}").status_code == 404, f"session {sid} deleted")
    # the worker's stream counters reach the main port's /metrics (reported about once a second)
    _until(lambda: _metric(served, "fp_ingest_stream_frames_received_total") >= received + 3
           and _metric(served, "fp_ingest_streams_open") == 0, "the track port's stream frames counted")


@pytest.mark.slow
def test_a_stream_register_with_a_box_on_the_track_port_answers_as_the_main_ports(served, enc):
    ys, xs = np.nonzero(enc.frame.mask)
    box = (int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1)
    main, ingest = _stream_pair(served, enc, frames=1, box=box)
    assert [a["type"] for a in ingest] == [a["type"] for a in main] == ["registered", "pose"]
    assert [a["pose"] for a in ingest] == [a["pose"] for a in main]


@pytest.mark.slow
def test_a_track_port_stream_reports_errors_and_closes_when_its_session_is_deleted(served, enc):
    from websockets.exceptions import ConnectionClosedOK
    from websockets.sync.client import connect

    from server.client import STREAM_CONNECT_OPTIONS, frame_message, register_message

    frame = enc.frame
    with connect(f"ws://127.0.0.1:{served.state.ingest_workers.port}/track/stream", **STREAM_CONNECT_OPTIONS) as ws:
        ws.send(frame_message(1, frame.rgb, frame.depth_m))  # a frame before the register: an error, stream goes on
        early = json.loads(ws.recv(WAIT_S))
        assert early["type"] == "error" and early["error"]["field"] == "type" and early["frame"] == 1
        ws.send(b"\x05\x00")  # a cut container: the worker's own parser answers
        cut = json.loads(ws.recv(WAIT_S))
        assert cut["type"] == "error" and cut["error"]["type"] == "InputError" and cut["error"]["field"] == "message"
        ws.send(register_message("block", frame.K, frame.rgb, frame.depth_m, frame.mask))
        registered = json.loads(ws.recv(WAIT_S))
        sid = registered["session_id"]
        assert served.client.get(f"/sessions/{sid}").json()["session_id"] == sid  # the server's own session
        ws.send(register_message("block", frame.K, frame.rgb, frame.depth_m, frame.mask))
        second = json.loads(ws.recv(WAIT_S))  # a later register re-registers the same session on its mask
        assert (second["type"], second["session_id"]) == ("registered", sid)
        ws.send(frame_message(7, frame.rgb, frame.depth_m[:-1]))  # depth of another size: 422 naming depth
        bad = json.loads(ws.recv(WAIT_S))
        assert bad["type"] == "error" and bad["frame"] == 7 and bad["error"]["field"] == "depth"
        ws.send(frame_message(8, frame.rgb, frame.depth_m))
        assert json.loads(ws.recv(WAIT_S))["frames"] == 1  # the session survived the errors
        assert served.client.delete(f"/sessions/{sid}").status_code == 200
        ws.send(frame_message(9, frame.rgb, frame.depth_m))
        gone = json.loads(ws.recv(WAIT_S))
        assert gone["type"] == "error" and gone["error"]["type"] == "UnknownSessionError"
        with pytest.raises(ConnectionClosedOK) as closed:
            ws.recv(WAIT_S)
        assert closed.value.rcvd.code == 1000 and "deleted or expired" in closed.value.rcvd.reason


# -- lifecycle ---------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_shutdown_leaves_nothing(tiny_estimator, tmp_path, enc):
    frame = enc.frame
    rings_before = _rings()
    with _serve(tiny_estimator, write_objects_dir(tmp_path / "objects"), ingest_workers=2) as s:
        workers = s.state.ingest_workers
        first = workers.pids
        assert len(first) == 2 and all(_is_worker(pid) for pid in first)
        ring_paths = s.on_loop(lambda: [c.ring.path for c in s.state.ingest._connections])
        assert len(ring_paths) == 2 and not any(p.exists() for p in ring_paths)  # unlinked once mapped
        os.kill(first[0], signal.SIGKILL)
        _until(lambda: workers.restarts == 1 and len(workers.pids) == 2 and first[0] not in workers.pids,
               "the killed worker started again")
        _until(lambda: s.on_loop(lambda: s.state.ingest.connected) == 2, "the new worker connected")
        second = workers.pids
        assert first[1] in second
        sid = register(s.client, enc)["session_id"]
        for expected in (1, 2):  # a new connection each: on whichever worker it lands
            with httpx.Client(base_url=s.ingest.base_url, timeout=60.0) as fresh:
                response = s.track(track_body(frame.rgb, frame.depth_m, session_id=sid), client=fresh)
            assert response.status_code == 200, response.text
            assert response.json()["frame"] == expected
        metrics = s.client.get("/metrics").text
        assert "fp_ingest_worker_restarts_total 1" in metrics and "fp_ingest_workers_connected 2" in metrics
        socket_dir = s.state.ingest.socket_path.parent
        assert socket_dir.is_dir() and socket_dir.name.startswith(f"fp-hub-{os.getpid()}-")  # found if left behind
        # a request in progress at shutdown is answered: the workers stop gracefully, before the hub
        session = s.state.sessions.peek(sid)
        s.client.portal.call(session.lock.acquire)
        held: dict[str, httpx.Response] = {}

        def held_request() -> None:
            with httpx.Client(base_url=s.ingest.base_url, timeout=60.0) as own:
                held["r"] = s.track(track_body(frame.rgb, frame.depth_m, session_id=sid), client=own)

        def release_at_shutdown() -> None:
            _until(lambda: s.state.phase == "stopping", "the shutdown begun")
            s.client.portal.call(session.lock.release)

        threads = [threading.Thread(target=held_request, name="test-held"),
                   threading.Thread(target=release_at_shutdown, name="test-release")]
        threads[0].start()
        _until(lambda: s.on_loop(lambda: s.state.ingest.in_flight) == 1, "the held request in the GPU process")
        threads[1].start()
    for t in threads:
        t.join(WAIT_S)
    assert not any(t.is_alive() for t in threads)
    assert held["r"].status_code == 200 and held["r"].json()["frame"] == 3, held["r"].text
    assert not any(_is_worker(pid) for pid in {*first, *second})
    assert workers.pids == [] and not socket_dir.exists()
    leftover = _rings() - rings_before
    if leftover:  # another test run's ring between its create and its hello: gone in a moment
        _until(lambda: not (_rings() - rings_before) & leftover, f"ring files {leftover} removed", timeout=5.0)


@pytest.mark.slow
def test_a_worker_that_keeps_failing_is_given_up_after_max_restarts(tmp_path, caplog):
    """... and the port's connections then go to the fallback: the GPU process serves them itself."""
    from server.ingest.workers import IngestConfig, IngestWorkers

    served_here: list[socket.socket] = []
    workers = IngestWorkers(IngestConfig(1, port=0, slots=1, max_restarts=1), hub_path=tmp_path / "no-hub.sock",
                            max_image_hw=MAX_IMAGE_HW, api_key=None, max_upload_bytes=MAX_UPLOAD, retry_after_s=1,
                            request_timeout_s=5.0, fallback=served_here.append)
    rings_before = _rings()
    with caplog.at_level(logging.WARNING, logger="server.ingest.workers"):
        workers.start()  # no hub listens there: each worker start fails to connect and exits
        try:
            _until(lambda: any("not restarting it" in r.getMessage() for r in caplog.records),
                   "the monitor giving up on the worker", timeout=60)
            assert workers.restarts == 1 and workers.pids == []
            assert sum("starting it again" in r.getMessage() for r in caplog.records) == 1
            _until(lambda: workers.dispatcher.loads() == {}, "the given-up worker's channel dropped")
            with socket.create_connection(("127.0.0.1", workers.port), timeout=WAIT_S):
                _until(lambda: len(served_here) == 1, "the connection handed to the fallback")
            assert workers.dispatcher.served_here == 1
        finally:
            workers.stop()
            for sock in served_here:
                sock.close()
    assert _rings() <= rings_before  # each failed worker removed the ring it had made


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped (no process has it now, barring reuse meanwhile)."""
    import subprocess
    import sys

    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)


def test_ring_files_left_by_exited_processes_are_removed_by_pid(tmp_path):
    from deploy_core.memory.ring import remove_rings_of, remove_stale_rings

    dead = _dead_pid()
    ours = FrameRing.create(1, (4, 4), directory=tmp_path)  # named after this (live) process
    assert ours.path.name.startswith(f"fp-ingest-{os.getpid()}-")
    left = [tmp_path / f"fp-ingest-{dead}-a.ring", tmp_path / f"fp-ingest-{dead}-b.ring"]
    other = [tmp_path / "fp-ingest-notapid.ring", tmp_path / f"fp-ingest-{dead}-c.txt"]  # not ring files
    for path in left + other:
        path.write_bytes(b"x")
    assert remove_stale_rings(tmp_path) == 2
    assert ours.path.exists() and all(p.exists() for p in other) and not any(p.exists() for p in left)
    assert remove_rings_of(os.getpid() + 10**7, tmp_path) == 0  # nobody's
    assert remove_rings_of(os.getpid(), tmp_path) == 1 and not ours.path.exists()


def test_folders_of_processes_that_are_gone_are_removed_at_start(tmp_path):
    from deploy_core.memory import leftovers

    dead = _dead_pid()
    stale = tmp_path / f"fp-hub-{dead}-abc"
    stale.mkdir()
    (stale / "hub.sock").write_bytes(b"")
    live = tmp_path / f"{leftovers.owned_prefix('fp-hub-')}def"
    live.mkdir()
    assert leftovers.owners(tmp_path, "fp-hub-") and leftovers.remove_stale(tmp_path, "fp-hub-") == 1
    assert not stale.exists() and live.is_dir()
    assert leftovers.process_gone(dead) and not leftovers.process_gone(os.getpid())


@pytest.mark.slow
def test_a_worker_killed_before_the_gpu_process_mapped_its_ring_leaves_no_file(tmp_path):
    """The hub never answers the hello, so the worker's ring file is still linked when it is killed: the
    supervisor removes it (named after the worker's pid) and starts the worker again."""
    from deploy_core.memory.ring import _ring_files
    from server.ingest.workers import IngestConfig, IngestWorkers

    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.bind(str(tmp_path / "silent.sock"))
    silent.listen(8)  # accepts (in the kernel's backlog) and never answers
    workers = IngestWorkers(IngestConfig(1, port=0, slots=1, stop_timeout_s=1.0), hub_path=tmp_path / "silent.sock",
                            max_image_hw=MAX_IMAGE_HW, api_key=None, max_upload_bytes=MAX_UPLOAD, retry_after_s=1,
                            request_timeout_s=5.0)
    seen: list[int] = []
    try:
        workers.start()
        first = workers.pids[0]
        seen.append(first)
        _until(lambda: any(pid == first for pid, _ in _ring_files(None)), "the worker's ring file made")
        os.kill(first, signal.SIGKILL)
        _until(lambda: workers.restarts == 1 and len(workers.pids) == 1, "the killed worker started again")
        seen.extend(workers.pids)
        _until(lambda: not any(pid == first for pid, _ in _ring_files(None)), "the killed worker's file removed")
    finally:
        workers.stop()
        silent.close()
    assert not any(pid in seen for pid, _ in _ring_files(None))  # the second worker's too, after stop()


def test_a_taken_ingest_port_fails_the_start_up_naming_it(tiny_estimator, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        app = create_app(tiny_config(write_objects_dir(tmp_path / "objects"), ingest_workers=1, ingest_port=port,
                                     warmup=False), estimator=tiny_estimator)
        with pytest.raises(OSError, match=rf"^\[Errno \d+\] ingest workers' port 127\.0\.0\.1:{port}: "):
            with TestClient(app):
                pass
    state = app.state.fp
    assert state.ingest_workers is None  # no worker was started
    assert not state.loop_watch.watching  # nor the loop's watch, which only stop() would end
    assert not state.ingest.socket_path.exists() and not state.ingest.socket_path.parent.exists()


# -- python -m server.client through the track port ---------------------------------------------------------------------
@pytest.mark.slow
def test_the_client_tracks_and_streams_the_bundled_sequence_through_the_track_port(tiny_estimator, tmp_path):
    """``server.client track --track-url`` and ``stream --objects-url`` against a live main port + its track port:
    the mesh upload and the register on the main port, every frame through the workers."""
    import asyncio

    from foundationpose.demo.dataset import BUNDLED_SEQUENCE_DIR
    from server.client import stream_sequence, track_sequence
    from tests.server._helpers import live_uvicorn

    config = tiny_config(tmp_path / "objects", ingest_port=0, ingest_workers=1, warmup=False,
                         track_latency_budget_s=0, max_image_hw=(480, 640))
    (tmp_path / "objects").mkdir()
    app = create_app(config, estimator=tiny_estimator)
    with live_uvicorn(app) as host:
        state = app.state.fp
        tport = f"http://127.0.0.1:{state.ingest_workers.port}"
        _until(lambda: _answers_200(f"{tport}/healthz"), "the worker serving", timeout=SETUP_WAIT_S)
        before = state.ingest.requests
        tracked = track_sequence(f"http://{host}", BUNDLED_SEQUENCE_DIR, object_id="demo_object", api_key=None,
                                 max_frames=4, quiet=True, track_url=tport)
        assert (tracked["frames"], tracked["answered"], tracked["errors"]) == (3, 3, 0)
        assert_rigid(tracked["last_pose"])
        streamed = asyncio.run(stream_sequence(f"ws://127.0.0.1:{state.ingest_workers.port}", BUNDLED_SEQUENCE_DIR,
                                               object_id="demo_object", api_key=None, max_frames=4, fps=0.0,
                                               quiet=True, objects_url=f"http://{host}"))
        assert (streamed["answered"], streamed["errors"]) == (3, 0)
        # 3 tracks + the stream's register and 3 frames, all answered by the GPU process for the worker
        assert state.ingest.requests - before == 3 + 1 + 3


# -- submit on the event loop (a page-locked ring's frames) ------------------------------------------------------------
def test_a_track_is_alone_only_when_no_other_is_admitted_or_waiting_for_the_loop(served):
    """An in-loop submit may step inline only for a request alone in the process (else steps would run one at a
    time, never batched): the only track admitted, and no other worker message read and waiting for the loop."""
    state = served.state
    admission = state.admission
    tickets = [admission.acquire(f"s{i}") for i in range(2)]  # two requests admitted: under load
    try:
        assert served.on_loop(lambda: state.track_alone()) is False
        tickets.pop().release()  # one request admitted: alone in the process
        assert served.on_loop(lambda: state.track_alone()) is True

        def behind_another_message() -> bool:  # another worker message read, its task not yet admitted
            conn = next(iter(state.ingest._connections))
            loop = asyncio.get_running_loop()
            conn.tasks.update({loop.create_future(), loop.create_future()})  # this request's task and another's
            try:
                return state.track_alone()
            finally:
                conn.tasks.clear()

        async def behind() -> bool:
            return behind_another_message()

        assert served.on_loop(behind) is False
    finally:
        for ticket in tickets:
            ticket.release()
    assert admission.admitted == 0


@pytest.mark.slow
def test_ingest_tracks_submitted_on_the_loop_answer_as_from_a_worker_thread(served, enc, monkeypatch):
    """A page-locked ring's tracks are validated and submitted on the GPU process's event loop (CPU rings are never
    page-locked, so the hub's condition is lifted here: the hub asks it per message, so one server serves both
    sessions); the answers equal those submitted from a worker thread."""
    from server.flow.backend import LocalBackend
    from server.ingest.hub import IngestHub

    in_loop_now = [False]
    monkeypatch.setattr(IngestHub, "_submit_in_loop", lambda self, conn: in_loop_now[0])
    threads: list[str] = []
    real_submit = LocalBackend._track_submit

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real_submit(*args, **kwargs)

    monkeypatch.setattr(LocalBackend, "_track_submit", spy)
    frame = enc.frame
    answers = {}
    s = served
    loop_thread = s.on_loop(lambda: threading.current_thread().name)
    for in_loop in (False, True):
        in_loop_now[0] = in_loop
        sid = register(s.client, enc)["session_id"]
        threads.clear()
        poses = []
        for expected in (1, 2):
            response = s.track(track_body(frame.rgb, frame.depth_m, session_id=sid))
            assert response.status_code == 200, response.text
            assert response.json()["frame"] == expected
            poses.append(response.json()["pose"])
        answers[in_loop] = poses
        assert len(threads) == 2
        assert all((name == loop_thread) == in_loop for name in threads), (in_loop, loop_thread, threads)
        assert s.client.delete(f"/sessions/{sid}").status_code == 200
    assert answers[True] == answers[False]
