"""POST /register, POST /track and the session routes against the warmed-up tiny app."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from server import codecs
from tests.server._helpers import assert_error, assert_rigid, register


@pytest.mark.slow
def test_register_track_track_delete_lifecycle(client, enc):
    reg = register(client, enc)
    assert reg["object_id"] == "block"
    assert_rigid(reg["pose"])
    assert np.isfinite(reg["score"])
    assert reg["timings_ms"]["total"] > 0
    sid = reg["session_id"]

    first = client.post("/track", data={"session_id": sid}, files=enc.track_files())
    assert first.status_code == 200, first.text
    assert first.json()["frame"] == 1 and first.json()["session_id"] == sid
    T1 = assert_rigid(first.json()["pose"])

    info = client.get(f"/sessions/{sid}").json()
    np.testing.assert_array_equal(np.asarray(info["pose"]), T1)  # the session holds the returned pose
    assert info["frames"] == 1 and info["object_id"] == "block"
    np.testing.assert_allclose(info["K"], enc.frame.K)

    second = client.post("/track", data={"session_id": sid, "K": enc.K_json}, files=enc.track_files())
    assert second.status_code == 200, second.text
    assert second.json()["frame"] == 2
    T2 = assert_rigid(second.json()["pose"])
    assert not np.allclose(T1, T2)  # the refiner moved the pose (random weights never give a fixed point)

    assert client.delete(f"/sessions/{sid}").json() == {"session_id": sid, "deleted": True}
    assert_error(client.post("/track", data={"session_id": sid}, files=enc.track_files()),
                 404, "UnknownSessionError", "session_id", r"^session_id: no session ")
    assert_error(client.get(f"/sessions/{sid}"), 404, "UnknownSessionError", "session_id")
    assert_error(client.delete(f"/sessions/{sid}"), 404, "UnknownSessionError", "session_id")


@pytest.mark.slow
def test_failed_track_leaves_the_session_unchanged(client, enc):
    sid = register(client, enc)["session_id"]
    before = client.get(f"/sessions/{sid}").json()
    bad_depth = codecs.encode_mask_png(enc.frame.mask)  # 8-bit PNG
    assert_error(client.post("/track", data={"session_id": sid}, files={**enc.track_files(), "depth": ("d.png", bad_depth)}),
                 422, "InputError", "depth", r"^depth: expected a 16-bit single-channel PNG")
    assert_error(client.post("/track", data={"session_id": sid, "K": "[[1, 0, 0], [0, 1, 0]]"}, files=enc.track_files()),
                 422, "InputError", "K")
    after = client.get(f"/sessions/{sid}").json()
    assert after["pose"] == before["pose"] and after["frames"] == 0
    ok = client.post("/track", data={"session_id": sid}, files=enc.track_files())
    assert ok.status_code == 200 and ok.json()["frame"] == 1


@pytest.mark.slow
def test_stateless_track_matches_the_session_track(client, enc):
    reg = register(client, enc)
    session_step = client.post("/track", data={"session_id": reg["session_id"]}, files=enc.track_files()).json()
    stateless = client.post(
        "/track",
        data={"object_id": "block", "pose": json.dumps(reg["pose"]), "K": enc.K_json},
        files={"rgb": ("rgb.jpg", enc.rgb), "depth": ("depth", enc.depth_png)},  # names are ignored: content decides
    )
    assert stateless.status_code == 200, stateless.text
    body = stateless.json()
    assert body["session_id"] is None and body["frame"] is None
    # same frame; the start pose differs only by the mesh->centred float32 round trip (~1e-7)
    np.testing.assert_allclose(assert_rigid(body["pose"]), np.asarray(session_step["pose"]), atol=1e-4)


def test_stateless_track_accepts_npy_depth_in_metres(client, enc):
    start = np.eye(4)
    start[:3, 3] = [0.0, 0.0, 0.45]
    response = client.post(
        "/track",
        data={"object_id": "block", "pose": json.dumps(start.tolist()), "K": enc.K_json},
        files={"rgb": ("rgb.png", enc.rgb), "depth": ("depth.npy", enc.depth_npy)},
    )
    assert response.status_code == 200, response.text
    assert_rigid(response.json()["pose"])


def test_track_needs_a_session_or_a_pose(client, enc):
    assert_error(client.post("/track", files=enc.track_files()), 422, "InputError", "session_id", r"^session_id: expected")
    assert_error(client.post("/track", data={"object_id": "block"}, files=enc.track_files()),
                 422, "InputError", "session_id")
    no_k = client.post("/track", data={"object_id": "block", "pose": json.dumps(np.eye(4).tolist())},
                       files=enc.track_files())
    assert_error(no_k, 422, "InputError", "K", r"^K: expected a JSON 3x3 K")
    pose = np.eye(4)
    pose[0, 0] = 2.0
    assert_error(client.post("/track", data={"object_id": "block", "pose": json.dumps(pose.tolist()), "K": enc.K_json},
                             files=enc.track_files()), 422, "InputError", "pose", r"^pose: expected a rotation")
    assert_error(client.post("/track", data={"object_id": "nope", "pose": json.dumps(np.eye(4).tolist()), "K": enc.K_json},
                             files=enc.track_files()), 404, "UnknownObjectError", "object_id")
    assert_error(client.post("/track", data={"session_id": "x", "object_id": "block"}, files=enc.track_files()),
                 422, "InputError", "session_id", r"^session_id: expected either session_id")


@pytest.mark.slow
def test_sessions_expire_after_the_idle_ttl(client, enc, clock):
    sid = register(client, enc)["session_id"]
    store = client.app.state.fp.sessions
    clock.advance(store.ttl_s - 1)
    assert client.get(f"/sessions/{sid}").status_code == 200  # used: the idle timer restarts
    clock.advance(store.ttl_s - 1)
    assert client.post("/track", data={"session_id": sid}, files=enc.track_files()).status_code == 200
    # Sessions earlier tests left in the shared app are idle past the TTL now: swept here, on the app's loop as the
    # store's own sweeper does (every 30 s of real time, so on a slow machine it may run inside this test), so
    # that the count below sees this session's expiry alone.
    client.portal.call(store.sweep)
    assert sid in store
    expired_before = store.expired_total
    clock.advance(store.ttl_s + 1)
    assert_error(client.post("/track", data={"session_id": sid}, files=enc.track_files()), 404, "UnknownSessionError")
    assert store.expired_total == expired_before + 1
    assert sid not in store


@pytest.mark.slow  # dozens of CPU tracks: ~6 s
def test_concurrent_tracks_across_sessions_keep_per_session_order(client, enc):
    sessions = [register(client, enc)["session_id"] for _ in range(4)]
    # Two at a time per session: one running and one waiting is what admission allows (a third gets 429,
    # see test_admission.py); 4 rounds of 8 concurrent requests.
    jobs = [sid for sid in sessions for _ in range(2)]

    def track(sid):
        return sid, client.post("/track", data={"session_id": sid}, files=enc.track_files())

    results = []
    with ThreadPoolExecutor(max_workers=8) as pool:
        for _ in range(4):
            results += list(pool.map(track, jobs))
    by_session: dict[str, list[dict]] = {sid: [] for sid in sessions}
    for sid, response in results:
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["session_id"] == sid
        assert_rigid(body["pose"])
        by_session[sid].append(body)
    stats = client.app.state.fp.service.stats()
    assert stats.track_batcher.items >= stats.track_batcher.batches
    for sid, bodies in by_session.items():
        # serialised per session: frames 1..8, each a different step. Two requests starting from the same
        # pose would have given (nearly) the same answer: identical inputs, deterministic network, at most
        # ~1e-6 apart through batch composition; consecutive steps move the pose by far more than 1e-4.
        assert sorted(b["frame"] for b in bodies) == list(range(1, 9))
        poses = np.array([b["pose"] for b in sorted(bodies, key=lambda b: b["frame"])])
        gaps = np.abs(poses[:, None] - poses[None, :]).max(axis=(2, 3)) + np.eye(8)
        assert gaps.min() > 1e-4, gaps.min()
        last = max(bodies, key=lambda b: b["frame"])
        assert client.get(f"/sessions/{sid}").json()["pose"] == last["pose"]
        assert client.get(f"/sessions/{sid}").json()["frames"] == 8
