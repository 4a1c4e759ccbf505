"""The Ray Serve application on a local Ray instance (2 CPUs) with 2 CPU pose replicas and a tiny algorithm.

One Serve application is started for the whole module. Each answer is compared with the
single-process server's (``app_client``: same random weights, same frames; CPU is deterministic),
a replica is killed while frames are in flight, and a burst of registers overflows the queues.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="ray[serve] is not installed (pip install -e '.[serve]')")
serve = pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install -e '.[serve]')")
pytestmark = pytest.mark.slow  # a local Ray with two replicas: ~15 s to start, then seconds per test

from foundationpose.synthetic.meshes import make_procedural_mesh  # noqa: E402
from foundationpose.synthetic.scenes import synthetic_frame  # noqa: E402
from server.client import (  # noqa: E402
    BINARY_HEADERS,
    frame_message,
    raw_track_form,
    register_message,
    start_message,
    track_body,
)
from server.metrics import Family  # noqa: E402
from server.serve.app import app_builder  # noqa: E402
from server.serve.ingress import POSE_DEPLOYMENT, SERVED_BY_HEADER  # noqa: E402
from server.serve.metrics_board import board_handle, labelled  # noqa: E402
from server.serve.settings import ServeSettings  # noqa: E402
from tests.server._helpers import (  # noqa: E402
    FRAME_HW,
    Encoded,
    assert_error,
    assert_rigid,
    encode,
    serve_app,
    tiny_config,
    write_objects_dir,
)

ROOT = Path(__file__).resolve().parents[2]
APP = "fp_test"
SESSIONS = (("block", 1), ("block2", 2), ("block", 3), ("block2", 4))  # (object, frame seed of the register)
TRACK_SEEDS = (5, 6)  # frames of each track round
REQUEST_TIMEOUT_S = 600.0  # a guard against a hang, not a timing: a register through Ray on a starved 2-core host can take minutes


@pytest.fixture(scope="module")
def frames() -> dict[int, Encoded]:
    return {seed: encode(synthetic_frame(*FRAME_HW, seed=seed)) for seed in {s for _, s in SESSIONS} | set(TRACK_SEEDS)}


@pytest.fixture(scope="module")
def serve_url(ray_serve, tmp_path_factory) -> Iterator[str]:
    """The shared local Ray (2 CPUs, no dashboard) running the app: 2 pose replicas of half a CPU, queues of 4 + 4."""
    objects_dir = write_objects_dir(tmp_path_factory.mktemp("serve_objects"))
    settings = ServeSettings(
        server=tiny_config(objects_dir, device="cpu", renderer="cpu", submit_timeout_s=30.0, register_capacity=64,
                           request_timeout_s=REQUEST_TIMEOUT_S),
        replicas=2, num_cpus=0.5, ingress_num_cpus=0.0, max_ongoing_requests=4, max_queued_requests=4,
        metrics_interval_s=0.05, health_check_period_s=1.0, app_name=APP,
    )
    with serve_app(ray_serve, settings) as url:
        yield url


@pytest.fixture(scope="module")
def http(serve_url) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=serve_url, timeout=REQUEST_TIMEOUT_S) as client:
        yield client


def _register(client, enc: Encoded, object_id: str) -> httpx.Response:
    return client.post("/register", data={"object_id": object_id, "K": enc.K_json}, files=enc.register_files())


def _track(client, session_id: str, enc: Encoded) -> httpx.Response:
    return client.post("/track", data={"session_id": session_id}, files=enc.track_files())


def _ok(response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def sessions(http, frames, app_client) -> list[dict]:
    """The SESSIONS registered at once on Serve, each beside the same register on the single-process server."""
    with ThreadPoolExecutor(len(SESSIONS)) as pool:
        answers = list(pool.map(lambda s: _register(http, frames[s[1]], s[0]), SESSIONS))
    out = []
    for (object_id, seed), answer in zip(SESSIONS, answers, strict=True):
        reference = _ok(_register(app_client, frames[seed], object_id))
        out.append({"object_id": object_id, "serve": _ok(answer), "reference": reference,
                    "served_by": [answer.headers[SERVED_BY_HEADER]]})
    return out


def _track_round(http, app_client, sessions, enc: Encoded) -> list[httpx.Response]:
    """One frame of every session at once on Serve; the same frames one by one on the single-process server."""
    with ThreadPoolExecutor(len(sessions)) as pool:
        answers = list(pool.map(lambda s: _track(http, s["serve"]["session_id"], enc), sessions))
    for session, answer in zip(sessions, answers, strict=True):
        got = _ok(answer)
        expected = _ok(_track(app_client, session["reference"]["session_id"], enc))
        assert got["pose"] == expected["pose"], "a Serve track differs from the single-process service's"
        assert got["frame"] == expected["frame"]
        session["served_by"].append(answer.headers[SERVED_BY_HEADER])
    return answers


def _wait_until(predicate, what: str, timeout_s: float = 60.0) -> None:
    """Poll a state of other processes (nothing to wait on but time) until it holds."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        threading.Event().wait(0.01)


def _track_frames_in_pipeline(replica: str) -> float:
    """The replica's track packages in flight, from the metrics it publishes every 0.05 s (NaN before any)."""
    families = ray.get(board_handle(APP).snapshots.remote(10.0)).get(replica, [])
    for fam in families:
        if fam.name == "fp_pipeline_in_flight":
            return sum(v for _, labels, v in fam.samples if dict(labels).get("lane") == "track")
    return float("nan")


def _metric(text: str, name: str) -> float:
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")]
    assert values, f"{name} missing from /metrics"
    return values[0]


def test_app_builder_takes_the_command_flags_for_serve_run(tmp_path) -> None:
    settings = tmp_path / "settings.toml"
    settings.write_text("warmup = false\n", encoding="utf-8")
    app = app_builder({"objects": str(tmp_path), "replicas": "2", "num_gpus": "0", "device": "cpu", "tiny": "true",
                       "config": str(settings)})
    assert isinstance(app, serve.Application)
    with pytest.raises(SystemExit):
        app_builder({"objects": str(tmp_path), "replicas": "zero"})


def test_replica_families_are_merged_with_a_replica_label() -> None:
    snapshots = {"r2": [Family("fp_x", "gauge", "X.").add(2, lane="track")],
                 "r1": [Family("fp_x", "gauge", "X.").add(1, lane="track"), Family("fp_y", "counter", "Y.").add(5)]}
    fams = {f.name: f for f in labelled(snapshots)}
    assert fams["fp_x"].samples == [("", (("replica", "r1"), ("lane", "track")), 1.0),
                                    ("", (("replica", "r2"), ("lane", "track")), 2.0)]
    assert fams["fp_y"].samples == [("", (("replica", "r1"),), 5.0)]


def test_ray_started_for_the_application_runs_its_workers_at_normal_cpu_priority(serve_url) -> None:
    @ray.remote(num_cpus=0)
    def niceness() -> int:
        return os.nice(0)

    assert ray.get(niceness.remote()) == 0  # Ray's own default is 15: replicas starved by any busy process


def test_ingress_docs_are_served_offline(http) -> None:
    """The ingress' Swagger UI loads its assets from the ingress itself (fastapi-offline), never from a CDN."""
    page = http.get("/docs")
    assert page.status_code == 200 and "swagger-ui-bundle.js" in page.text
    assert "cdn." not in page.text and "unpkg" not in page.text
    asset_urls = re.findall(r"""(?:src|href)=['"]([^'"]+)['"]""", page.text)
    assert asset_urls and all(url.startswith("/docs-assets/") for url in asset_urls), asset_urls
    assert all(http.get(url).status_code == 200 for url in asset_urls), asset_urls
    assert "/track/binary" in http.get("/openapi.json").json()["paths"]


def test_readyz_health_and_objects(http) -> None:
    assert http.get("/healthz").json()["status"] == "ok"
    ready = http.get("/readyz")
    assert ready.status_code == 200, ready.text
    assert ready.json()["ready"] is True and ready.json()["device"] == "cpu" and ready.json()["objects"] == 2
    assert sorted(o["object_id"] for o in http.get("/objects").json()["objects"]) == ["block", "block2"]


def test_sessions_spread_over_both_replicas_and_equal_the_single_process_answers(http, app_client, sessions, frames):
    for session in sessions:
        assert session["serve"]["pose"] == session["reference"]["pose"], "a Serve register differs"
        assert session["serve"]["score"] == session["reference"]["score"]
    _track_round(http, app_client, sessions, frames[TRACK_SEEDS[0]])
    _track_round(http, app_client, sessions, frames[TRACK_SEEDS[1]])
    assert len({r for s in sessions for r in s["served_by"]}) == 2, "every session ran on one replica"
    # The router sends a session's frames back to the replica of its last frame while that replica answers its
    # queue-length probe in time; on a loaded machine a probe can time out and the frame goes elsewhere (the answer
    # is the same: the call carries the session's state). So most frames, not every one, stay.
    served = [s["served_by"] for s in sessions]
    stayed = sum(a == b for by in served for a, b in zip(by, by[1:], strict=False))
    assert stayed >= sum(len(by) - 1 for by in served) / 2, served
    info = _ok(http.get(f"/sessions/{sessions[0]['serve']['session_id']}"))
    assert info["frames"] == 2 and info["pose"] == _ok(app_client.get(f"/sessions/{sessions[0]['reference']['session_id']}"))["pose"]


def test_several_sessions_in_one_request_through_serve_equal_the_single_process_answers(http, app_client, sessions,
                                                                                         frames) -> None:
    enc = frames[TRACK_SEEDS[0]]
    response = http.post("/track/sessions", data={"session_ids": ",".join(s["serve"]["session_id"] for s in sessions)},
                         files=enc.track_files())
    entries = _ok(response)["sessions"]
    assert [e["session_id"] for e in entries] == [s["serve"]["session_id"] for s in sessions]
    for session, entry in zip(sessions, entries, strict=True):
        expected = _ok(_track(app_client, session["reference"]["session_id"], enc))
        assert entry["status"] == 200 and entry["pose"] == expected["pose"] and entry["frame"] == expected["frame"]


def test_a_register_with_a_box_through_serve_equals_the_single_process_answer(http, app_client, frames) -> None:
    enc = frames[SESSIONS[0][1]]
    ys, xs = np.nonzero(enc.frame.mask)
    data = {"object_id": "block", "K": enc.K_json, "box": f"{xs.min()},{ys.min()},{xs.max() + 1},{ys.max() + 1}"}
    files = {k: v for k, v in enc.register_files().items() if k != "mask"}
    served = _ok(http.post("/register", data=data, files=files))
    assert served["pose"] == _ok(app_client.post("/register", data=data, files=files))["pose"]
    assert _ok(http.delete(f"/sessions/{served['session_id']}"))["deleted"] is True


def test_errors_are_answered_like_the_single_process_server(http, frames) -> None:
    enc = frames[1]
    assert_error(_track(http, "no-such-session", enc), 404, "UnknownSessionError", "session_id")
    assert_error(_register(http, enc, "missing"), 404, "UnknownObjectError", "object_id")
    bad_k = http.post("/register", data={"object_id": "block", "K": "[[1, 0], [0, 1]]"}, files=enc.register_files())
    assert_error(bad_k, 422, "InputError", "K", match=r"K: expected")  # decoded and refused on a replica
    no_pose = http.post("/track", data={"object_id": "block"}, files=enc.track_files())
    assert_error(no_pose, 422, "InputError", "session_id")


def test_raw_frames_through_serve_equal_the_png_answers_and_report_the_serve_hop(http, app_client, frames) -> None:
    """A raw-frame register + track (decoded on a replica by server.pose_flow) answers the same poses as the
    PNGs of the same pixels on the single-process server; timings hold the replica's phases and the hop."""
    first, second = frames[1], frames[TRACK_SEEDS[0]]
    fields, files = raw_track_form(first.frame.rgb, first.frame.depth_m)
    h, w = FRAME_HW
    files["mask"] = ("mask.raw", (first.frame.mask > 0).astype("uint8").tobytes())
    registered = _ok(http.post("/register", data={**fields, "mask_shape": f"{h},{w}", "object_id": "block",
                                                  "K": first.K_json}, files=files))
    reference = _ok(_register(app_client, first, "block"))
    assert registered["pose"] == reference["pose"]
    fields, files = raw_track_form(second.frame.rgb, second.frame.depth_m)
    answer = http.post("/track", data={"session_id": registered["session_id"], **fields}, files=files)
    tracked = _ok(answer)
    assert tracked["pose"] == _ok(_track(app_client, reference["session_id"], second))["pose"]
    timings = tracked["timings_ms"]
    for phase in ("receive", "parse", "queue", "serve_hop", "decode", "validate", "pipeline", "resume"):
        assert timings[phase] >= 0.0, phase
    assert timings["pipeline"] > 0.0
    assert "serve_hop;dur=" in answer.headers["server-timing"] and "decode;dur=" in answer.headers["server-timing"]
    bad = http.post("/track", data={"session_id": registered["session_id"], **fields, "rgb_shape": f"{h},{w - 1},3"},
                    files=files)
    assert_error(bad, 422, "InputError", "rgb", match=r"^rgb: expected \d+ bytes of raw uint8")


def test_binary_register_and_track_through_serve_equal_the_single_process_answers(http, app_client, frames) -> None:
    """POST /register/binary and /track/binary on the ingress (session and stateless) answer the poses of the
    single-process server for the same bodies; a wrong Content-Type is 415 there too."""
    first, second = frames[1], frames[TRACK_SEEDS[0]]
    f = first.frame
    registered = _ok(http.post("/register/binary", content=register_message("block", f.K, f.rgb, f.depth_m, f.mask),
                               headers=BINARY_HEADERS))
    reference = _ok(_register(app_client, first, "block"))
    assert registered["pose"] == reference["pose"]
    # the single-process answers come from its multipart /track with PNGs of the same pixels (the shared app's
    # /track/binary counters belong to test_track_binary)
    session_body = track_body(second.frame.rgb, second.frame.depth_m, session_id=registered["session_id"])
    served = _ok(http.post("/track/binary", content=session_body, headers=BINARY_HEADERS))
    assert served["pose"] == _ok(_track(app_client, reference["session_id"], second))["pose"]
    assert served["timings_ms"]["serve_hop"] >= 0.0
    stateless_body = track_body(second.frame.rgb, second.frame.depth_m, object_id="block", pose=registered["pose"],
                                K=second.frame.K)
    stateless = _ok(http.post("/track/binary", content=stateless_body, headers=BINARY_HEADERS))
    local = _ok(app_client.post("/track", data={"object_id": "block", "pose": json.dumps(reference["pose"]),
                                                "K": second.K_json}, files=second.track_files()))
    assert stateless["pose"] == local["pose"]
    wrong = http.post("/track/binary", content=b"{}", headers={"Content-Type": "text/plain"})
    assert_error(wrong, 415, "UnsupportedMediaTypeError", "Content-Type", match=r"^Content-Type: expected application/")


def test_the_stream_runs_its_frames_on_the_replicas_and_ends_its_session(serve_url, http, app_client, frames) -> None:
    """WS /track/stream on the ingress: a register and two frames, each on a pose replica, equal to the
    single-process HTTP answers of the same frames; closing the connection ends the session."""
    from websockets.sync.client import connect

    first = frames[1]
    reference = _ok(_register(app_client, first, "block"))
    f = first.frame
    with connect(serve_url.replace("http://", "ws://") + "/track/stream", open_timeout=30) as ws:
        ws.send(register_message("block", f.K, f.rgb, f.depth_m, f.mask))
        registered = json.loads(ws.recv(timeout=REQUEST_TIMEOUT_S))
        assert registered["type"] == "registered", registered
        assert registered["pose"] == reference["pose"] and registered["replica"]
        session_id = registered["session_id"]
        for n, seed in enumerate(TRACK_SEEDS, start=1):
            nxt = frames[seed].frame
            ws.send(frame_message(n, nxt.rgb, nxt.depth_m))
            reply = json.loads(ws.recv(timeout=REQUEST_TIMEOUT_S))
            assert (reply["type"], reply["frame"], reply["frames"], reply["skipped"]) == ("pose", n, n, []), reply
            assert reply["pose"] == _ok(_track(app_client, reference["session_id"], frames[seed]))["pose"]
            assert {"decode", "validate", "queue", "serve_hop", "pipeline"} <= set(reply["timings_ms"])
        assert _ok(http.get(f"/sessions/{session_id}"))["frames"] == 2
        ws.send(frame_message(3, nxt.rgb[:, :-1].copy(), nxt.depth_m))  # bad: answered, the session goes on
        bad = json.loads(ws.recv(timeout=REQUEST_TIMEOUT_S))
        assert bad["type"] == "error" and bad["frame"] == 3 and bad["error"]["type"] == "InputError", bad
    _wait_until(lambda: http.get(f"/sessions/{session_id}").status_code == 404, "the stream's session to end")


def test_a_stream_started_from_a_pose_tracks_on_the_replicas(serve_url, app_client, frames) -> None:
    """A start message on the ingress (no register; the ingress holds the session): its first frame, on a
    pose replica, equals the single-process stateless track from the same pose."""
    from websockets.sync.client import connect

    pose = _ok(_register(app_client, frames[1], "block"))["pose"]
    nxt = frames[TRACK_SEEDS[0]]
    with connect(serve_url.replace("http://", "ws://") + "/track/stream", open_timeout=30) as ws:
        ws.send(start_message("block", nxt.frame.K, [row[:3] for row in pose[:3]]))  # a 3x3: not a pose
        bad = json.loads(ws.recv(timeout=REQUEST_TIMEOUT_S))
        assert (bad["type"], bad["error"]["field"]) == ("error", "pose"), bad
        ws.send(start_message("block", nxt.frame.K, pose))
        started = json.loads(ws.recv(timeout=REQUEST_TIMEOUT_S))
        assert (started["type"], started["pose"], started["score"]) == ("started", pose, None), started
        ws.send(frame_message(1, nxt.frame.rgb, nxt.frame.depth_m))
        reply = json.loads(ws.recv(timeout=REQUEST_TIMEOUT_S))
        assert (reply["type"], reply["frame"], reply["frames"]) == ("pose", 1, 1) and reply["replica"], reply
    stateless = app_client.post("/track", data={"object_id": "block", "pose": json.dumps(pose), "K": nxt.K_json},
                                files=nxt.track_files())
    assert reply["pose"] == _ok(stateless)["pose"]


def test_metrics_cover_the_ingress_and_every_replica(http) -> None:
    scrapes: list[str] = []

    def both_replicas_fresh() -> bool:
        # one scrape must hold both: a replica whose last snapshot is older than the freshness window (a busy
        # machine) drops out of a scrape until it publishes again
        scrapes.append(http.get("/metrics").text)
        replicas = {line.split('replica="')[1].split('"')[0] for line in scrapes[-1].splitlines()
                    if line.startswith("fp_pipeline_submitted_total{")}
        return _metric(scrapes[-1], "fp_serve_replicas_reporting") == 2 and len(replicas) == 2

    _wait_until(both_replicas_fresh, "a scrape with both replicas' metrics")
    assert 'fp_http_requests_total{endpoint="/register",method="POST",status="200"}' in scrapes[-1]


def test_uploaded_object_is_loaded_by_the_replicas_from_the_shared_directory(http, frames, sessions) -> None:
    mesh = make_procedural_mesh("vertex_color_asym").export(file_type="ply")  # the same mesh as "block"
    created = http.post("/objects", data={"object_id": "uploaded"}, files={"mesh": ("m.ply", mesh, "application/octet-stream")})
    assert created.status_code == 201, created.text
    got = _ok(_register(http, frames[1], "uploaded"))
    assert got["pose"] == sessions[0]["serve"]["pose"]  # same mesh, same frame as the first "block" session
    assert _ok(http.delete("/objects/uploaded"))["sessions_ended"] == 1
    assert_error(_register(http, frames[1], "uploaded"), 404, "UnknownObjectError", "object_id")


def test_a_replica_killed_mid_run_loses_no_session(http, app_client, sessions, frames) -> None:
    counts = Counter(s["served_by"][-1] for s in sessions)
    victim_id = counts.most_common(1)[0][0]
    victim = ray.get_actor(f"SERVE_REPLICA::{APP}#{POSE_DEPLOYMENT}#{victim_id}", namespace="serve")
    retries_before = _metric(http.get("/metrics").text, "fp_serve_retries_total")
    enc = frames[TRACK_SEEDS[0]]
    with ThreadPoolExecutor(len(sessions)) as pool:
        _wait_until(lambda: _track_frames_in_pipeline(victim_id) == 0, "an idle snapshot of the victim")
        in_flight = [pool.submit(_track, http, s["serve"]["session_id"], enc) for s in sessions]

        def victim_computing() -> bool:  # a frame in its pipeline (call accepted) and not yet answered
            assert not all(f.done() for f in in_flight), "the round ended before the victim took a frame"
            return _track_frames_in_pipeline(victim_id) > 0 and ray.get(victim.get_num_ongoing_requests.remote()) > 0

        _wait_until(victim_computing, "the victim computing a frame")
        ray.kill(victim, no_restart=True)
        answers = [f.result() for f in in_flight]
    for session, answer in zip(sessions, answers, strict=True):
        got = _ok(answer)
        expected = _ok(_track(app_client, session["reference"]["session_id"], enc))
        assert got["pose"] == expected["pose"] and got["frame"] == expected["frame"]
        assert answer.headers[SERVED_BY_HEADER] != victim_id
    assert _metric(http.get("/metrics").text, "fp_serve_retries_total") > retries_before
    _track_round(http, app_client, sessions, frames[TRACK_SEEDS[1]])  # every session goes on, on a live replica
    for session in sessions:
        reference = _ok(app_client.get(f"/sessions/{session['reference']['session_id']}"))
        assert _ok(http.get(f"/sessions/{session['serve']['session_id']}"))["frames"] == reference["frames"]


def test_overload_is_answered_503_with_retry_after(serve_url, http, frames, sessions) -> None:
    enc = frames[1]
    burst = 20  # stateless tracks (no session lock orders them): more than 2 replicas x 4 ongoing + 4 queued
    form = {"object_id": "block", "pose": json.dumps(sessions[0]["serve"]["pose"]), "K": enc.K_json}

    async def fire() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=burst)
        async with httpx.AsyncClient(base_url=serve_url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
            return await asyncio.gather(*(client.post("/track", data=form, files=enc.track_files())
                                          for _ in range(burst)))

    answers = asyncio.run(fire())
    statuses = Counter(a.status_code for a in answers)
    assert set(statuses) <= {200, 503}, statuses
    assert statuses[503] >= 1 and statuses[200] >= 1, statuses
    poses = set()
    for answer in answers:
        if answer.status_code == 503:
            assert_error(answer, 503, "BusyError")
            assert answer.headers["retry-after"] == "1"
        else:
            poses.add(json.dumps(assert_rigid(answer.json()["pose"]).tolist()))
    assert len(poses) == 1  # the same stateless step, whichever replica computed it
    assert _metric(http.get("/metrics").text, "fp_serve_backpressure_total") >= statuses[503]
    assert http.post("/track", data=form, files=enc.track_files()).status_code == 200  # drained: not stuck
