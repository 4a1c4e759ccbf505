"""tools.edge_ratio: each many-client load of an edge folder against the in-process bench of the same call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools import edge_ratio


def _bench(folder: Path, rates: dict[str, float]) -> None:
    headline = {"track_sessions": {k: {"frames_per_s": v, "latency_p99_ms": 30.0} for k, v in rates.items()}}
    (folder / "bench_sessions.json").write_text(json.dumps({"headline": headline}))


def _load(folder: Path, name: str, rate: float, p99: float, *, registers: float = 0.0, offered: int = 0,
          endpoint: str = "track") -> None:
    report = {"tracks_per_s": rate, "registers_per_s": registers, "settings": {"registers_alongside": offered},
              "endpoints": {endpoint: {"p99_ms": p99, "per_s": rate}}}
    (folder / f"{name}.json").write_text(json.dumps(report))


def test_each_load_is_set_against_the_in_process_rate_and_the_goal(tmp_path: Path) -> None:
    _bench(tmp_path, {"64": 2500.0})
    _load(tmp_path, "main_http_binary_64_no_registers", 2100.0, 38.0)  # 84%, p99 in: met
    _load(tmp_path, "main_http_binary_64", 2100.0, 38.0, registers=4.2, offered=4)  # registers short: not met
    _load(tmp_path, "main_stream_64", 1900.0, 35.0, registers=5.1, offered=4, endpoint="stream_frame")  # 76%
    _load(tmp_path, "ingest_http_binary_64", 2200.0, 41.0)  # p99 over
    _load(tmp_path, "main_http_binary_1", 250.0, 4.0)  # one client: not a many-client load
    (tmp_path / "cpu_main_http_binary_64.json").write_text("{}")  # a sampler's report: not a load
    got = edge_ratio.ratios(tmp_path)
    assert got["in_process_frames_per_s"] == {"64": 2500.0}
    loads = got["loads"]
    assert set(loads) == {"main_http_binary_64_no_registers", "main_http_binary_64", "main_stream_64",
                          "ingest_http_binary_64"}
    assert loads["main_http_binary_64_no_registers"] == {
        "clients": 64, "frames_per_s": 2100.0, "share_of_in_process": 0.84, "p99_ms": 38.0,
        "registers_offered": False, "registers_per_s": 0.0, "goal_met": True}
    assert loads["main_http_binary_64"]["goal_met"] is False and loads["main_http_binary_64"]["registers_offered"]
    assert (loads["main_stream_64"]["share_of_in_process"], loads["main_stream_64"]["p99_ms"]) == (0.76, 35.0)
    assert loads["main_stream_64"]["goal_met"] is False
    assert loads["ingest_http_binary_64"]["goal_met"] is False


def test_a_folder_without_its_bench_or_loads_is_told_what_is_missing(tmp_path: Path, capsys) -> None:
    with pytest.raises(edge_ratio.RatioError, match="bench_sessions.json: no readable in-process bench"):
        edge_ratio.ratios(tmp_path)
    _bench(tmp_path, {"4": 10.0})
    with pytest.raises(edge_ratio.RatioError, match="no many-client load report"):
        edge_ratio.ratios(tmp_path)
    _load(tmp_path, "main_http_binary_64", 100.0, 50.0)
    with pytest.raises(edge_ratio.RatioError, match=r"no rate for 64 sessions .*--sessions 64"):
        edge_ratio.ratios(tmp_path)
    assert edge_ratio.main([str(tmp_path)]) == 1
    assert "edge_ratio: " in capsys.readouterr().err


def test_a_load_cut_short_is_left_out(tmp_path: Path, capsys) -> None:
    _bench(tmp_path, {"64": 1000.0})
    _load(tmp_path, "main_http_binary_64", 500.0, 20.0)
    (tmp_path / "main_stream_64.json").write_text("")  # its window never ended
    assert edge_ratio.main([str(tmp_path)]) == 0
    assert set(json.loads(capsys.readouterr().out)["loads"]) == {"main_http_binary_64"}
