"""The benchmark commands run and print the JSON fields the README quotes (tiny settings, CPU).

These check the commands, not their numbers: figures come from real runs, reported in the README.
"""

from __future__ import annotations

import json

import pytest

TOOL_TIMEOUT_S = 180  # a tool that runs ~10-20 s here: far beyond means a hang


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


def test_submit_cost_reports_each_piece(capsys) -> None:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / "submit_cost.py"
    spec = importlib.util.spec_from_file_location("fp_submit_cost", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["--device", "cpu", "--image", "64x48", "--frames", "30", "--in-flight", "4", "--sources", "3"]) == 0
    report = _json_from(capsys)
    assert report["image"] == "64x48" and report["frame_mib"] == round((64 * 48 * 7) / 2**20, 2)
    for piece in ("validate", "depth_range_check", "take_block", "stage_copies_numpy", "stage_copies_torch"):
        row = report[piece]
        assert 0 < row["p50_us"] <= row["p90_us"] and row["mean_us"] > 0, (piece, row)


def _run_server_tool(tmp_path, name: str, *args: str) -> dict:
    """Run ``tools/<name>`` as a script (it runs uvicorn in its main thread) on a free port (and the next one, the
    track port); its JSON report."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.server._helpers import free_port

    root = Path(__file__).resolve().parents[1]
    port = free_port(consecutive=2)
    try:
        done = subprocess.run([sys.executable, str(root / "tools" / name), "--port", str(port), *args],
                              capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, cwd=tmp_path)
    except subprocess.TimeoutExpired as exc:  # its log says where it hung (server.loop_watch logs a stalled loop)
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        pytest.fail(f"{name} did not finish in {TOOL_TIMEOUT_S} s; the end of its log:\n{err[-4000:]}")
    assert done.returncode == 0, done.stderr[-2000:] + done.stdout[-1000:]
    return json.loads(done.stdout[done.stdout.index("{"):])


def test_hub_cost_reports_the_loops_cpu_per_ingest_request(tmp_path) -> None:
    """tools/hub_cost.py: a stand-in ingest worker's tracks all answered 200 (the reduced step keeps poses in
    range), the loop's CPU per request and the other threads'."""
    report = _run_server_tool(tmp_path, "hub_cost.py", "--sessions", "4", "--seconds", "2", "--image", "64x48")
    assert report["requests"] > 20 and report["statuses"] == {"200": report["requests"]}
    assert report["tracks_per_s"] > 0 and 0 < report["loop_us_per_request"] < 1e5
    assert report["latency_ms"]["50"] <= report["latency_ms"]["99"]
    assert "fp-track-batche" in report["other_threads_us_per_request"]  # the batcher thread's name (15 chars)


def test_edge_floor_streams_one_session_through_an_ingest_worker(tmp_path) -> None:
    """tools/edge_floor.py: one stream through the track port with the step reduced, every frame answered, the
    server's phases (the worker's decode among them) and the time outside them."""
    report = _run_server_tool(tmp_path, "edge_floor.py", "--mode", "stream", "--via", "track", "--image", "64x48",
                              "--duration-s", "2")
    assert report["mode"] == "stream" and report["via"] == "track"
    assert report["answered"] > 5 and report["errors"] == {}
    assert 0 < report["p50_ms"] <= report["p99_ms"]
    assert report["outside_phases_ms"]["p50_ms"] > 0
    assert {"decode", "validate", "pipeline"} <= set(report["server_phases_ms"])
