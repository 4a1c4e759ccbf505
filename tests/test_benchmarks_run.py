"""The benchmark commands run and print the JSON fields the README quotes (tiny settings, CPU).

These check the commands, not their numbers: figures come from real runs, reported in the README.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal

import pytest
import torch

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


def test_track_host_ceiling_reports_frames_per_s_and_restores_the_step(capsys) -> None:
    import importlib.util
    from pathlib import Path

    from foundationpose.track_graph import TrackGraphRunner

    path = Path(__file__).resolve().parents[1] / "tools" / "track_host_ceiling.py"
    spec = importlib.util.spec_from_file_location("fp_track_host_ceiling", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    step = TrackGraphRunner._step
    assert tool.main(["--device", "cpu", "--image", "80x60", "--sessions", "3", "--frames", "4"]) == 0
    report = _json_from(capsys)
    assert report["frames"] == 12 and report["frames_per_s"] > 0 and report["host_us_per_frame"] > 0
    assert report["latency_p50_ms"] <= report["latency_p99_ms"]  # (a lone request into an idle lane runs inline: no batch)
    assert report["mean_batch"] is None or report["mean_batch"] >= 1
    assert TrackGraphRunner._step is step  # the reduced step stays inside the tool's run


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


def test_proc_cpu_names_the_busy_thread_of_a_process_tree(capsys) -> None:
    """tools/proc_cpu.py on a child that spins one named thread and sleeps in another: the spinner's CPU near one core,
    under its OS name (deploy_core.thread_names); the sleeper's near zero; a missing pid exits 1."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc")
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("fp_proc_cpu", root / "tools" / "proc_cpu.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys, threading, time\n"
        "from deploy_core.thread_names import name_native_thread\n"
        "def spin():\n"
        "    name_native_thread('fp-spinner')\n"
        "    print('spinning', flush=True)\n"
        "    while True: pass\n"
        "threading.Thread(target=spin, daemon=True).start()\n"
        "time.sleep(60)\n")], cwd=root, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "spinning"  # the thread runs (and is named) from here on
        assert tool.main(["--pid", str(child.pid), "--duration-s", "1.0"]) == 0
        report = _json_from(capsys)
    finally:
        child.kill()
        child.wait()
    assert report["cores"] >= 1 and 0 < report["machine_busy"] <= 1
    (proc,) = report["processes"]
    assert proc["pid"] == child.pid and 0.5 < proc["cpu"] < 1.5, proc
    top = proc["threads"][0]
    assert top["name"] == "fp-spinner" and 0.5 < top["cpu"] <= proc["cpu"] + 0.01, proc["threads"]
    assert all(t["cpu"] < 0.2 for t in proc["threads"][1:]), proc["threads"]
    assert tool.main(["--pid", str(child.pid), "--duration-s", "0.1"]) == 1  # gone now
    assert tool.main(["--pid", "1", "--duration-s", "0.1", "--also", "no-such-command-xyz"]) == 0
    assert _json_from(capsys)["also"] == {"patterns": ["no-such-command-xyz"], "processes": 0, "cpu": 0}
    # --also counts a matched process's children too (a load generator's multiprocessing workers)
    marker = f"fp-proc-cpu-test-{os.getpid()}"
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'print(1, flush=True)\\nwhile True: pass'],"
        " stdout=subprocess.PIPE, text=True)\n"
        "child.stdout.readline(); print('child spinning', flush=True)\n"
        "try:\n    child.wait()\nfinally:\n    child.kill()\n"), marker], stdout=subprocess.PIPE, text=True)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # the --pid tree: not them
    try:
        assert parent.stdout.readline().strip() == "child spinning"
        assert tool.main(["--pid", str(sleeper.pid), "--duration-s", "1.0", "--also", marker]) == 0
        also = _json_from(capsys)["also"]
    finally:
        for proc in _descendants(parent.pid) + [parent.pid, sleeper.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc, signal.SIGKILL)
        parent.wait()
        sleeper.wait()
    assert also["processes"] == 2 and 0.5 < also["cpu"] < 1.5, also


def _descendants(pid: int) -> list[int]:
    from pathlib import Path

    out = []
    for task in Path("/proc").iterdir():
        if task.name.isdigit():
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rfind(")") + 2:].split()[1]) == pid:
                out.append(int(task.name))
    return out


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
