"""What every answer says about its pose: validity, the session's state, automatic recovery, re-registering a
session on the client's mask, and an object's own symmetries and validity thresholds."""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest
from fastapi.testclient import TestClient

from foundationpose.estimator import Tracker
from foundationpose.synthetic.meshes import make_procedural_mesh
from foundationpose.validity import MEASUREMENTS
from server import codecs, create_app
from server.client import frame_message, register_message
from server.metrics import RECOVERY_OUTCOMES
from tests.server._helpers import MAX_IMAGE_HW, READY_TIMEOUT_S, assert_error, tiny_config, write_objects_dir

# every pose that keeps the object in view of a depth map with readings there is valid: with random weights only
# the frames decide (an object gone from the depth is invalid)
LENIENT = {"depth_tolerance_diameters": 1000, "min_support": 1e-6, "min_consistent": 1e-6,
           "max_translation_m": 1000, "max_rotation_deg": 1000}
TRUST_FIELDS = {"valid", "confidence", "state", "source", "measurements"}


def _objects(root):
    write_objects_dir(root)
    (root / "lenient").mkdir()
    make_procedural_mesh("vertex_color_asym").export(root / "lenient" / "mesh.ply")
    (root / "lenient" / "object.json").write_text(json.dumps({"validity": LENIENT}), encoding="utf-8")
    return root


def _client(tiny_estimator, root, **overrides) -> Iterator[TestClient]:
    # no request-path warm-up: nothing here is about it (test_ready_warm is), and it cost each app ~5 s of CPU
    app = create_app(tiny_config(root, warmup=False, **overrides), estimator=tiny_estimator)
    with TestClient(app) as client:
        assert app.state.fp.wait_ready(READY_TIMEOUT_S), app.state.fp.failure
        yield client


@pytest.fixture(scope="module")
def recovering(tiny_estimator, tmp_path_factory) -> Iterator[TestClient]:
    """A server whose lost sessions recover by themselves (the default)."""
    yield from _client(tiny_estimator, _objects(tmp_path_factory.mktemp("objects")), recovery="on")


@pytest.fixture(scope="module")
def not_recovering(tiny_estimator, tmp_path_factory) -> Iterator[TestClient]:
    yield from _client(tiny_estimator, _objects(tmp_path_factory.mktemp("objects")), recovery="off")


@pytest.fixture(scope="module")
def gone(enc) -> dict:
    """The frame with the object gone: no depth readings but a few pixels in a corner."""
    depth = np.zeros_like(enc.frame.depth_m)
    depth[-4:, -4:] = 0.5
    return {"rgb": ("rgb.png", enc.rgb, "image/png"),
            "depth": ("depth.png", codecs.encode_depth_png_mm(depth), "image/png")}


def _register(client, enc, object_id="lenient", **fields) -> dict:
    response = client.post("/register", data={"object_id": object_id, "K": enc.K_json, **fields},
                           files=enc.register_files())
    assert response.status_code == 200, response.text
    return response.json()


def _track(client, session_id, files) -> dict:
    response = client.post("/track", data={"session_id": session_id}, files=files)
    assert response.status_code == 200, response.text
    return response.json()


def _states(answers) -> list[tuple]:
    return [(a["state"], a["valid"], a["source"]) for a in answers]


@pytest.mark.slow
def test_answers_carry_validity_state_and_measurements(recovering, enc) -> None:
    reg = _register(recovering, enc)
    assert TRUST_FIELDS <= set(reg)
    assert (reg["state"], reg["valid"], reg["source"]) == ("tracking", True, "register (client mask)")
    assert 0.0 <= reg["confidence"] <= 1.0 and list(reg["measurements"]) == list(MEASUREMENTS)
    step = _track(recovering, reg["session_id"], enc.track_files())
    assert TRUST_FIELDS <= set(step) and (step["state"], step["valid"], step["source"]) == ("tracking", True, "track")
    assert recovering.get(f"/sessions/{reg['session_id']}").json()["state"] == "tracking"
    stateless = recovering.post("/track", data={"object_id": "lenient", "K": enc.K_json,
                                                "pose": json.dumps(step["pose"])}, files=enc.track_files())
    body = stateless.json()
    assert (body["session_id"], body["state"], body["source"]) == (None, None, "track")
    assert body["valid"] is True and body["confidence"] == pytest.approx(step["confidence"], abs=0.2)


@pytest.mark.slow
def test_a_session_is_lost_within_three_frames_and_recovers_by_itself(recovering, enc, gone) -> None:
    sid = _register(recovering, enc)["session_id"]
    answers = [_track(recovering, sid, files) for files in (gone, gone, gone, gone)]
    assert _states(answers) == [("uncertain", False, "track"), ("uncertain", False, "track"),
                                ("lost", False, "track"),
                                ("lost", False, "track")]  # no candidate in a depth without the object: tracked
    assert all(a["confidence"] == 0.0 for a in answers)
    back = [_track(recovering, sid, enc.track_files()) for _ in range(3)]
    # the object is back: a register on the candidate found near its last valid pose, confirmed by the next frame
    assert _states(back) == [("recovering", False, "recovery register (region candidate)"),
                             ("tracking", True, "track"), ("tracking", True, "track")]
    assert [a["frame"] for a in answers + back] == [1, 2, 3, 4, 5, 6, 7]


@pytest.mark.slow
def test_a_lost_frame_without_a_candidate_is_decoded_once_for_its_search_and_its_track(recovering, enc, gone,
                                                                                      monkeypatch) -> None:
    from server.flow import validation

    decodes = []
    decode = validation.decode_frame
    monkeypatch.setattr(validation, "decode_frame", lambda *a, **kw: decodes.append(1) or decode(*a, **kw))
    fp = recovering.app.state.fp
    sid = _register(recovering, enc)["session_id"]
    assert [_track(recovering, sid, gone)["state"] for _ in range(3)][-1] == "lost"
    searched = fp.metrics.recovery_count("no_candidate")
    decodes.clear()
    answer = _track(recovering, sid, gone)  # searched (no candidate in that depth), then tracked
    assert (answer["state"], answer["source"]) == ("lost", "track")
    assert fp.metrics.recovery_count("no_candidate") == searched + 1
    assert len(decodes) == 1


@pytest.mark.slow
def test_a_lost_session_tracks_without_searching_while_the_register_lane_has_no_frame_free(recovering, enc,
                                                                                          gone) -> None:
    fp = recovering.app.state.fp
    sid = _register(recovering, enc)["session_id"]
    assert [_track(recovering, sid, gone)["state"] for _ in range(3)][-1] == "lost"
    before = {outcome: fp.metrics.recovery_count(outcome) for outcome in RECOVERY_OUTCOMES}
    held = []  # the lane's free frames, as the clients' registers in flight would hold them
    while (ticket := fp.register_admission.try_spare()) is not None:
        held.append(ticket)
    assert len(held) == fp.register_admission.frames_in_flight
    try:
        waiting = [_track(recovering, sid, enc.track_files()) for _ in range(2)]
    finally:
        for ticket in held:
            ticket.release()
    assert _states(waiting) == [("lost", False, "track"), ("lost", False, "track")]  # the object is back, unsearched
    back = _track(recovering, sid, enc.track_files())
    assert (back["state"], back["source"]) == ("recovering", "recovery register (region candidate)")
    after = {outcome: fp.metrics.recovery_count(outcome) for outcome in RECOVERY_OUTCOMES}
    assert {k: after[k] - before[k] for k in RECOVERY_OUTCOMES} == {"registered": 1, "no_candidate": 0,
                                                                   "refused": 0, "deferred": 2}
    assert fp.register_admission.wait_until(lambda a: a.admitted == 0, READY_TIMEOUT_S)
    metrics = recovering.get("/metrics").text
    assert f'fp_recovery_frames_total{{outcome="deferred"}} {after["deferred"]}' in metrics


def _decoded(files: dict) -> list[np.ndarray]:
    """The rgb, depth (and mask) of an upload as the server decodes them."""
    decoders = {"rgb": codecs.decode_rgb, "depth": codecs.decode_depth, "mask": codecs.decode_mask}
    return [decoders[name](files[name][1], MAX_IMAGE_HW) for name in ("rgb", "depth", "mask") if name in files]


@pytest.mark.slow
def test_a_server_session_answers_as_a_tracker_through_a_loss_and_a_recovery(recovering, tiny_estimator, enc,
                                                                             gone) -> None:
    """The same frames, one session each: the server's answers (pose, valid, confidence, state, source) are the
    Python Tracker's, frame by frame, the loss, the frame without a candidate and the recovery register included."""
    fp = recovering.app.state.fp
    tracker = Tracker(tiny_estimator, fp.objects.get("lenient").model, recovery=fp.sessions.recovery)
    frames = [enc.track_files(), *[gone] * 4, *[enc.track_files()] * 3]
    served = [_register(recovering, enc)]
    served += [_track(recovering, served[0]["session_id"], files) for files in frames]
    rgb, depth, mask = _decoded(enc.register_files())
    tracked = [tracker.register(rgb, depth, mask, enc.frame.K)]
    tracked += [tracker.track(*_decoded(files), enc.frame.K) for files in frames]

    def fields(result) -> tuple:
        report = result.session
        return (report.state.value, report.pose_valid, round(report.confidence, 6), report.source)

    assert [(a["state"], a["valid"], a["confidence"], a["source"]) for a in served] == [fields(r) for r in tracked]
    assert {a["source"] for a in served} == {"register (client mask)", "track", "recovery register (region candidate)"}
    for answer, result in zip(served, tracked, strict=True):
        np.testing.assert_array_equal(np.asarray(answer["pose"]), result.cam_from_mesh)


@pytest.mark.slow
def test_without_recovery_a_lost_session_tracks_on_until_the_client_re_registers_it(not_recovering, enc,
                                                                                     gone) -> None:
    client = not_recovering
    sid = _register(client, enc)["session_id"]
    for _ in range(3):
        _track(client, sid, gone)
    lost = _track(client, sid, enc.track_files())
    assert (lost["state"], lost["valid"], lost["source"]) == ("lost", False, "track")  # valid frame, not trusted yet
    again = _register(client, enc, session_id=sid)  # the client's mask: trusted at once when valid
    assert (again["session_id"], again["state"], again["valid"]) == (sid, "tracking", True)
    info = client.get(f"/sessions/{sid}").json()
    assert (info["state"], info["frames"]) == ("tracking", 4)  # a register is not a track step
    np.testing.assert_allclose(info["pose"], again["pose"])


@pytest.mark.slow
def test_re_registering_names_the_session_and_its_object(not_recovering, enc) -> None:
    sid = _register(not_recovering, enc)["session_id"]
    response = not_recovering.post("/register", data={"object_id": "block", "K": enc.K_json, "session_id": sid},
                                   files=enc.register_files())
    assert_error(response, 422, "InputError", "object_id", r"object_id: expected the session's object 'lenient'")
    response = not_recovering.post("/register", data={"object_id": "lenient", "K": enc.K_json,
                                                      "session_id": "no-such-session"}, files=enc.register_files())
    assert_error(response, 404, "UnknownSessionError")


@pytest.mark.slow
def test_a_stream_reports_the_state_with_every_pose(recovering, enc) -> None:
    f = enc.frame
    with recovering.websocket_connect("/track/stream") as ws:
        ws.send_bytes(register_message("lenient", f.K, f.rgb, f.depth_m, f.mask))
        registered = ws.receive_json()
        assert (registered["type"], registered["state"], registered["valid"]) == ("registered", "tracking", True)
        ws.send_bytes(frame_message(1, f.rgb, f.depth_m))
        pose = ws.receive_json()
        assert pose["type"] == "pose" and TRUST_FIELDS <= set(pose) and pose["state"] == "tracking"
        empty = np.zeros_like(f.depth_m)
        empty[-4:, -4:] = 0.5
        ws.send_bytes(frame_message(2, f.rgb, empty))
        assert (ws.receive_json()["state"]) == "uncertain"
        ws.send_bytes(register_message("lenient", f.K, f.rgb, f.depth_m, f.mask))  # the client's mask
        again = ws.receive_json()
        assert (again["type"], again["session_id"], again["state"]) == ("registered", registered["session_id"],
                                                                         "tracking")


@pytest.mark.slow
def test_an_upload_declares_symmetries_and_validity_thresholds(recovering, enc) -> None:
    mesh = make_procedural_mesh("plain_asym").export(file_type="ply")
    response = recovering.post("/objects", data={"object_id": "sym", "symmetry": "z:2 x:2",
                                                 "validity": json.dumps({"max_translation_m": 0.05})},
                               files={"mesh": ("m.ply", mesh, "application/octet-stream")})
    assert response.status_code == 201, response.text
    info = response.json()
    assert info["symmetry"] == {"declared": ["discrete z 2", "discrete x 2"], "transforms": 4, "source": "declared"}
    assert info["validity"]["max_translation_m"] == 0.05 and info["validity"]["min_support"] > 0
    reg = _register(recovering, enc, object_id="sym")
    assert np.isfinite(reg["pose"]).all() and reg["state"] in ("tracking", "lost")
    for fields, field in ((dict(symmetry="z:1"), "symmetry"), (dict(symmetry="q:4"), "symmetry"),
                          (dict(validity="{"), "validity"), (dict(validity='{"min_support": 2}'), "validity"),
                          (dict(validity='{"no_such_threshold": 1}'), "validity")):
        bad = recovering.post("/objects", data={"object_id": "sym_bad", **fields},
                              files={"mesh": ("m.ply", mesh, "application/octet-stream")})
        assert_error(bad, 422, "InputError", field)
    assert recovering.get("/objects/sym_bad").status_code == 404


@pytest.mark.slow
def test_metrics_count_the_sessions_by_state(not_recovering, enc, gone) -> None:
    def by_state() -> dict[str, float]:
        lines = not_recovering.get("/metrics").text.splitlines()
        return {line.split('state="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                for line in lines if line.startswith("fp_sessions_by_state{")}

    before = by_state()
    assert set(before) == {"tracking", "uncertain", "lost", "recovering"}
    sid = _register(not_recovering, enc)["session_id"]
    assert by_state()["tracking"] == before["tracking"] + 1
    for _ in range(3):
        _track(not_recovering, sid, gone)
    after = by_state()
    assert (after["tracking"], after["lost"]) == (before["tracking"], before["lost"] + 1)
    not_recovering.delete(f"/sessions/{sid}")
    assert by_state() == before


@pytest.mark.slow  # an app's whole warm-up on the CPU: ~5 s
def test_the_warm_up_tracks_its_sessions_and_never_starts_a_recovery(tiny_estimator, tmp_path) -> None:
    """With random weights every warm-up session is lost after its third frame (as with trained weights, whose
    object is not the warm-up's): its later frames must still run the track paths they warm, not recoveries."""
    app = create_app(tiny_config(_objects(tmp_path), warmup=True, recovery="on"), estimator=tiny_estimator)
    with TestClient(app):
        fp = app.state.fp
        assert fp.wait_ready(READY_TIMEOUT_S), fp.failure
        assert {outcome: fp.metrics.recovery_count(outcome) for outcome in RECOVERY_OUTCOMES} == dict.fromkeys(
            RECOVERY_OUTCOMES, 0)
        assert {"track_binary", "track_sessions", "stream"} <= set(fp.warmup_paths_ms)
