"""tools/loadtest (``python -m tools.loadtest``): the loopback guard, the request budget, the retry waits, the summary, and short runs
against a live server: the set-up phase (sessions first, refusals waited out), diverged tracks, a
stream's stateless reconnect (a start message, no register), and ``--track-url`` (the tracks to a second
port, everything else to ``--url``; ``--spawn-ingest-workers`` once the server has ingest workers)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from server.admission import RegisterAdmission
from server.errors import OverloadedError
from tools import loadtest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://localhost:1", "http://[::1]:8000/", "https://127.0.0.1"])
def test_loopback_urls_are_allowed(url):
    loadtest.check_loopback(url)


@pytest.mark.parametrize("url", ["http://10.0.0.5:8000", "http://example.com", "http://127.0.0.2:8000",
                                 "http://0.0.0.0:8000", "ftp://127.0.0.1", "http://localhost.evil.com"])
def test_other_hosts_are_refused(url):
    with pytest.raises(ValueError, match=r"^refusing to load"):
        loadtest.check_loopback(url)
    with pytest.raises(SystemExit):
        loadtest.main(["--url", url])


def test_a_refused_client_waits_the_servers_retry_after_within_its_phase():
    cap, jitter = loadtest.RETRY_CAP_S, loadtest.RETRY_JITTER
    assert loadtest.retry_wait_s(1.6, remaining_s=30.0, jitter=0.0) == 1.6  # the register lane's 1.6 s, not 0.5
    assert loadtest.retry_wait_s(1.6, remaining_s=30.0, jitter=jitter) == pytest.approx(1.6 * (1 + jitter))
    assert loadtest.retry_wait_s(60.0, remaining_s=30.0, jitter=0.0) == cap  # a sane cap
    assert loadtest.retry_wait_s(1.6, remaining_s=0.3, jitter=0.05) == 0.3  # never past the phase's end
    assert loadtest.retry_wait_s(1.6, remaining_s=-1.0, jitter=0.0) == 0.0
    assert loadtest.retry_wait_s(-5.0, remaining_s=9.0, jitter=0.0) == 0.0


def test_budget_and_summary():
    stats = loadtest.Stats(max_requests=3, deadline=time.monotonic() + 60)
    assert [stats.take() for _ in range(4)] == [True, True, True, False]
    for ms, status in [(10.0, 200), (30.0, 200), (1.0, 503), (2.0, 422)]:
        stats.record("track", ms, status)
    stats.diverged["track"] += 2
    summary = stats.summary(elapsed_s=2.0)
    track = summary["endpoints"]["track"]
    assert summary["requests"] == 6 and summary["requests_per_s"] == 3.0
    # percentiles of the answered ones only; the refusal and the error counted by status, diverged apart
    assert track["ok"] == 2 and track["p50_ms"] == 20.0 and track["p99_ms"] == pytest.approx(29.8)
    assert track["errors_by_status"] == {"422": 1, "503": 1} and track["diverged"] == 2
    assert summary["errors_by_status"] == {"422": 1, "503": 1} and summary["diverged"] == {"track": 2}
    assert summary["stream_outside_phases_ms"] == {"p50_ms": None, "p90_ms": None, "p99_ms": None}  # no stream
    assert not loadtest.Stats(max_requests=5, deadline=time.monotonic() - 1).take()  # past the deadline


def test_parts_from_several_processes_merge_into_one_summary():
    parts = []
    for ms in ([10.0, 20.0], [30.0]):
        stats = loadtest.Stats(max_requests=10, deadline=time.monotonic() + 60)
        for value in ms:
            stats.record("stream_frame", value, 200)
            stats.outside_ms.append(value / 10)  # round trip - server phases of that frame
        stats.record("register", 5.0, 503)
        stats.stateless_tracks += len(ms)
        parts.append(stats.to_dict())
    merged = loadtest.Stats(max_requests=10, deadline=0.0)
    for part in parts:
        merged.merge(part)
    summary = merged.summary(elapsed_s=1.0)
    assert summary["endpoints"]["stream_frame"]["p50_ms"] == 20.0 and summary["tracks_per_s"] == 3.0
    assert summary["refusals"] == {"register": 2, "stream_frame": 0} and summary["registers_per_s"] == 0.0
    assert summary["stream_outside_phases_ms"]["p50_ms"] == 2.0  # over both processes' frames: 1, 2, 3
    assert summary["stateless_tracks"] == 3
    assert loadtest._split(10, 3) == [4, 3, 3] and sum(loadtest._split(64, 8)) == 64


def test_a_busy_load_process_is_reported_as_a_possible_bound(capsys):
    calm = loadtest._generator_summary([0.2, 0.35])
    assert calm == {"processes": 2, "cpu_fraction": [0.2, 0.35], "busiest": 0.35, "saturated": False}
    assert capsys.readouterr().err == ""
    busy = loadtest._generator_summary([0.4, 0.97])
    assert busy["saturated"] and busy["busiest"] == 0.97
    assert "the load generator may be what limits these figures" in capsys.readouterr().err


def test_server_breakdown_is_the_mean_over_the_run():
    before = ('fp_request_phase_seconds_sum{endpoint="/track",phase="decode"} 1.0\n'
              'fp_request_phase_seconds_count{endpoint="/track",phase="decode"} 100\n')
    after = ('fp_request_phase_seconds_sum{endpoint="/track",phase="decode"} 1.5\n'
             'fp_request_phase_seconds_count{endpoint="/track",phase="decode"} 200\n'
             'fp_request_phase_seconds_sum{endpoint="/register",phase="decode"} 0.0\n'
             'fp_request_phase_seconds_count{endpoint="/register",phase="decode"} 0\n')
    means = loadtest._histogram_means(before, after, "fp_request_phase_seconds", "phase")
    assert means == {"/track": {"decode": 5.0}}  # 0.5 s over 100 requests; nothing new for /register


def test_the_digest_says_what_a_run_reached_and_which_regime_it_measured():
    line = loadtest.digest({"tracks_per_s": 1072.5, "registers_per_s": 5.1, "diverged": {"track": 3},
                            "endpoints": {"track": {"p50_ms": 54.9, "p99_ms": 92.6}}, "stateless_tracks": 40,
                            "server_counts": {"track_batches": 831.0, "track_driver_launches": 20.0},
                            "server_gpu_p50_ms": {"track/step": 4.1, "register/refine_score": 80.0}})
    assert line == ("1072.5 tracks/s, 5.1 registers/s, p50 54.9 ms p99 92.6 ms, diverged 3, stateless 40, "
                    "driver launches 20 of 831 batches, track step GPU p50 4.1 ms")
    stream = loadtest.digest({"tracks_per_s": 9.0, "registers_per_s": 0.0, "diverged": {},
                              "endpoints": {"stream_frame": {"p50_ms": 3.0, "p99_ms": 4.0}}})
    assert stream == "9.0 tracks/s, 0.0 registers/s, p50 3.0 ms p99 4.0 ms, diverged 0, stateless 0"


def test_server_counts_are_the_growth_of_the_track_lanes_counters():
    before = "fp_track_batches_total 10\nfp_track_inline_total 4\n"
    after = "fp_track_batches_total 25\nfp_track_inline_total 4\nfp_track_driver_launches_total 15\n"
    counts = loadtest._counter_deltas(before, after)
    assert counts["track_batches"] == 15 and counts["track_inline"] == 0
    assert counts["track_driver_launches"] == 15  # absent before: counted from zero
    assert counts["track_graph_captures"] is None and counts["track_batched_requests"] is None  # not exported
    gpu = ('fp_pipeline_stage_gpu_p50_seconds{lane="track",stage="step"} 0.0021\n'
           'fp_pipeline_stage_gpu_p50_seconds{lane="register",stage="refine_score"} 0.0875\n')
    assert loadtest._stage_gpu_p50_ms(gpu) == {"track/step": 2.1, "register/refine_score": 87.5}
    assert loadtest._stage_gpu_p50_ms("fp_track_batches_total 3\n") == {}


@pytest.fixture(scope="module")
def drifting_app(tiny_estimator, tmp_path_factory):
    """An app whose working range ends at |t| = 0.45 m: random-weight tracking of the synthetic frame
    (registered at |t| = 0.37 m) leaves it within about ten steps, as a long run on the GPU does at 50 m."""
    import dataclasses

    from foundationpose.estimator import PoseEstimator
    from server import create_app
    from tests.server._helpers import tiny_config, write_objects_dir

    estimator = PoseEstimator(tiny_estimator.networks, tiny_estimator.renderer, device=tiny_estimator.device,
                              config=dataclasses.replace(tiny_estimator.config, max_translation_m=0.45))
    config = tiny_config(write_objects_dir(tmp_path_factory.mktemp("objects")), warmup=False, submit_timeout_s=60.0,
                         register_capacity=64)
    return create_app(config, estimator=estimator)


@pytest.fixture(scope="module")
def drifting_server(drifting_app):
    """``drifting_app`` served live (lifespan included)."""
    from tests.server._helpers import live_uvicorn

    with live_uvicorn(drifting_app) as host:
        yield f"http://{host}"


class _RequestsSeen:
    """An ASGI app handing every request to ``app`` and counting them by ``"METHOD path"``: what one port
    of a server was sent. ``state`` is ``app``'s (live_uvicorn waits on it)."""

    def __init__(self, app) -> None:
        self.app, self.state, self.seen = app, app.state, Counter()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            self.seen[f"{scope.get('method', 'WS')} {scope['path']}"] += 1
        await self.app(scope, receive, send)


@pytest.fixture
def second_port(drifting_app, drifting_server):
    """(URL, requests seen) of a second port serving ``drifting_server``'s app (the same sessions, the same
    pipeline; its lifespan runs on the first port), as the server's ingest workers' track port does."""
    from tests.server._helpers import live_uvicorn

    seen_app = _RequestsSeen(drifting_app)
    with live_uvicorn(seen_app, lifespan="off") as host:
        yield f"http://{host}", seen_app.seen


@pytest.mark.slow  # dozens of CPU tracks and a few registers: 5-10 s
@pytest.mark.parametrize(("mode", "on_diverge"), [("http-raw", "reregister"), ("http-binary", "stateless")])
def test_diverged_tracks_are_counted_apart_and_the_load_stays_valid(drifting_server, mode, on_diverge):
    from tests.server._helpers import FRAME_HW

    summary = loadtest.run_load(drifting_server, clients=2, duration_s=120.0, max_requests=40, tracks=30,
                                image_hw=FRAME_HW, api_key=None, object_id="block", mode=mode,
                                on_diverge=on_diverge)
    track = summary["endpoints"]["track"]
    assert track["diverged"] >= 1 and summary["diverged"] == {"track": track["diverged"]}
    assert track["errors_by_status"] == {} and summary["errors_by_status"] == {}  # no 422 among the errors
    assert track["ok"] >= 20 and track["count"] == track["ok"] + track["diverged"]
    assert summary["transport_errors"] == {}
    # a session diverges once: then it ends (reregister) or goes on stateless from the registered pose
    setup = summary["setup"]
    assert (setup["clients"], setup["sessions_ready"], setup["registers_ok"]) == (2, 2, 2)
    assert setup["registers_ok"] + summary["endpoints"].get("register", {}).get("ok", 0) >= track["diverged"]
    phases = summary["server_phases_ms"]["/track/binary" if mode == "http-binary" else "/track"]
    assert {"decode", "validate", "pipeline"} <= set(phases)
    # every answered track ran in a batch or inline (a diverged one is refused before the pipeline)
    counts = summary["server_counts"]
    assert counts["track_batched_requests"] + counts["track_inline"] == track["ok"]
    if on_diverge == "stateless":  # after its divergence each session goes on without one
        assert 1 <= summary["stateless_tracks"] <= track["ok"]
    else:
        assert summary["stateless_tracks"] == 0
    generator = summary["load_generator"]  # CPU over the window of the one load process (here also the server's)
    assert generator["processes"] == 1 and generator["busiest"] > 0.0, generator


@pytest.mark.slow  # a few CPU registers: ~5 s
def test_a_drifted_stream_reconnects_with_a_start_message_not_a_register(drifting_server):
    from tests.server._helpers import FRAME_HW

    summary = loadtest.run_load(drifting_server, clients=2, duration_s=120.0, max_requests=40, tracks=1000,
                                image_hw=FRAME_HW, api_key=None, object_id="block", mode="stream",
                                on_diverge="stateless")
    endpoints, frames = summary["endpoints"], summary["endpoints"]["stream_frame"]
    assert frames["diverged"] >= 2 and frames["ok"] >= 20 and summary["errors_by_status"] == {}
    assert summary["transport_errors"] == {} and summary["setup"]["registers_ok"] == 2
    assert set(endpoints) == {"stream_frame", "stream_start"}, set(endpoints)  # no register in the window
    # each diverged session is followed by one started from the registered pose (but the last, when the
    # budget ran out first)
    assert frames["diverged"] - 1 <= endpoints["stream_start"]["ok"] <= frames["diverged"]
    assert summary["registers_per_s"] == 0.0
    assert summary["server_phases_ms"]["/track/stream:start"]["validate"] >= 0


class _CountingRegisterAdmission(RegisterAdmission):
    """The server's register admission, also counting its refusals under its own condition (tests wait on it)."""

    refused = 0

    def acquire(self):
        try:
            return super().acquire()
        except OverloadedError:
            with self._changed:
                self.refused += 1
                self._changed.notify_all()
            raise


@pytest.fixture
def one_register_server(tiny_estimator, tmp_path):
    """(URL, register admission, gate): a live server admitting one register at a time, whose register
    parks in the refiner until the test opens the gate (the track lane is not gated)."""
    from server import create_app
    from tests.server._helpers import gated_estimator, live_uvicorn, tiny_config, write_objects_dir

    estimator, gate = gated_estimator(tiny_estimator, "refiner")
    app = create_app(tiny_config(write_objects_dir(tmp_path / "objects"), warmup=False, register_capacity=1),
                     estimator=estimator)
    old = app.state.fp.register_admission
    admission = app.state.fp.register_admission = _CountingRegisterAdmission(
        capacity=old.capacity, frames_in_flight=old.frames_in_flight, times=old.times)
    with live_uvicorn(app) as host:
        try:
            yield f"http://{host}", admission, gate
        finally:
            gate.opened.set()


@pytest.mark.slow  # three CPU registers one after the other: ~5 s
@pytest.mark.parametrize("mode", ["stream", "http-binary"])
def test_the_setup_waits_out_refused_registers_and_the_window_only_tracks(one_register_server, mode):
    from concurrent.futures import ThreadPoolExecutor

    from tests.server._helpers import FRAME_HW, READY_TIMEOUT_S

    url, admission, gate = one_register_server
    clients, tracks = 3, 4
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(loadtest.run_load, url, clients=clients, duration_s=120.0, max_requests=clients * tracks,
                          tracks=1000, image_hw=FRAME_HW, api_key=None, object_id="block", mode=mode,
                          setup_timeout_s=120.0)
        assert gate.entered.wait(READY_TIMEOUT_S)  # the first register runs, parked in the refiner
        assert admission.wait_until(lambda a: a.refused >= clients - 1, READY_TIMEOUT_S)  # the others: 503
        gate.opened.set()
        summary = run.result(timeout=READY_TIMEOUT_S)
    setup = summary["setup"]
    assert (setup["clients"], setup["sessions_ready"], setup["registers_ok"]) == (clients, clients, clients)
    assert setup["registers_refused"] >= clients - 1 and setup["errors_by_status"] == {"503": setup["registers_refused"]}
    assert setup["refusals_without_retry_after"] == {} and setup["transport_errors"] == {}
    # the window: every client had its session, so it only tracked (the budget: tracks, nothing else)
    track = "stream_frame" if mode == "stream" else "track"
    assert set(summary["endpoints"]) == {track}, summary["endpoints"]
    assert summary["endpoints"][track]["ok"] == clients * tracks and summary["errors_by_status"] == {}
    assert summary["requests"] == clients * tracks and summary["registers_per_s"] == 0.0


@pytest.mark.slow
def test_track_url_takes_every_track_and_url_everything_else(drifting_server, second_port, capsys):
    from tests.server._helpers import FRAME_HW

    track_url, seen = second_port
    assert track_url != drifting_server
    # one session: tracks of the session until it drifts, then stateless ones from the registered pose
    assert loadtest.main(["--url", drifting_server, "--track-url", track_url, "--mode", "http-binary",
                          "--on-diverge", "stateless", "--clients", "1", "--max-requests", "24",
                          "--tracks-per-register", "1000", "--duration-s", "120", "--object-id", "block",
                          "--image", f"{FRAME_HW[1]}x{FRAME_HW[0]}"]) == 0
    summary = json.loads(capsys.readouterr().out)
    track = summary["endpoints"]["track"]
    assert track["diverged"] >= 1 and track["ok"] >= 15 and track["count"] == track["ok"] + track["diverged"]
    assert summary["errors_by_status"] == {} and summary["transport_errors"] == {}
    # every track, session and stateless, went to --track-url, and nothing else did (the register of the
    # set-up, the object listing and the /metrics scrapes went to --url)
    assert dict(seen) == {"POST /track/binary": track["count"]}
    assert summary["setup"]["registers_ok"] == 1
    assert {"decode", "validate", "pipeline"} <= set(summary["server_phases_ms"]["/track/binary"])  # via --url
    assert summary["settings"]["url"] == drifting_server and summary["settings"]["track_url"] == track_url


@pytest.mark.slow
@pytest.mark.parametrize("http_client", loadtest.HTTP_CLIENTS)
def test_without_track_url_the_tracks_go_to_url(drifting_server, second_port, http_client):
    from tests.server._helpers import FRAME_HW

    url, seen = second_port  # this time the second port is --url: it sees the tracks and the rest
    summary = loadtest.run_load(url, clients=2, duration_s=120.0, max_requests=12, tracks=1000, image_hw=FRAME_HW,
                                api_key=None, object_id="block", mode="http-binary", http_client=http_client)
    assert summary["endpoints"]["track"]["ok"] == 12 and summary["errors_by_status"] == {}  # (set-up registers aside)
    assert summary["transport_errors"] == {}
    assert seen["POST /track/binary"] == 12 and seen["POST /register"] == 2 and seen["GET /metrics"] == 2


def test_an_unknown_http_client_is_refused():
    with pytest.raises(ValueError, match=r"http_client must be one of \('raw', 'httpx'\), got 'curl'"):
        loadtest.run_load("http://127.0.0.1:1", clients=1, duration_s=1.0, max_requests=1, tracks=1,
                          image_hw=(48, 64), api_key=None, object_id="block", mode="http-binary", http_client="curl")


@pytest.mark.parametrize("track_url", ["http://10.0.0.5:8000", "http://example.com", "ftp://127.0.0.1"])
def test_track_url_is_loopback_only(track_url, capsys):
    with pytest.raises(SystemExit) as exit_info:
        loadtest.main(["--mode", "http-binary", "--track-url", track_url])
    assert exit_info.value.code == 2 and f"refusing to load {track_url!r}" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"^refusing to load"):  # before any request: nothing listens on :1
        loadtest.run_load("http://127.0.0.1:1", clients=1, duration_s=1.0, max_requests=1, tracks=1,
                          image_hw=(48, 64), api_key=None, object_id="block", mode="http-binary", track_url=track_url)


@pytest.mark.parametrize("mode", ["http-png", "http-raw", "stream-deflate"])
def test_track_url_applies_to_http_binary_and_stream_only(mode, capsys):
    with pytest.raises(SystemExit) as exit_info:
        loadtest.main(["--mode", mode, "--track-url", "http://127.0.0.1:8001"])
    assert exit_info.value.code == 2
    assert f"--track-url applies to --mode http-binary/stream only, got --mode {mode}" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"^track_url applies to modes http-binary, stream only"):
        loadtest.run_load("http://127.0.0.1:1", clients=1, duration_s=1.0, max_requests=1, tracks=1,
                          image_hw=(48, 64), api_key=None, object_id="block", mode=mode,
                          track_url="http://127.0.0.1:8001")


@pytest.mark.parametrize(("argv", "message"), [
    (["--mode", "http-binary", "--spawn-ingest-workers", "2"], "--spawn-ingest-workers needs --spawn"),
    (["--spawn", "--mode", "http-raw", "--spawn-ingest-workers", "2"],
     "--spawn-ingest-workers applies to --mode http-binary/stream only, got --mode http-raw"),
    (["--spawn", "--mode", "http-binary", "--spawn-ingest-workers", "2", "--track-url", "http://127.0.0.1:8001"],
     "drop --track-url"),
    (["--spawn", "--mode", "http-binary", "--spawn-ingest-workers", "-1"], "must be >= 0, got -1"),
])
def test_spawn_ingest_workers_misuse_is_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        loadtest.main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow  # a python -m server process with an ingest worker: ~10 s
@pytest.mark.parametrize("mode", ["http-binary", "stream"])
def test_spawn_ingest_workers_sends_the_tracks_to_the_ingest_port(mode, capsys):
    from tests.server._helpers import FRAME_HW

    assert loadtest.main(["--spawn", "--spawn-ingest-workers", "1", "--mode", mode, "--clients", "1",
                          "--max-requests", "8", "--tracks-per-register", "1000", "--duration-s", "120",
                          "--image", f"{FRAME_HW[1]}x{FRAME_HW[0]}"]) == 0
    summary = json.loads(capsys.readouterr().out)
    server, settings = summary["server"], summary["settings"]
    assert f"--ingest-workers 1 --ingest-port {server['ingest_port']}" in server["command"]
    assert server["ingest_port"] != server["port"]
    assert settings["track_url"] == server["track_url"] == f"http://127.0.0.1:{server['ingest_port']}"
    assert settings["url"] == f"http://127.0.0.1:{server['port']}"
    # answered by the ingest port (nothing else listens there), in the main port's session
    track = summary["endpoints"]["track" if mode == "http-binary" else "stream_frame"]
    assert track["ok"] == track["count"] == 8 and summary["errors_by_status"] == {}
    assert summary["transport_errors"] == {}
    assert summary["setup"]["registers_ok"] == 1 if mode == "http-binary" else summary["setup"]["sessions_ready"] == 1


def test_the_command_runs_as_a_module_and_answers_its_help():
    done = subprocess.run([sys.executable, "-m", "tools.loadtest", "--help"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0 and "--spawn-ingest-workers" in done.stdout, done.stderr[-2000:]


def test_the_bundled_scene_is_the_bundled_sequences_first_frame_with_its_mask_and_K():
    from foundationpose.demo.dataset import BUNDLED_SEQUENCE_DIR, RecordedSequence

    sequence = RecordedSequence(BUNDLED_SEQUENCE_DIR)
    first = sequence.read(0)
    frame = loadtest.scene_frame("bundled", 480, 640)
    np.testing.assert_array_equal(frame.rgb, first.rgb)
    np.testing.assert_array_equal(frame.depth_m, first.depth)
    np.testing.assert_array_equal(frame.K, sequence.K)
    assert frame.mask.dtype == bool and 0 < frame.mask.sum() < frame.mask.size
    assert float(np.median(frame.depth_m[frame.mask])) > 0  # the object has depth under its mask
    synthetic = loadtest.scene_frame("synthetic", 48, 64)
    assert synthetic.rgb.shape == (48, 64, 3)
    with pytest.raises(ValueError, match=r"^the bundled scene's frames are 640x480; got --image 320x240$"):
        loadtest.scene_frame("bundled", 240, 320)
    with pytest.raises(ValueError, match=r"^scene must be one of \('synthetic', 'bundled'\), got 'kitchen'$"):
        loadtest.scene_frame("kitchen", 48, 64)


def test_the_bundled_scene_at_another_size_is_refused_before_any_request(capsys):
    with pytest.raises(SystemExit) as exit_info:
        loadtest.main(["--scene", "bundled", "--image", "320x240"])
    assert exit_info.value.code == 2
    assert "the bundled scene's frames are 640x480; got --image 320x240" in capsys.readouterr().err


@pytest.mark.slow  # a python -m server process on the CPU, 640x480 registers: ~20 s
def test_the_bundled_scene_uploads_its_textured_object_and_tracks_it(capsys):
    code = loadtest.main(["--spawn", "--scene", "bundled", "--clients", "2", "--processes", "1", "--duration-s", "2",
                          "--mode", "http-binary", "--tracks-per-register", "1000"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["object_id"] == "loadtest_bundled"
    assert summary["settings"]["scene"] == "bundled" and summary["settings"]["image_wh"] == [640, 480]
    assert summary["setup"]["sessions_ready"] == 2 and summary["endpoints"]["track"]["ok"] > 0
    assert summary["errors_by_status"] == {} and summary["transport_errors"] == {}
