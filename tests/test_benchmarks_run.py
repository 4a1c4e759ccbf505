"""The benchmark commands run and print the JSON fields the README quotes (tiny settings, CPU).

These check the commands, not their numbers: figures come from real runs, reported in the README.
"""

from __future__ import annotations

import json

import pytest


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
def test_end_to_end_bench_reports_both_paths(capsys) -> None:
    from foundationpose.bench import main

    assert main(["--device", "cpu", "--hypotheses", "2", "--register-iterations", "1", "--track-iterations", "1",
                 "--runs", "1", "--warmup", "1", "--register-frames", "2", "--sessions", "2",
                 "--track-frames", "1", "--image", "160x120"]) == 0
    report = _json_from(capsys)
    assert report["pipelined_vs_sync"]["register_pose_max_abs_diff"] == 0.0
    assert report["pipelined_vs_sync"]["track_pose_max_abs_diff"] == 0.0
    assert report["pipelined_vs_sync"]["register_concurrent_differing"] == 0  # registers at once == the lone one
    assert report["pipelined_vs_sync"]["register_concurrent_non_finite"] == 0
    for key in ("register_sync", "track_sync", "register_throughput_fps", "track_sessions", "pipelined_stage_p50_ms"):
        assert key in report
    assert report["track_sessions"][0]["errors"] == []
    graphed = report["track_modes"]["graphs_on"]  # whole track steps (eager on the CPU) give the same poses
    assert graphed["graphs"] and graphed["track_pose_max_abs_diff_vs_graphs_off"] == 0.0
    assert graphed["pipelined_track_pose_max_abs_diff"] == 0.0
    by_batch = graphed["track_step_by_batch"]  # every padded batch size timed (CPU: eager, wall time only)
    assert "1" in by_batch and len(by_batch) > 1 and all(int(b) >= 1 for b in by_batch), by_batch  # the lane's sizes
    assert all(row["wall_ms"] > 0 and row["gpu_ms"] is None for row in by_batch.values()), by_batch
    assert graphed["track_sessions"][0]["errors"] == []
    inline = [row["inline_fraction"] for row in graphed["track_sessions"]]  # the share of tracks that ran inline
    assert all(0.0 <= share <= 1.0 for share in inline), inline
    assert report["track_sessions"][0]["inline_fraction"] == 0.0  # the stage-by-stage lane has no inline path
    rows = graphed["track_sessions"]
    for r in rows:  # where each frame's latency went (an inline frame: all of it in step)
        parts = r["latency_parts_mean_ms"]
        assert set(parts) == {"submit", "batcher_wait", "step", "finish", "other"} and parts["step"] > 0, parts
        assert min(parts["submit"], parts["batcher_wait"], parts["finish"]) >= 0, parts
    assert all(r["batches"] * r["mean_batch"] + r["inline_fraction"] * r["frames"]
               == pytest.approx(r["frames"], abs=0.01 * r["batches"] + 0.001 * r["frames"])
               for r in rows if r["batches"]), rows  # every frame ran in a batch or inline
