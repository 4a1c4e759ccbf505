"""``server.loop_watch``: the event loop's timer lag, and a blocked loop reported with its stack."""

from __future__ import annotations

import asyncio
import logging
import re
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from server import create_app
from server.cli import config_from_args
from server.config import ServerConfig
from server.ingest.workers import IngestConfig, IngestWorkers
from server.loop_watch import LOOP_LAG_BUCKETS_S, LoopStats, LoopWatch, loop_families
from tests.server._helpers import READY_TIMEOUT_S, tiny_config, write_objects_dir

WAIT_S = 30.0


@contextmanager
def running_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop running in a thread of its own (as uvicorn's), stopped at the end."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-loop", daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=WAIT_S)
        loop.close()


def _on(loop: asyncio.AbstractEventLoop, call) -> None:
    """Run ``call()`` on the loop and wait for it (LoopWatch.start needs the running loop)."""
    async def run() -> None:
        call()
    asyncio.run_coroutine_threadsafe(run(), loop).result(timeout=WAIT_S)


def hold_the_loop(release: threading.Event, held: threading.Event) -> None:
    """A callback that blocks its loop until ``release`` (a lock wait, as the GC deadlock CI met)."""
    held.set()
    release.wait(WAIT_S)


def test_a_blocked_loop_is_reported_once_with_its_stack_and_again_when_it_runs(caplog):
    caplog.set_level(logging.WARNING, logger="server.loop_watch")
    watch = LoopWatch(stall_s=0.3, beat_s=0.02, name="test server")
    release, held = threading.Event(), threading.Event()
    with running_loop() as loop:
        _on(loop, watch.start)
        try:
            assert watch.wait_until(lambda w: w.beats >= 3, WAIT_S)  # beats while the loop is free
            loop.call_soon_threadsafe(hold_the_loop, release, held)
            assert held.wait(WAIT_S)
            assert watch.wait_until(lambda w: w.stalled, WAIT_S)
            assert watch.stalls == 1
            stall_logs = [r.getMessage() for r in caplog.records if "has not run its timers" in r.getMessage()]
            assert len(stall_logs) == 1
            assert stall_logs[0].startswith("test server: the event loop has not run its timers for ")
            assert "in hold_the_loop" in stall_logs[0] and "release.wait(WAIT_S)" in stall_logs[0]
            beats_when_stalled = watch.beats
            release.set()
            assert watch.wait_until(lambda w: not w.stalled and w.beats > beats_when_stalled, WAIT_S)
            assert watch.stalls == 1  # one stall, however long it lasted
            assert any(re.match(r"test server: the event loop runs again after \d+\.\d\d s", r.getMessage())
                       for r in caplog.records)
        finally:
            release.set()  # a failed assertion must not leave the loop held until the wait's timeout
            watch.stop()
    text = "\n".join(f"{f.name}{s[0]} {dict(s[1])} {s[2]}" for f in watch.families() for s in f.samples)
    assert "fp_event_loop_stalls_total {} 1" in text
    assert "fp_event_loop_stalled {} 0" in text
    # the held beat ran >= 0.3 s late: it is above the 0.25 s bucket
    le_025 = float(re.search(r"fp_event_loop_lag_seconds_bucket \{'le': '0.25'\} (\S+)", text).group(1))
    total = float(re.search(r"fp_event_loop_lag_seconds_count \{\} (\S+)", text).group(1))
    assert total > le_025


def test_the_watch_stops_and_starts_again_on_another_loop():
    watch = LoopWatch(stall_s=1.0, beat_s=0.02)
    with running_loop() as first:
        _on(first, watch.start)
        assert watch.wait_until(lambda w: w.beats >= 2, WAIT_S)
        if sys.platform.startswith("linux"):  # the watcher's name as top -H shows it
            comm = Path(f"/proc/self/task/{watch._watcher.native_id}/comm")
            deadline = time.monotonic() + WAIT_S  # the thread names itself first thing: wait for that state
            while comm.read_text().strip() != "fp-loop-watch" and time.monotonic() < deadline:
                time.sleep(0.01)
            assert comm.read_text().strip() == "fp-loop-watch"
        _on(first, watch.stop)
    stopped_at = watch.beats
    with running_loop() as second:
        _on(second, watch.start)
        try:
            assert watch.wait_until(lambda w: w.beats >= stopped_at + 2, WAIT_S)  # the counters go on
        finally:
            watch.stop()
    assert watch.stalls == 0 and not watch.watching


@pytest.mark.parametrize("stall_s, beat_s", [(0.0, 0.1), (0.1, 0.1), (1.0, 0.0), (-1.0, 0.1)])
def test_settings_are_checked(stall_s, beat_s):
    with pytest.raises(ValueError, match=r"need stall_s > beat_s > 0"):
        LoopWatch(stall_s=stall_s, beat_s=beat_s)


def test_the_server_reports_its_loop_in_metrics(tiny_estimator, tmp_path):
    app = create_app(tiny_config(write_objects_dir(tmp_path / "objects"), warmup=False), estimator=tiny_estimator)
    with TestClient(app) as client:
        state = app.state.fp
        assert state.wait_ready(READY_TIMEOUT_S)
        assert state.loop_watch.watching and state.loop_watch.wait_until(lambda w: w.beats >= 2, WAIT_S)
        metrics = client.get("/metrics").text
    assert re.search(r"^fp_event_loop_lag_seconds_count [1-9]", metrics, re.MULTILINE)
    assert re.search(r"^fp_event_loop_stalls_total 0", metrics, re.MULTILINE)
    assert not state.loop_watch.watching  # stopped with the app


def test_loop_stall_setting_and_off(tmp_path):
    default, _ = config_from_args(["--objects", str(tmp_path)], {})
    (tmp_path / "five.toml").write_text("loop_stall_s = 5\n")
    (tmp_path / "off.toml").write_text("loop_stall_s = 0\n")
    five, _ = config_from_args(["--objects", str(tmp_path), "--config", str(tmp_path / "five.toml")], {})
    off, _ = config_from_args(["--objects", str(tmp_path)], {"FP_CONFIG": str(tmp_path / "off.toml")})
    assert (default.loop_stall_s, five.loop_stall_s, off.loop_stall_s) == (2.0, 5.0, 0.0)
    assert create_app(tiny_config(tmp_path, loop_stall_s=0.0)).state.fp.loop_watch is None
    with pytest.raises(ValueError, match=r"loop_stall_s must be >= 0"):
        ServerConfig(objects_dir=tmp_path, loop_stall_s=-1.0)


def test_ingest_workers_are_started_with_the_stall_setting(tmp_path):
    workers = IngestWorkers(IngestConfig(1, loop_stall_s=7.5), hub_path=tmp_path / "hub.sock", max_image_hw=(48, 64),
                            api_key=None, max_upload_bytes=1 << 20, retry_after_s=1, request_timeout_s=5.0)
    args = workers._worker_args
    assert args[args.index("--loop-stall-s") + 1] == "7.5"


def test_loop_stats_travel_as_lists_and_add_up():
    one = LoopStats([1] + [0] * (len(LOOP_LAG_BUCKETS_S) - 1), 1, 0.0005, 0, 0)
    two = LoopStats.of(LoopStats([0] * (len(LOOP_LAG_BUCKETS_S) - 1) + [2], 3, 12.5, 1, 1).as_list())
    total = one + two
    assert (total.count, total.sum, total.stalls, total.stalled) == (4, 12.5005, 1, 1)
    assert total.counts[0] == 1 and total.counts[-1] == 2 and sum(total.counts) == 3  # 1 beat above every bound
    text = "\n".join(f"{f.name}{s[0]} {dict(s[1])} {s[2]}"
                     for f in loop_families(total, "fp_x", "the test's loops", 0.1, 2.0) for s in f.samples)
    assert "fp_x_lag_seconds_bucket {'le': '+Inf'} 4.0" in text and "fp_x_stalls_total {} 1" in text
    with pytest.raises(ValueError, match=r"2 lag buckets, expected 13"):
        LoopStats.of([[0, 0], 0, 0.0, 0, 0])
    with pytest.raises(ValueError):
        LoopStats.of([[0] * len(LOOP_LAG_BUCKETS_S), 0, 0.0])  # a field missing


def test_a_worker_with_unreadable_loop_counters_is_ignored_with_a_warning(caplog):
    from server.ingest.hub import _loop_stats_of

    assert _loop_stats_of(LoopStats.empty().as_list()) == LoopStats.empty()
    with caplog.at_level(logging.WARNING, logger="server.ingest.hub"):
        assert _loop_stats_of("not a list") is None
    assert "unreadable event-loop counters" in caplog.text


def test_a_stall_shorter_than_a_beat_is_refused_by_the_config(tmp_path):
    with pytest.raises(ValueError, match=r"loop_stall_s must be 0 \(off\) or above 0.1 s"):
        ServerConfig(objects_dir=tmp_path, loop_stall_s=0.05)
