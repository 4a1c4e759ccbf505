"""Ready means warm (issue 39, item 1): ``/readyz`` answers 200 only after every request path ran once through the
app (and each ingest worker through its own), says which step it is in while warming, stays 503 with the reason
when the warm-up fails, and the first requests after ready find every step already built (a batch mixing the
loaded objects included: the warm-up prepared their group)."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from foundationpose.synthetic.scenes import synthetic_frame
from server import create_app
from server import state as state_module
from server.client import BINARY_HEADERS, frame_message, register_message, track_body
from server.warmup import APP_PATHS, WORKER_PATHS, warm_frame_hw
from tests.server._helpers import (
    MAX_IMAGE_HW,
    READY_TIMEOUT_S,
    SETUP_WAIT_S,
    assert_ready,
    encode,
    tiny_config,
    wait_for,
    write_objects_dir,
)


def _warmup_samples(metrics: str) -> dict[str, float]:
    out = {}
    for line in metrics.splitlines():
        if line.startswith('fp_warmup_seconds{path="'):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('"')[1]] = float(value)
    return out


def _requests_of(metrics: str, endpoint: str) -> float:
    """Answered (200) requests of ``endpoint`` so far, from ``fp_http_requests_total``."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith(f'fp_http_requests_total{{endpoint="{endpoint}"') and 'status="200"' in line)


def test_the_warm_up_frame_is_the_largest_image_unless_its_body_would_not_fit():
    assert warm_frame_hw((1080, 1920), 20 * 2**20) == (1080, 1920)
    h, w = warm_frame_hw((3000, 4000), 20 * 2**20)
    assert h * w * 8 <= 20 * 2**20 and abs(w / h - 4000 / 3000) < 0.01


def test_readyz_says_warming_until_every_path_ran_then_ready(tiny_estimator, tmp_path, monkeypatch):
    entered, release = threading.Event(), threading.Event()
    real = state_module.warm_app

    async def gated(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - holds the warm-up at its request step
        entered.set()
        await asyncio.to_thread(release.wait, SETUP_WAIT_S)
        return await real(*args, **kwargs)

    monkeypatch.setattr(state_module, "warm_app", gated)
    app = create_app(tiny_config(write_objects_dir(tmp_path / "objects")), estimator=tiny_estimator)
    state = app.state.fp
    with TestClient(app) as client:
        assert entered.wait(SETUP_WAIT_S), "the warm-up never reached its request step"
        warming = client.get("/readyz")
        assert warming.status_code == 503 and warming.headers["Retry-After"]
        body = warming.json()
        assert body["ready"] is False and body["phase"] == "starting"
        assert body["reason"] == "starting: warming the request paths (block at 160x120)"
        assert set(body["warmup_paths_ms"]) == {"pipeline", "objects"}  # the steps done so far
        assert client.get("/objects").status_code == 503  # clients still wait
        release.set()
        assert_ready(state, "the app once its warm-up is released")
        ready = client.get("/readyz")
        assert ready.status_code == 200
        paths = ready.json()["warmup_paths_ms"]
        assert set(APP_PATHS) | {"pipeline", "objects", "requests", "track_prepare"} == set(paths)
        assert all(ms >= 0 for ms in paths.values()) and ready.json()["warmup_ms"] >= paths["requests"]
        metrics = client.get("/metrics").text
        assert set(_warmup_samples(metrics)) == set(paths)
        for endpoint in ("/register", "/register/binary", "/track", "/track/binary", "/track/sessions"):
            assert _requests_of(metrics, endpoint) >= 1, endpoint  # each ran before any client's request
        assert len(state.sessions) == 0  # the warm-up's sessions were deleted


def test_a_broken_object_file_keeps_readyz_503_with_the_reason_until_fixed(tiny_estimator, tmp_path, caplog):
    objects = write_objects_dir(tmp_path / "objects")
    (objects / "broken.ply").write_bytes(b"ply\nformat ascii 1.0\nelement vertex 3\nend_header\n1 2\n")
    app = create_app(tiny_config(objects), estimator=tiny_estimator)
    state = app.state.fp
    with TestClient(app) as client:
        assert state.wait_ready(READY_TIMEOUT_S) is False
        answer = client.get("/readyz")
        assert answer.status_code == 503
        reason = answer.json()["reason"]
        assert reason.startswith(f"RuntimeError: objects directory {objects}: 1 file(s) did not load (broken.ply: ")
        assert "POST /readyz/retry" in reason
        assert any("start-up failed" in r.getMessage() and "broken.ply" in r.getMessage() for r in caplog.records)
        assert answer.json()["warmup_paths_ms"] is None  # nothing was warmed: never a half-warm ready
        (objects / "broken.ply").unlink()
        assert client.post("/readyz/retry").status_code == 202
        assert_ready(state, "the app once the broken file is gone")
        assert client.get("/readyz").json()["objects"] == 2


def test_a_failing_request_path_fails_the_start_up_naming_it(tiny_estimator, tmp_path, monkeypatch):
    from server import warmup

    real = warmup.track_body

    def broken_body(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - a binary track the server cannot parse
        return real(*args, **kwargs)[:-7]

    monkeypatch.setattr(warmup, "track_body", broken_body)
    app = create_app(tiny_config(write_objects_dir(tmp_path / "objects")), estimator=tiny_estimator)
    with TestClient(app) as client:
        assert app.state.fp.wait_ready(READY_TIMEOUT_S) is False
        answer = client.get("/readyz")
        assert answer.status_code == 503
        assert answer.json()["reason"].startswith("WarmupError: warm-up path track_binary: answered 4")
        assert len(app.state.fp.sessions) == 0  # the sessions it made are deleted even so


def test_the_first_requests_after_ready_build_no_step(app_client):
    """The shared app is ready: its warm-up registered ``block`` at ``--max-image``, so the object's track steps at
    that size are built (and on CUDA captured) already; a client's first requests there add none."""
    state = app_client.app.state.fp
    before = state.service.stats()
    prepares = state.track_preparer.ok + state.track_preparer.failed
    keys = state.track_preparer.key_count
    enc = encode(synthetic_frame(*MAX_IMAGE_HW, seed=3))
    registered = app_client.post("/register", data={"object_id": "block", "K": enc.K_json},
                                 files=enc.register_files())
    assert registered.status_code == 200, registered.text
    session = registered.json()["session_id"]
    frame = enc.frame
    assert app_client.post("/track", data={"session_id": session}, files=enc.track_files()).status_code == 200
    binary = app_client.post("/track/binary", content=track_body(frame.rgb, frame.depth_m, session_id=session),
                             headers=BINARY_HEADERS)
    assert binary.status_code == 200, binary.text
    both = app_client.post("/track/sessions", data={"session_ids": session}, files=enc.track_files())
    assert both.status_code == 200, both.text
    with app_client.websocket_connect("/track/stream") as ws:
        ws.send_bytes(register_message("block", frame.K, frame.rgb, frame.depth_m, frame.mask))
        assert json.loads(ws.receive_text())["type"] == "registered"
        ws.send_bytes(frame_message(1, frame.rgb, frame.depth_m))
        assert json.loads(ws.receive_text())["type"] == "pose"
    after = state.service.stats()
    assert after.track_graphs == before.track_graphs and after.track_captures == before.track_captures
    assert after.register_captures == before.register_captures
    assert state.track_preparer.ok + state.track_preparer.failed == prepares  # no preparation was scheduled
    assert state.track_preparer.key_count == keys
    app_client.delete(f"/sessions/{session}")
    assert np.isfinite(np.asarray(binary.json()["pose"])).all()


def test_after_ready_a_batch_mixing_loaded_objects_builds_no_step(app_client, monkeypatch):
    """The warm-up prepared the group of both loaded objects at ``--max-image`` (the preparer's job of the object
    its registers brought): a batch mixing them replays one of the group's steps (no new entry), judged in one
    validity pass, and so is a one-object batch."""
    from foundationpose import object_group

    state = app_client.app.state.fp
    runner = state.service._track_runner
    models = [state.objects.get(object_id).model for object_id in ("block", "block2")]
    both = frozenset(id(m) for m in models)
    group_sizes = sorted(k[1] for k in runner.keys() if k[0] == both and k[2:4] == tuple(MAX_IMAGE_HW))
    assert group_sizes == list(runner.config.batch_sizes)  # every batch size of the group, built before ready
    passes: list[int] = []
    real = object_group.measure_validity_rows

    def counted(depth, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        passes.append(depth.shape[0])
        return real(depth, *args, **kwargs)

    monkeypatch.setattr(object_group, "measure_validity_rows", counted)
    frame = synthetic_frame(*MAX_IMAGE_HW, seed=5)
    start = np.eye(4, dtype=np.float32)
    start[2, 3] = 0.5
    keys, steps = set(runner.keys()), runner.steps_run
    release = state.service.hold_tracks()
    futures = [state.service.submit_track(m, frame.rgb, frame.depth_m, frame.K, start, prev_frame="centred",
                                          inline_if_idle=False) for m in models]
    release()
    mixed = [f.result(READY_TIMEOUT_S) for f in futures]
    assert runner.steps_run == steps + 1 and passes == [2]  # one step over both objects, one validity pass
    alone = state.service.submit_track(models[0], frame.rgb, frame.depth_m, frame.K, start, prev_frame="centred",
                                       inline_if_idle=False).result(READY_TIMEOUT_S)
    assert passes == [2, 1]
    assert set(runner.keys()) == keys  # neither batch built a step
    assert all(r.validity is not None for r in (*mixed, alone))


@pytest.mark.slow
def test_ready_waits_for_every_ingest_worker_to_run_its_paths(tiny_estimator, tmp_path, monkeypatch):
    from server.ingest.hub import IngestHub

    warming_at_once: list[int] = []  # after each ask: how many workers were warming
    real_ask = IngestHub._ask_warm

    def ask(hub) -> None:  # noqa: ANN001
        real_ask(hub)
        warming_at_once.append(sum(c.warm == "asked" for c in hub._connections))

    monkeypatch.setattr(IngestHub, "_ask_warm", ask)
    app = create_app(tiny_config(write_objects_dir(tmp_path / "objects"), ingest_workers=2, ingest_port=0),
                     estimator=tiny_estimator)
    state = app.state.fp
    with TestClient(app) as client:
        assert_ready(state, "the app with two ingest workers")
        # ready came after both workers reported warm: no waiting for them here
        warm = client.portal.call(lambda: [c.warm for c in state.ingest._connections])
        assert warm == ["ok", "ok"]
        # one worker at a time: each warm-up's relayed register has the register lane to itself
        assert max(warming_at_once) == 1 and warming_at_once.count(1) >= 2
        paths = client.get("/readyz").json()["warmup_paths_ms"]
        assert {f"ingest_{name}" for name in WORKER_PATHS} <= set(paths)
        per_worker = client.portal.call(lambda: [dict(c.warm_paths) for c in state.ingest._connections])
        assert all(set(p) == set(WORKER_PATHS) for p in per_worker)
        # each worker's binary track and stream frame reached the hub (tracks and stream messages it answered)
        assert client.portal.call(lambda: state.ingest.requests) >= 2 * 3
        wait_for(lambda: _requests_of(client.get("/metrics").text, "/register/binary") >= 3,
                 "the relayed registers counted by the app")


def test_warm_frame_fits_the_ingest_ring(tmp_path: Path) -> None:
    config = tiny_config(tmp_path)
    assert warm_frame_hw(config.max_image_hw, config.max_upload_bytes) == tuple(config.max_image_hw)
