"""``WS /track/stream`` over a real uvicorn server on 127.0.0.1 (tiny config, CPU): the transport adds
no per-frame cost of its own.

The cause these tests pin: ``permessage-deflate``. ``websockets`` clients offer it by default and uvicorn
accepted it, so every frame's raw pixels were zlib'd by the client and inflated on the server's event
loop, outside every server phase (on the H200, 640x480: ~90 ms per frame against ~6 ms of server work).
The server refuses it now, and the project's clients do not offer it.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import pytest
from websockets.asyncio.client import connect

from server import create_app
from server.client import STREAM_CONNECT_OPTIONS, fragments, frame_message, register_message
from server.phases import accounted_ms
from tests.server._helpers import live_uvicorn, tiny_config, write_objects_dir

FRAMES = 8
# Round trip minus the server's phases, median per frame. What remains is loopback transport and both
# ends' (de)framing: ~1 ms here. The bound is a scheduling check, not a benchmark: far above what a loaded
# 2-core machine adds to a median, far below a stall (a compressed frame, a polling timeout, delayed ACK).
MAX_OUTSIDE_MS = 20.0


@pytest.fixture
def app(tiny_estimator, tmp_path):
    """A fresh app per test: its lifespan (and so its pose service) ends with the test's server."""
    config = tiny_config(write_objects_dir(tmp_path / "objects"), warmup=False)
    return create_app(config, estimator=tiny_estimator)


def _extensions(ws) -> tuple[str | None, str | None]:
    """(offered by the client, accepted by the server): the handshake's Sec-WebSocket-Extensions."""
    return ws.request.headers.get("Sec-WebSocket-Extensions"), ws.response.headers.get("Sec-WebSocket-Extensions")


async def _session(host: str, enc, fragment_bytes: int = 0, **connect_options) -> tuple[tuple, list[dict], list[float]]:
    """Register and stream FRAMES frames lock-step: (extensions, answers, round trips in ms). ``fragment_bytes``:
    each message sent as WebSocket fragments of that size (0: one frame)."""
    f = enc.frame

    def pieces(message: bytes):
        return fragments(message, fragment_bytes) if fragment_bytes else message

    async with connect(f"ws://{host}/track/stream", **connect_options) as ws:
        await ws.send(pieces(register_message("block", f.K, f.rgb, f.depth_m, f.mask)))
        registered = json.loads(await ws.recv())
        assert registered["type"] == "registered", registered
        answers, round_trips = [], []
        for n in range(1, FRAMES + 1):
            started = time.perf_counter()
            await ws.send(pieces(frame_message(n, f.rgb, f.depth_m)))
            answers.append(json.loads(await ws.recv()))
            round_trips.append((time.perf_counter() - started) * 1e3)
        return _extensions(ws), answers, round_trips


@pytest.mark.slow
def test_server_refuses_per_message_deflate_a_default_client_offers(app, enc):
    with live_uvicorn(app) as host:  # the options of python -m server
        (offered, accepted), answers, _ = asyncio.run(_session(host, enc, max_size=2**24))  # websockets' defaults
    assert offered is not None and "permessage-deflate" in offered  # the default client does offer it ...
    assert accepted is None  # ... and the server negotiates no extension: frames travel uncompressed
    assert [a["type"] for a in answers] == ["pose"] * FRAMES
    assert [a["frame"] for a in answers] == list(range(1, FRAMES + 1))


@pytest.mark.slow
def test_stream_client_options_offer_no_compression_even_to_a_server_that_would_accept(app, enc):
    with live_uvicorn(app, ws_per_message_deflate=True) as host:  # uvicorn's default (e.g. another host's proxy)
        (offered, accepted), answers, _ = asyncio.run(_session(host, enc, **STREAM_CONNECT_OPTIONS))
        async def default_client():
            async with connect(f"ws://{host}/track/stream") as ws:
                return _extensions(ws)
        control = asyncio.run(default_client())
    assert control[1] is not None and control[1].startswith("permessage-deflate")  # this server would compress
    assert (offered, accepted) == (None, None)
    assert [a["type"] for a in answers] == ["pose"] * FRAMES


@pytest.mark.slow
def test_time_outside_the_server_phases_per_frame_is_small(app, enc):
    with live_uvicorn(app) as host:
        _, answers, round_trips = asyncio.run(_session(host, enc, **STREAM_CONNECT_OPTIONS))
    assert [a["type"] for a in answers] == ["pose"] * FRAMES
    server_ms = [accounted_ms(a["timings_ms"]) for a in answers]
    assert all(ms > 0 and "pipeline" in a["timings_ms"] for ms, a in zip(server_ms, answers, strict=True))
    outside = [rt - ms for rt, ms in zip(round_trips, server_ms, strict=True)]
    assert min(outside) > 0  # the server's phases lie inside the client's round trip
    assert statistics.median(outside) < MAX_OUTSIDE_MS, (outside, server_ms)


@pytest.mark.slow
def test_fragmented_messages_are_the_same_messages(app, enc):
    """server.client sends each message as fragments (STREAM_FRAGMENT_BYTES): the server reassembles them, so a
    session streamed in 1 KiB fragments gets the answers of the same session sent whole (CPU: bit-identical)."""
    with live_uvicorn(app) as host:
        _, whole, _ = asyncio.run(_session(host, enc, **STREAM_CONNECT_OPTIONS))
        _, pieces, _ = asyncio.run(_session(host, enc, fragment_bytes=1024, **STREAM_CONNECT_OPTIONS))
    assert [a["type"] for a in pieces] == ["pose"] * FRAMES
    assert [a["frame"] for a in pieces] == list(range(1, FRAMES + 1))
    assert [a["pose"] for a in pieces] == [a["pose"] for a in whole]


def test_fragments_are_views_of_the_message_in_order():
    message = bytes(range(256)) * 10  # 2560 bytes
    parts = fragments(message, 1024)
    assert [len(p) for p in parts] == [1024, 1024, 512] and b"".join(parts) == message
    assert fragments(message, 4096) is message  # one piece: sent as it is
    assert fragments(message) is message  # the default size (128 KiB) holds it
    with pytest.raises(ValueError, match="fragment size must be >= 1 byte, got 0"):
        fragments(message, 0)
