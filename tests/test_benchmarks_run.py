"""The benchmark commands run and print the JSON fields the README quotes (tiny settings, CPU).

These check the commands, not their numbers: figures come from real runs, reported in the README.
"""

from __future__ import annotations

import json

import pytest
import torch


def _json_from(capsys) -> dict:
    out = capsys.readouterr().out
    return json.loads(out[out.index("{"):])


def test_deploy_core_bench_prints_per_hop_overhead(capsys) -> None:
    from deploy_core.bench import main

    assert main(["--packages", "300", "--stages", "1,2", "--latency-packages", "50", "--repeats", "1"]) in (0, None)
    report = _json_from(capsys)
    text = json.dumps(report)
    assert "per_hop_us" in text and "async_pkgs_per_s" in text
    assert all(row["stage_errors"] == 0 for row in report["results"])


def test_engines_bench_prints_latency_and_tflops(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    from engines.bench import main

    assert main(["--device", "cpu", "--precision", "fp32", "--batch", "1", "--networks", "refiner",
                 "--iters", "1", "--warmup", "0"]) == 0
    row = _json_from(capsys)["results"][0]
    assert row["network"] == "refiner" and row["batch"] == 1
    assert row["p50_ms"] > 0 and row["tflops"] > 0


@pytest.mark.slow
def test_objects_bench_reports_one_object_and_each_group_kind(capsys) -> None:
    from foundationpose.bench.objects import main

    assert main(["--tiny", "--device", "cpu", "--objects", "1,2", "--runs", "1"]) == 0
    report = _json_from(capsys)
    assert report["one_object"]["runs"] == 1 and report["one_object"]["p50_ms"] > 0
    assert [(r["objects"], r["kind"], r["meshes"]) for r in report["rows"]] == [
        (1, "instances", 1), (2, "instances", 1), (2, "distinct", 2)]
    one = report["one_object"]
    assert all(r["vs_one_p50"] == round(r["p50_ms"] / one["p50_ms"], 3) for r in report["rows"])
    assert all(r["vs_one_p99"] == round(r["p99_ms"] / one["p99_ms"], 3) for r in report["rows"])
    assert all(r["steps_per_frame"] == 1.0 for r in report["rows"])  # N objects of a frame: one track step
    assert [r["rows_per_frame"] for r in report["rows"]] == [1.0, 2.0, 2.0]
    with pytest.raises(SystemExit):
        main(["--tiny", "--device", "cpu", "--objects", "19"])


@pytest.mark.slow
def test_end_to_end_bench_reports_its_figures_with_their_conditions(capsys) -> None:
    from foundationpose.bench import main

    assert main(["--device", "cpu", "--tiny", "--runs", "1", "--sessions", "2", "--track-frames", "2"]) == 0
    report = _json_from(capsys)
    conditions = report["conditions"]
    assert conditions["frames"]["distinct"] == 4 and conditions["frames"]["memory"] == "pageable"  # CPU: no locking
    assert conditions["runtime"]["device"] == "cpu" and conditions["runtime"]["fast_networks"] is False
    assert conditions["algorithm"] == {"hypotheses": 6, "register_iterations": 1, "track_iterations": 1}
    assert conditions["session_models"] == ["asyncio", "threads"] and conditions["switch_interval_ms"] == 0.5
    agreement = report["agreement"]  # the service runs the estimator's steps: the same poses on the CPU
    assert agreement["register_pose_max_abs_diff"] == 0.0 and agreement["track_pose_max_abs_diff"] == 0.0
    assert agreement["register_burst_differing_from_lone"] == 0  # registers at once == each one alone
    throughput = report["register"]["throughput_fps"]  # both measured over a burst, not derived from a latency
    assert throughput["burst"] == 2 and throughput["sync"] > 0 and throughput["service"] > 0
    rows = report["track"]["sessions"]
    assert [(r["sessions"], r["model"]) for r in rows] == [(2, "asyncio"), (2, "threads")]
    for r in rows:
        assert r["errors"] == [] and r["frames"] == 4 and r["frames_per_s"] > 0
        assert r["latency_p50_ms"] <= r["latency_p99_ms"]
        parts = r["latency_parts_mean_ms"]  # where each frame's latency went (an inline frame: all of it in step)
        assert set(parts) == {"submit", "batcher_wait", "step", "finish", "other"} and parts["step"] > 0, parts
        assert r["batches"] * (r["mean_batch"] or 0) + r["inline_fraction"] * r["frames"] == pytest.approx(
            r["frames"], abs=0.01 * r["batches"] + 0.001 * r["frames"])  # every frame ran in a batch or inline
    by_batch = report["track"]["step_by_batch"]  # every padded batch size of the lane (CPU: eager, wall time only)
    assert set(by_batch) == {"1", "2"} and all(row["gpu_ms"] is None and row["wall_ms"] > 0 for row in by_batch.values())
    assert report["headline"]["track_sessions"]["2"]["frames_per_s"] == rows[0]["frames_per_s"]  # the asyncio row


def test_the_bench_with_no_flags_runs_the_library_defaults() -> None:
    """The bench's headline configuration is what a user gets with no flags: RuntimeConfig's defaults, which on CUDA
    resolve to the fast path (compiled half-precision networks, captured steps)."""
    from foundationpose.bench.e2e import _parser, runtime_from_args
    from foundationpose.runtime import RuntimeConfig

    runtime = runtime_from_args(_parser().parse_args([]))
    assert runtime == RuntimeConfig()
    on_cuda = runtime.describe(torch.device("cuda"))
    assert on_cuda["fast_networks"] and on_cuda["compiled"] and on_cuda["capture"] and on_cuda["precision"] == "fp16"
    opted_out = runtime_from_args(_parser().parse_args(["--eager", "--no-compile", "--device", "cpu"]))
    assert (opted_out.capture, opted_out.compile, opted_out.device) == (False, False, "cpu")
