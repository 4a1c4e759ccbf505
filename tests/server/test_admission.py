"""Track overload is shed, not queued: per session one running + one waiting (429 beyond), a bounded
total (503 beyond), Retry-After from the measured track time. The track refiner is gated by the test."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor, as_completed

import pytest
from fastapi.testclient import TestClient

from server import create_app
from server.admission import RegisterAdmission, ServiceTimes, TrackAdmission
from server.errors import OverloadedError, SessionBusyError
from tests.server._helpers import (
    READY_TIMEOUT_S,
    assert_error,
    gated_estimator,
    register,
    tiny_config,
    write_objects_dir,
)


@pytest.fixture(scope="module")
def gated(tiny_estimator, tmp_path_factory):
    estimator, gate = gated_estimator(tiny_estimator, "track_refiner")
    gate.opened.set()
    # no request-path warm-up (test_ready_warm's subject; ~7 s of CPU): the tests measure their own service times
    config = tiny_config(write_objects_dir(tmp_path_factory.mktemp("objects")), track_capacity=3, warmup=False)
    app = create_app(config, estimator=estimator)
    with TestClient(app) as client:
        assert app.state.fp.wait_ready(READY_TIMEOUT_S), app.state.fp.failure
        try:
            yield client, gate
        finally:
            gate.opened.set()


@pytest.mark.slow
def test_100_concurrent_tracks_of_one_session_do_not_queue(gated, enc):
    client, gate = gated
    state = client.app.state.fp
    sid = register(client, enc)["session_id"]
    assert client.post("/track", data={"session_id": sid}, files=enc.track_files()).status_code == 200  # measured
    track_ms = state.service_times.ms("track")
    gate.rearm()

    def track():
        return client.post("/track", data={"session_id": sid}, files=enc.track_files())

    with ThreadPoolExecutor(max_workers=16) as pool:
        running = pool.submit(track)
        assert gate.entered.wait(READY_TIMEOUT_S)  # the first one is in the refiner
        rest = [pool.submit(track) for _ in range(99)]
        refused_futures = set()
        for done in as_completed(rest, timeout=READY_TIMEOUT_S):
            refused_futures.add(done)
            if len(refused_futures) == 98:  # all but the one waiting behind the running one
                break
        assert state.admission.wait_until(lambda a: a.admitted == 2 and a.held_by(sid) == 2, READY_TIMEOUT_S)
        gate.opened.set()
        (waiting,) = [f for f in rest if f not in refused_futures]
        answered = [running.result(READY_TIMEOUT_S), waiting.result(READY_TIMEOUT_S)]
    refused = [f.result() for f in refused_futures]
    for response in refused:
        body = assert_error(response, 429, "SessionBusyError", "session_id",
                            r"^session_id: this session already has 2 track requests admitted")
        assert body["field"] == "session_id"
        # two requests ahead of it, one measured track each; the header in whole seconds, rounded up
        assert response.headers["retry-after-ms"] == str(max(1, math.ceil(track_ms * 2)))
        assert response.headers["retry-after"] == str(max(1, math.ceil(track_ms * 2 / 1e3)))
    assert sorted(r.json()["frame"] for r in answered) == [2, 3]  # both admitted ones ran, in order
    assert state.admission.wait_until(lambda a: a.admitted == 0, READY_TIMEOUT_S)
    assert 'fp_requests_shed_total{endpoint="/track",reason="session_busy"} 98' in client.get("/metrics").text


@pytest.mark.slow
def test_the_track_lane_admits_a_bounded_total_then_answers_503(gated, enc):
    client, gate = gated
    state = client.app.state.fp
    sessions = [register(client, enc)["session_id"] for _ in range(4)]
    gate.rearm()
    with ThreadPoolExecutor(max_workers=4) as pool:
        held = [pool.submit(client.post, "/track", data={"session_id": sid}, files=enc.track_files())
                for sid in sessions[:3]]
        assert gate.entered.wait(READY_TIMEOUT_S)
        # the capacity: 3 admitted, wherever they wait (in the refiner, the batcher or a stage queue)
        assert state.admission.wait_until(lambda a: a.admitted == 3, READY_TIMEOUT_S)
        track_ms, parallel = state.service_times.ms("track"), state.admission.parallel
        full = client.post("/track", data={"session_id": sessions[3]}, files=enc.track_files())
        assert_error(full, 503, "OverloadedError", None, r"^the track lane is full \(3 requests admitted, capacity 3\)")
        assert full.headers["retry-after-ms"] == str(max(1, math.ceil(track_ms * 3 / parallel)))
        gate.opened.set()
        assert [f.result(READY_TIMEOUT_S).status_code for f in held] == [200, 200, 200]
    assert state.admission.wait_until(lambda a: a.admitted == 0, READY_TIMEOUT_S)
    assert client.post("/track", data={"session_id": sessions[3]}, files=enc.track_files()).status_code == 200


def test_admission_unit_rules():
    times = ServiceTimes(fallback_ms=1000.0)
    admission = TrackAdmission(capacity=3, session_waiting=1, parallel=2, times=times)
    assert times.ms("track") == 1000.0 and not times.measured("track")
    times.observe("track", 10.0)
    times.observe("track", 20.0)
    assert times.ms("track") == pytest.approx(12.0)  # EWMA, newest weight 0.2
    a1, a2 = admission.acquire("s"), admission.acquire("s")
    with pytest.raises(SessionBusyError) as busy:
        admission.acquire("s")
    assert busy.value.retry_after_ms == pytest.approx(24.0) and busy.value.status == 429
    other = admission.acquire(None)
    with pytest.raises(OverloadedError) as full:
        admission.acquire("t")
    assert full.value.retry_after_ms == pytest.approx(12.0 * 3 / 2) and full.value.status == 503
    a1.release()
    a1.release()  # idempotent
    assert admission.admitted == 2 and admission.held_by("s") == 1
    for ticket in (a2, other):
        ticket.release()
    assert admission.admitted == 0 and admission.held_by("s") == 0
    with pytest.raises(ValueError, match=r"^capacity must be >= 1"):
        TrackAdmission(capacity=0, session_waiting=1, parallel=1, times=times)


def test_a_saturated_lane_slower_than_its_budget_sheds_new_tracks():
    """The count bound alone sheds nothing on a slow device: the latency budget does, once the lane is full."""
    times = ServiceTimes(fallback_ms=1000.0)
    admission = TrackAdmission(capacity=100, session_waiting=1, parallel=2, times=times, latency_budget_ms=500.0)
    tickets = [admission.acquire(None), admission.acquire(None)]
    assert admission.acquire(None) is not None  # nothing measured yet: the budget needs a measurement
    times.observe("track", 400.0)
    tickets.append(admission.acquire(None))  # saturated but within budget: admitted
    for _ in range(20):
        times.observe("track", 3000.0)  # the lane became slow: EWMA follows
    with pytest.raises(OverloadedError, match=r"^the track lane is saturated \(recent latency \d+ ms, budget 500 ms") as shed:
        admission.acquire("s")
    assert shed.value.status == 503 and shed.value.retry_after_ms > 3000.0
    for ticket in tickets:
        ticket.release()
    ticket = admission.acquire(None)  # below saturation (1 admitted < parallel 2) a slow lane still admits
    ticket.release()
    assert admission.admitted == 1  # the extra acquire above without a kept ticket is still held
    with pytest.raises(ValueError, match=r"^latency_budget_ms must be > 0 or None"):
        TrackAdmission(capacity=1, session_waiting=1, parallel=1, times=times, latency_budget_ms=0.0)


@pytest.mark.slow
def test_binary_tracks_share_the_sessions_bound_and_the_lanes_capacity_with_multipart_ones(gated, enc):
    from server.client import BINARY_HEADERS, track_body

    client, gate = gated
    state = client.app.state.fp
    sessions = [register(client, enc)["session_id"] for _ in range(2)]
    body = {sid: track_body(enc.frame.rgb, enc.frame.depth_m, session_id=sid) for sid in sessions}
    gate.rearm()
    with ThreadPoolExecutor(max_workers=3) as pool:
        running = pool.submit(client.post, "/track", data={"session_id": sessions[0]}, files=enc.track_files())
        assert gate.entered.wait(READY_TIMEOUT_S)
        waiting = pool.submit(client.post, "/track/binary", content=body[sessions[0]], headers=BINARY_HEADERS)
        other = pool.submit(client.post, "/track/binary", content=body[sessions[1]], headers=BINARY_HEADERS)
        assert state.admission.wait_until(lambda a: a.admitted == 3 and a.held_by(sessions[0]) == 2, READY_TIMEOUT_S)
        busy = client.post("/track/binary", content=body[sessions[0]], headers=BINARY_HEADERS)
        assert_error(busy, 429, "SessionBusyError", "session_id", r"^session_id: this session already has 2 track")
        full = client.post("/track/binary", content=body[sessions[1]], headers=BINARY_HEADERS)
        assert_error(full, 503, "OverloadedError", None, r"^the track lane is full \(3 requests admitted, capacity 3\)")
        assert "retry-after" in busy.headers and "retry-after" in full.headers
        gate.opened.set()
        frames = [f.result(READY_TIMEOUT_S).json()["frame"] for f in (running, waiting, other)]
    assert frames == [1, 2, 1]  # the session's two in arrival order
    assert state.admission.wait_until(lambda a: a.admitted == 0, READY_TIMEOUT_S)
    metrics = client.get("/metrics").text
    assert 'fp_requests_shed_total{endpoint="/track/binary",reason="session_busy"} 1' in metrics


def test_register_admission_unit_rules():
    times = ServiceTimes(fallback_ms=1000.0)
    admission = RegisterAdmission(capacity=2, frames_in_flight=1, times=times)
    times.observe("register", 200.0)
    first, second = admission.acquire(), admission.acquire()
    with pytest.raises(OverloadedError, match=r"^the register lane is full \(2 registers admitted, capacity 2\)") as full:
        admission.acquire()
    assert full.value.retry_after_ms == pytest.approx(200.0 * 2) and full.value.status == 503
    first.release()
    first.release()  # idempotent
    assert admission.admitted == 1
    admission.acquire().release()
    second.release()
    assert admission.admitted == 0
    with pytest.raises(ValueError, match=r"^capacity must be >= 1"):
        RegisterAdmission(capacity=0, frames_in_flight=1, times=times)


def test_a_spare_register_ticket_is_given_only_while_the_lane_has_a_frame_free():
    admission = RegisterAdmission(capacity=4, frames_in_flight=2, times=ServiceTimes(fallback_ms=1000.0))
    spare = admission.try_spare()
    client = admission.acquire()
    assert spare is not None and admission.admitted == 2
    assert admission.try_spare() is None  # both frames taken: the spare work yields ...
    third = admission.acquire()  # ... while a client's register is still admitted, up to the capacity
    assert admission.admitted == 3 and admission.try_spare() is None
    spare.release()
    third.release()
    assert admission.admitted == 1
    again = admission.try_spare()
    assert again is not None and admission.admitted == 2
    again.release()
    client.release()
    assert admission.admitted == 0
    tiny = RegisterAdmission(capacity=1, frames_in_flight=4, times=ServiceTimes(fallback_ms=1000.0))
    held = tiny.try_spare()
    assert held is not None and tiny.try_spare() is None  # never above the capacity either
    held.release()


@pytest.mark.slow
def test_registers_beyond_the_admission_capacity_are_refused_before_their_decode(tiny_estimator, tmp_path, enc,
                                                                                  monkeypatch):
    """Registers running + waiting for a slot fill the admission; the next one gets 503 without being decoded."""
    from server.flow import validation

    estimator, gate = gated_estimator(tiny_estimator, "refiner")
    gate.opened.set()  # opened until the test's own registers (re-armed below)
    config = tiny_config(write_objects_dir(tmp_path / "objects"), submit_timeout_s=30.0, warmup=False)
    app = create_app(config, estimator=estimator)
    decoded = []
    real_decode = validation.decode_frame
    monkeypatch.setattr(validation, "decode_frame", lambda *a, **k: decoded.append(1) or real_decode(*a, **k))
    with TestClient(app) as client:
        state = app.state.fp
        assert state.wait_ready(READY_TIMEOUT_S), state.failure
        assert not decoded  # no warm-up: nothing decoded before the test's registers
        capacity = state.register_admission.capacity
        assert capacity == 2 * config.service.frames_in_flight
        gate.rearm()
        with ThreadPoolExecutor(max_workers=capacity) as pool:
            held = [pool.submit(register, client, enc) for _ in range(capacity)]
            assert gate.entered.wait(READY_TIMEOUT_S)
            admission = state.register_admission
            assert admission.wait_until(lambda a: a.admitted == capacity, READY_TIMEOUT_S)
            full = client.post("/register", data={"object_id": "block", "K": enc.K_json}, files=enc.register_files())
            assert_error(full, 503, "OverloadedError", None,
                         rf"^the register lane is full \({capacity} registers admitted, capacity {capacity}\)")
            assert int(full.headers["retry-after-ms"]) >= 1
            gate.opened.set()
            assert all("session_id" in f.result(READY_TIMEOUT_S) for f in held)
        assert admission.wait_until(lambda a: a.admitted == 0, READY_TIMEOUT_S)
        assert len(decoded) == capacity  # the refused register was never decoded
