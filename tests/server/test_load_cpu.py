"""The 64-session load in CI size, against a real uvicorn server on 127.0.0.1 (tiny config, CPU):
4 streaming sessions and 4 raw-HTTP sessions, 5 frames each, all at once. Every request is answered
once, in order per session; afterwards no session, admission ticket, pool lease or stage thread is left."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import numpy as np
import pytest
from websockets.asyncio.client import connect

from server import create_app
from server.client import STREAM_CONNECT_OPTIONS, frame_message, raw_track_form, register_message
from tests.server._helpers import assert_rigid, live_uvicorn, tiny_config, write_objects_dir

SESSIONS, FRAMES = 4, 5  # per path: 4 streams + 4 raw-HTTP clients = 8 sessions


@pytest.fixture
def live_server(tiny_estimator, tmp_path):
    """(base URL, app) of a uvicorn server in a thread; stopped (lifespan shutdown included) at the end."""
    threads_before = {t.ident for t in threading.enumerate()}
    # registers wait for room instead of 503 (8 arrive at once; the register lane holds 2)
    config = tiny_config(write_objects_dir(tmp_path / "objects"), warmup=False, submit_timeout_s=120.0,
                         register_capacity=64)
    app = create_app(config, estimator=tiny_estimator)
    with live_uvicorn(app) as host:
        yield host, app
    leftover = [t.name for t in threading.enumerate() if t.ident not in threads_before and t.name.startswith("fp-")]
    assert leftover == [], leftover  # the service this app built was closed, its stage threads joined


async def _stream_session(host: str, enc) -> list[dict]:
    f = enc.frame
    async with connect(f"ws://{host}/track/stream", **STREAM_CONNECT_OPTIONS) as ws:
        await ws.send(register_message("block", f.K, f.rgb, f.depth_m, f.mask))
        replies = [json.loads(await ws.recv())]
        for n in range(1, FRAMES + 1):
            await ws.send(frame_message(n, f.rgb, f.depth_m))
            replies.append(json.loads(await ws.recv()))
    return replies


async def _http_session(client: httpx.AsyncClient, enc) -> list[dict]:
    f = enc.frame
    reg = await client.post("/register", data={"object_id": "block", "K": enc.K_json}, files=enc.register_files())
    assert reg.status_code == 200, reg.text
    replies = [reg.json()]
    fields, files = raw_track_form(f.rgb, f.depth_m)
    for _ in range(FRAMES):
        response = await client.post("/track", data={"session_id": reg.json()["session_id"], **fields}, files=files)
        assert response.status_code == 200, response.text
        replies.append(response.json())
    deleted = await client.delete(f"/sessions/{reg.json()['session_id']}")
    assert deleted.status_code == 200
    return replies


async def _load(host: str, enc):
    async with httpx.AsyncClient(base_url=f"http://{host}", timeout=120.0) as client:
        jobs = [_stream_session(host, enc) for _ in range(SESSIONS)] + [_http_session(client, enc) for _ in range(SESSIONS)]
        results = await asyncio.gather(*jobs)
        metrics = (await client.get("/metrics")).text
    return results[:SESSIONS], results[SESSIONS:], metrics


@pytest.mark.slow
def test_8_sessions_stream_and_raw_http_at_once(live_server, enc):
    host, app = live_server
    streams, https, metrics = asyncio.run(_load(host, enc))
    for replies in streams:
        assert replies[0]["type"] == "registered"
        frames = replies[1:]
        assert [r["type"] for r in frames] == ["pose"] * FRAMES, frames
        assert [r["frame"] for r in frames] == list(range(1, FRAMES + 1))  # once each, in order
        assert [r["frames"] for r in frames] == list(range(1, FRAMES + 1))
        assert all(r["skipped"] == [] for r in frames)  # lock-step clients: nothing to drop
        for r in frames:
            assert_rigid(r["pose"])
    for replies in https:
        assert [r["frame"] for r in replies[1:]] == list(range(1, FRAMES + 1))
        assert len({r["session_id"] for r in replies}) == 1
    state = app.state.fp
    assert len(state.sessions) == 0  # streams end theirs on close, HTTP clients deleted theirs
    assert state.admission.admitted == 0 and state.streams.open == 0
    stats = state.service.stats()
    assert stats.track_pool.leased == 0 and stats.register_pool.leased == 0
    assert stats.track.in_flight == 0 and stats.register.in_flight == 0
    assert state.metrics.request_count("/track", 200) == SESSIONS * FRAMES
    assert state.metrics.request_count("/track/stream", 200) == SESSIONS * (FRAMES + 1)
    assert f"fp_stream_frames_received_total {SESSIONS * FRAMES}" in metrics
    assert np.isfinite([r["timings_ms"]["pipeline"] for replies in https for r in replies[1:]]).all()
