"""``python -m foundationpose.bench.validity``: the validity measurements' cost, as JSON."""

from __future__ import annotations

import json

import pytest

from foundationpose.bench import validity as bench_validity


@pytest.mark.slow
def test_prints_each_batch_with_the_annotated_pose_judged_valid(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_validity.main(["--device", "cpu", "--batches", "1,3", "--replays", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device"] == "cpu" and report["replays"] == 2
    assert [row["batch"] for row in report["batches"]] == [1, 3]
    for row in report["batches"]:
        # the bundled frame at its annotated pose: the depth confirms most of what the camera should see
        assert row["valid_share"] == 1.0
        assert 0.5 < row["support_fraction"] <= 1.0
        assert 0 < row["eager_wall"]["p50_ms"] <= row["eager_wall"]["p90_ms"] <= row["eager_wall"]["p99_ms"]
        assert "graph_gpu" not in row  # CUDA graphs only on a GPU
        # the appearance part alone, on the crops of the annotated pose: its print lies where the camera sees it
        assert 0 < row["appearance"]["eager_wall"]["p50_ms"] <= row["eager_wall"]["p99_ms"] * 10
        assert row["appearance_ncc"] > 0.5


@pytest.mark.parametrize("argv", [["--batches", "1,x"], ["--batches", "0"], ["--replays", "0"]])
def test_bad_arguments_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_validity.main(["--device", "cpu", *argv])
    assert exc.value.code == 2
    assert "--" in capsys.readouterr().err
