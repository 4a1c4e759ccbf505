"""tools/loadtest.py: the loopback guard, the request budget and the summary (the run itself is a command)."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "tools" / "loadtest.py"
_spec = importlib.util.spec_from_file_location("fp_loadtest", _PATH)
loadtest = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("fp_loadtest", loadtest)  # dataclasses look their module up
_spec.loader.exec_module(loadtest)


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


def test_budget_and_summary():
    stats = loadtest.Stats(max_requests=3, deadline=time.monotonic() + 60)
    assert [stats.take() for _ in range(4)] == [True, True, True, False]
    for ms, status in [(10.0, 200), (30.0, 200), (20.0, 503)]:
        stats.latencies_ms["track"].append(ms)
        stats.statuses["track"][status] += 1
    summary = stats.summary(elapsed_s=2.0)
    track = summary["endpoints"]["track"]
    assert summary["requests"] == 3 and summary["requests_per_s"] == 1.5
    assert track["ok"] == 2 and track["p50_ms"] == 20.0 and track["errors_by_status"] == {"503": 1}
    assert summary["errors_by_status"] == {"503": 1}
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
        parts.append(stats.to_dict())
    merged = loadtest.Stats(max_requests=10, deadline=0.0)
    for part in parts:
        merged.merge(part)
    summary = merged.summary(elapsed_s=1.0)
    assert summary["endpoints"]["stream_frame"]["p50_ms"] == 20.0 and summary["tracks_per_s"] == 3.0
    assert summary["refusals"] == {"register": 2, "stream_frame": 0} and summary["registers_per_s"] == 0.0
    assert summary["stream_outside_phases_ms"]["p50_ms"] == 2.0  # over both processes' frames: 1, 2, 3
    assert loadtest._split(10, 3) == [4, 3, 3] and sum(loadtest._split(64, 8)) == 64


def test_server_breakdown_is_the_mean_over_the_run():
    before = ('fp_request_phase_seconds_sum{endpoint="/track",phase="decode"} 1.0\n'
              'fp_request_phase_seconds_count{endpoint="/track",phase="decode"} 100\n')
    after = ('fp_request_phase_seconds_sum{endpoint="/track",phase="decode"} 1.5\n'
             'fp_request_phase_seconds_count{endpoint="/track",phase="decode"} 200\n'
             'fp_request_phase_seconds_sum{endpoint="/register",phase="decode"} 0.0\n'
             'fp_request_phase_seconds_count{endpoint="/register",phase="decode"} 0\n')
    means = loadtest._histogram_means(before, after, "fp_request_phase_seconds", "phase")
    assert means == {"/track": {"decode": 5.0}}  # 0.5 s over 100 requests; nothing new for /register
