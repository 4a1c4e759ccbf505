"""Timing macros: records, JSON log lines, lazy GPU resolution, summaries, log configuration."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest

import deploy_core.timing as timing
from deploy_core.pipeline import BaseAsyncPipeline, Package, Stage
from deploy_core.timing import (
    TimingRecord,
    TimingRecorder,
    configure_timing_log,
    configure_timing_log_from_env,
    percentile,
    timed,
)
from tests.deploy_core.test_pipeline_support import WAIT_S

FIXED_KEYS = ["stage", "package_id", "wall_ms", "gpu_ms", "queue_wait_ms"]


class FakeEvent:
    """Stands in for torch.cuda.Event: a timestamp (ms) and a completion flag."""

    def __init__(self, t_ms: float) -> None:
        self.t_ms = t_ms
        self.complete = False
        self.synced = 0

    def query(self) -> bool:
        return self.complete

    def synchronize(self) -> None:
        self.synced += 1
        self.complete = True

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.t_ms - self.t_ms


class FakeStream:
    """Records fake events 2.5 ms apart."""

    def __init__(self) -> None:
        self.events: list[FakeEvent] = []

    def record(self) -> FakeEvent:
        ev = FakeEvent(2.5 * len(self.events))
        self.events.append(ev)
        return ev


@pytest.fixture
def fake_cuda_events(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timing, "_record_event", lambda stream: stream.record())


def rec(stage: str, wall_ms: float, wait_ms: float = 0.0, **extra: Any) -> TimingRecord:
    return TimingRecord(stage, 1, wall_ms, None, wait_ms, extra)


def test_public_api_is_complete_and_sorted() -> None:
    assert timing.__all__ == sorted(timing.__all__)
    for name in timing.__all__:
        assert hasattr(timing, name)


def test_timed_context_manager_records_wall_time_and_fields() -> None:
    records: list[TimingRecord] = []
    with timed("render", package_id=7, queue_wait_ms=1.5, sink=records.append, n=252) as t:
        sum(range(1000))
    assert records == [t.record]
    r = t.record
    assert (r.stage, r.package_id, r.gpu_ms, r.queue_wait_ms, r.extra) == ("render", 7, None, 1.5, {"n": 252})
    assert 0.0 < r.wall_ms < 10_000.0
    assert not r.gpu_pending and r.resolve() is r


def test_timed_decorator_records_every_call_and_keeps_errors() -> None:
    records: list[TimingRecord] = []

    @timed("decode", sink=records.append)
    def decode(x: int) -> int:
        if x < 0:
            raise ValueError("negative")
        return x * 2

    assert decode.__name__ == "decode"
    assert [decode(1), decode(2)] == [2, 4]
    with pytest.raises(ValueError, match="^negative$"):
        decode(-1)
    assert [r.stage for r in records] == ["decode"] * 3
    assert [r.extra for r in records] == [{}, {}, {"error": "ValueError"}]


def test_bad_sink_is_rejected() -> None:
    with pytest.raises(TypeError, match=r"^sink must be a TimingRecorder"):
        timed("x", sink=42)


def test_log_line_is_json_with_fixed_key_order(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="deploy_core.timing"):
        with timed("render", package_id=118, queue_wait_ms=0.25, key="s3", n=252):
            pass
    assert len(caplog.records) == 1
    assert caplog.records[0].name == "deploy_core.timing" and caplog.records[0].levelno == logging.DEBUG
    fields = json.loads(caplog.records[0].getMessage())
    assert list(fields) == [*FIXED_KEYS, "key", "n"]
    assert (fields["stage"], fields["package_id"], fields["gpu_ms"], fields["queue_wait_ms"], fields["key"],
            fields["n"]) == ("render", 118, None, 0.25, "s3", 252)
    assert fields["wall_ms"] >= 0


def test_nothing_is_formatted_when_the_timing_logger_is_disabled(monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    class NoJson:
        @staticmethod
        def dumps(*args: Any, **kwargs: Any) -> str:
            raise AssertionError("formatted a timing line nobody listens to")

    monkeypatch.setattr(timing, "json", NoJson)
    caplog.set_level(logging.WARNING, logger="deploy_core.timing")
    recorder = TimingRecorder()
    with timed("a", sink=recorder):
        pass
    with timed("b"):
        pass
    assert recorder.summary()["a"]["count"] == 1
    assert caplog.records == []


def test_percentile_matches_linear_interpolation() -> None:
    data = [float(x) for x in range(1, 11)]
    assert percentile(data, 50) == pytest.approx(5.5)
    assert percentile(data, 90) == pytest.approx(9.1)
    assert percentile(data, 0) == 1.0 and percentile(data, 100) == 10.0
    assert percentile([4.0], 90) == 4.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match=r"^q must be in \[0, 100\]"):
        percentile(data, 101)


def test_recorder_summary_on_known_data() -> None:
    r = TimingRecorder()
    for ms in [3.0, 1.0, 2.0, 10.0, 5.0, 4.0, 6.0, 8.0, 7.0, 9.0]:
        r.add(rec("render", ms, wait_ms=ms / 10))
    r.add(rec("score", 2.0, error="ValueError"))
    s = r.summary()
    assert list(s) == ["render", "score"]
    render = s["render"]
    assert (render["count"], render["max"], render["errors"]) == (10, 10.0, 0)
    assert render["p50"] == pytest.approx(5.5) and render["p90"] == pytest.approx(9.1)
    assert render["mean"] == pytest.approx(5.5) and render["busy_ms"] == pytest.approx(55.0)
    assert render["queue_wait_p50"] == pytest.approx(0.55) and render["queue_wait_p90"] == pytest.approx(0.91)
    assert render["gpu_p50"] is None and render["gpu_mean"] is None
    assert (s["score"]["count"], s["score"]["errors"]) == (1, 1)
    assert list(r.summary(["score", "missing"])) == ["score"]


def test_recorder_window_bounds_percentiles_but_not_counts() -> None:
    r = TimingRecorder(window=4)
    for ms in range(1, 11):
        r.add(rec("a", float(ms)))
    s = r.summary()["a"]
    assert (s["count"], s["max"], s["mean"]) == (10, 10.0, pytest.approx(5.5))
    assert s["p50"] == pytest.approx(8.5)  # over the last four: 7, 8, 9, 10
    with pytest.raises(ValueError, match=r"^window must be >= 1"):
        TimingRecorder(window=0)


def test_format_table() -> None:
    r = TimingRecorder()
    r.add(rec("render", 2.0))
    r.add(rec("render", 4.0))
    lines = r.format_table().splitlines()
    assert lines[0].split() == ["stage", "count", "p50", "p90", "max", "mean", "gpu_p50", "wait_p50"]
    assert set(lines[1]) == {"-"}
    assert lines[2].split() == ["render", "2", "3.000", "3.800", "4.000", "3.000", "-", "0.000"]


def test_gpu_time_is_resolved_lazily_without_sync(fake_cuda_events: None,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    stream = FakeStream()
    recorder = TimingRecorder()
    with caplog.at_level(logging.DEBUG, logger="deploy_core.timing"):
        with timed("render", package_id=1, stream=stream, sink=recorder) as t:
            pass
        first = t.record
        assert first.gpu_pending and first.gpu_ms is None
        assert first.resolve(wait=False) is first                # end event not complete: no block
        assert caplog.records == []                              # held until its GPU time is known
        assert all(ev.synced == 0 for ev in stream.events)       # the timer never synchronised
        stream.events[1].complete = True
        with timed("render", package_id=2, stream=stream, sink=recorder):
            pass                                                 # this add polls the held record
        assert [json.loads(r.getMessage())["package_id"] for r in caplog.records] == [1]
        assert json.loads(caplog.records[0].getMessage())["gpu_ms"] == 2.5
        summary = recorder.summary()                             # flush: syncs the remaining one
    assert stream.events[3].synced == 1
    assert summary["render"]["gpu_p50"] == 2.5 and summary["render"]["count"] == 2
    resolved = first.resolve(wait=True)
    assert resolved.gpu_ms == 2.5 and not resolved.gpu_pending and resolved.wall_ms == first.wall_ms


def test_configure_timing_log_writes_json_lines(tmp_path: Path) -> None:
    path = tmp_path / "timing.jsonl"
    log = logging.getLogger("deploy_core.timing")
    try:
        configure_timing_log(path)
        configure_timing_log(path)                               # replaces, never duplicates
        assert len(log.handlers) == 1 and log.propagate is False
        with BaseAsyncPipeline([Stage("a", lambda pkg: None), Stage("b", lambda pkg: None)], name="p") as p:
            p.submit(1, key="s1").result(WAIT_S)
    finally:
        configure_timing_log(None)
    assert log.handlers == [] and log.propagate is True
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(d["stage"], d["key"], d["pipeline"]) for d in lines[:2]] == [("a", "s1", "p"), ("b", "s1", "p")]
    assert all(list(d)[:5] == FIXED_KEYS for d in lines[:2])
    assert lines[2]["message"].startswith("pipeline 'p' timing summary (ms):\nstage")
    assert lines[2]["summary"]["pipeline"] == "p" and lines[2]["summary"]["a"]["count"] == 1
    assert len(lines) == 3


def test_configure_timing_log_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FP_TIMING_LOG", raising=False)
    assert configure_timing_log_from_env() is None
    monkeypatch.setenv("FP_TIMING_LOG", str(tmp_path / "t.jsonl"))
    try:
        handler = configure_timing_log_from_env()
        assert isinstance(handler, logging.FileHandler)
        with timed("x", package_id="f1"):
            pass
    finally:
        configure_timing_log(None)
    assert json.loads((tmp_path / "t.jsonl").read_text())["package_id"] == "f1"


def test_pipeline_times_every_stage_and_logs_a_summary(caplog: pytest.LogCaptureFixture) -> None:
    timings: list[list[TimingRecord]] = []

    def keep(pkg: Package) -> Any:
        timings.append(pkg.timings)
        return pkg.data

    with caplog.at_level(logging.DEBUG, logger="deploy_core.timing"):
        with BaseAsyncPipeline([Stage("a", lambda pkg: None), Stage("b", lambda pkg: None)], result_fn=keep,
                               name="p") as p:
            p.submit(1).result(WAIT_S)
            p.run(2)
    assert [[r.stage for r in t] for t in timings] == [["a", "b"], ["a", "b"]]
    assert all(r.queue_wait_ms >= 0 and r.wall_ms >= 0 for t in timings for r in t)
    assert timings[1][0].extra == {"pipeline": "p", "path": "sync"}
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 5                                    # 2 stages x 2 packages + summary
    assert [json.loads(m)["stage"] for m in messages[:4]] == ["a", "b", "a", "b"]
    table = messages[4].splitlines()
    assert table[0] == "pipeline 'p' timing summary (ms):"
    assert [row.split()[:2] for row in table[3:]] == [["a", "2"], ["b", "2"]]


def test_records_log_at_debug_and_a_named_recorder_summarises_at_info(caplog) -> None:
    """Per-record lines are DEBUG (not in a service's INFO log); a named recorder writes one INFO line per period
    with each stage's count and percentiles since the last one (driven by its clock, not by sleeping)."""
    now = [0.0]
    recorder = TimingRecorder(name="pipeline track", summary_every_s=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger=timing.TIMING_LOGGER_NAME):
        for ms in (1.0, 2.0, 3.0):
            recorder.add(TimingRecord(stage="step", package_id=1, wall_ms=ms))
        assert caplog.records == []  # INFO only: no per-record lines, no summary before its period
        now[0] = 61.0
        recorder.add(TimingRecord(stage="finish", package_id=1, wall_ms=0.5))
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == ("pipeline track timings (ms, last 60 s): step n=3 p50=2.00 p90=2.80 max=3.00; "
                    "finish n=1 p50=0.50 p90=0.50 max=0.50")
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger=timing.TIMING_LOGGER_NAME):
        recorder.add(TimingRecord(stage="step", package_id=2, wall_ms=4.0))
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]  # the record itself, no summary yet
    with pytest.raises(ValueError, match="summary_every_s must be > 0"):
        TimingRecorder(summary_every_s=0)
