"""``tools/gpu_run.py``: each variant's plan, the runner's bookkeeping, and that every option a plan passes is one its
command still takes (so a renamed or removed option fails here, not on the GPU machine)."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("fp_gpu_run", ROOT / "tools" / "gpu_run.py")
gpu_run = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = gpu_run  # its dataclasses look their module up
_spec.loader.exec_module(gpu_run)

# every variant, and the option sets that change a plan's commands
PLANS = [[v] for v in gpu_run.VARIANTS if v != "record"] + [["record", "--part", p] for p in gpu_run.RECORD_PARTS] + [
    ["bench", "--smoke"], ["edge", "--smoke"], ["edge", "--profile", "--ingest-workers", "0"],
    ["train", "--phase", "train"], ["train", "--phase", "post", "--work", "w", "--data", "seq"],
    ["record", "--part", "suite-held-out", "--minutes", "5", "--weights-cache", "cache"],
]


def _plan(capsys, argv: list[str]) -> list[dict]:
    assert gpu_run.main([*argv, "--dry-run"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["variant"] == argv[0]
    return report["plan"]


def test_a_suite_part_trains_into_the_weights_cache_it_is_given(capsys) -> None:
    (step,) = _plan(capsys, ["record", "--part", "suite-held-out", "--minutes", "5", "--weights-cache", "cache"])
    words = shlex.split(step["command"])
    assert words[words.index("--weights-cache") + 1] == "cache" and words[words.index("--minutes") + 1] == "5.0"
    (step,) = _plan(capsys, ["record", "--part", "suite-tune"])
    assert "--weights-cache" not in step["command"]  # a temporary folder: weights of one call
    words = shlex.split(step["command"])  # the four objects at once, 5.5 minutes each
    assert words[words.index("--train-jobs") + 1] == "4" and words[words.index("--minutes") + 1] == "5.5"


def _servers(plan: list[dict]) -> list[dict]:
    """The plan's servers (an edge plan ends with steps of its own: the in-process bench and the ratio)."""
    return [item for item in plan if "server" in item]


def _steps(plan: list[dict]) -> list[dict]:
    out = []
    for item in plan:
        for step in item.get("steps", [item]):
            out += [step, *step.get("window_samplers", [])]
    return out


@pytest.mark.parametrize("argv", PLANS, ids=" ".join)
def test_each_plan_names_its_outputs_once_and_runs_files_that_exist(capsys, argv: list[str]) -> None:
    plan = _plan(capsys, argv)
    steps = _steps(plan)
    assert steps, argv
    outputs = [s["stdout"] for s in steps if s["stdout"]]
    assert len(outputs) == len(set(outputs)), outputs  # no step overwrites another's report
    for step in steps:
        words = shlex.split(step["command"])
        scripts = [w for w in words if w.startswith("tools/")]
        assert all((ROOT / w).is_file() for w in scripts), scripts
        assert step["timeout_s"] > 0


def test_extra_options_reach_every_command_of_their_kind(capsys) -> None:
    bench = _steps(_plan(capsys, ["bench", "--bench-args", "--weights W"]))
    assert all(shlex.split(s["command"])[-4:-2] == ["--weights", "W"] for s in bench)  # before --out FILE
    edge = _servers(_plan(capsys, ["edge", "--server-args", "--weights W --api-key K", "--ingest-workers", "2"]))
    assert [item["server"] for item in edge] == ["main", "ingest"]
    assert all(item["command"].endswith("--weights W --api-key K") or "--ingest-workers 2" in item["command"]
               for item in edge)
    assert "--weights W --api-key K --ingest-workers 2" in edge[1]["command"]


def test_edge_clients_send_the_bundled_frame_to_a_server_with_trained_weights(capsys) -> None:
    def scene(command: str) -> str | None:
        words = shlex.split(command)
        return words[words.index("--scene") + 1] if "--scene" in words else None

    def scenes(argv: list[str]) -> set[str | None]:
        return {scene(step["command"]) for item in _servers(_plan(capsys, argv)) for step in item["steps"]}

    assert scenes(["edge", "--server-args", "--weights W"]) == {"bundled"}
    assert scenes(["edge"]) == {None}  # random weights: the synthetic frame, as every earlier record
    assert scenes(["edge", "--smoke", "--server-args", "--weights W"]) == {None}  # the smoke's 160x120 frames


def test_the_edge_plan_samples_the_cpu_of_each_many_client_window(capsys) -> None:
    plan = _plan(capsys, ["edge", "--profile"])
    ingest = plan[1]["steps"]
    many = [s for s in ingest if " --clients 64 " in s["command"]]
    assert len(many) == 3 and all(" --processes 8 " in s["command"] for s in many)
    for step in many:
        names = [w["name"] for w in step["window_samplers"]]
        assert names == [f"cpu_{step['name']}", f"pyspy_{step['name']}"]
        assert "{server_pid}" in step["window_samplers"][0]["command"]


def test_every_edge_client_connects_to_the_port_a_user_of_the_no_flag_server_would(capsys) -> None:
    main, ingest = _servers(_plan(capsys, ["edge"]))
    port = re.search(r"--port (\d+)", main["command"]).group(1)
    assert not re.search(r"--ingest-(workers|port)", main["command"])  # the no-flag layout
    assert "--ingest-workers 8" in ingest["command"] and "--ingest-port" not in ingest["command"]
    names = {s["name"] for s in main["steps"]}
    assert {"main_http_png_1", "main_http_binary_1", "main_stream_1", "main_http_binary_64",
            "main_http_binary_64_no_registers", "main_stream_64"} <= names
    for step in [*main["steps"], *ingest["steps"]]:
        assert f" --url http://127.0.0.1:{port} " in step["command"] and "--track-url" not in step["command"], step


def test_the_first_requests_part_asks_a_fresh_no_flag_server_for_the_object_it_loaded(tmp_path: Path) -> None:
    (server,) = gpu_run.plan_first_requests(tmp_path / "objects")
    command = " ".join(server.argv)
    assert f"--objects {tmp_path / 'objects'} " in command
    assert not re.search(r"--ingest-|--config", command)  # the no-flag layout
    assert sorted(p.name for p in (tmp_path / "objects" / "bundled").iterdir()) == [
        "texture_map.png", "textured_simple.mtl", "textured_simple.obj"]
    (step,) = server.steps
    assert step.name == "first_requests" and step.stdout == "first_requests.json"
    step_command = " ".join(step.argv)
    assert f"--url {server.url} " in step_command and "--object-id bundled" in step_command


def test_smoke_is_refused_where_it_means_nothing(capsys) -> None:
    with pytest.raises(SystemExit, match="--smoke applies to bench and edge only"):
        gpu_run.main(["train", "--smoke", "--dry-run"])
    with pytest.raises(SystemExit) as exc:
        gpu_run.main(["train", "--phase", "post", "--dry-run"])  # post needs the weights' folder
    assert exc.value.code == 2


def test_the_runner_records_every_step_and_starts_samplers_in_the_window(tmp_path: Path) -> None:
    """Three steps: one that fails, one past its limit, and one that announces a load window and then waits for its
    sampler's file: it ends only if the sampler was started inside the window."""
    flag = tmp_path / "sampled"
    announce = ("import pathlib, sys, time\n"
                "print('the window of 1 s starts', file=sys.stderr, flush=True)\n"
                f"p = pathlib.Path({str(flag)!r}); deadline = time.monotonic() + 60\n"
                "while not p.exists() and time.monotonic() < deadline: time.sleep(0.05)\n"
                "print('{\"sampled\": %s}' % str(p.exists()).lower())\n")
    sampler = gpu_run.Step("touch", (sys.executable, "-c", f"import pathlib; pathlib.Path({str(flag)!r}).touch()"),
                           30)
    plan = [
        gpu_run.Step("fails", (sys.executable, "-c", "raise SystemExit(3)"), 30),
        gpu_run.Step("hangs", (sys.executable, "-c", "import threading; threading.Event().wait()"), 0.5),
        gpu_run.Step("window", (sys.executable, "-c", announce), 90, stdout="window.json",
                     window_samplers=(sampler,)),
    ]
    runner = gpu_run.Runner(tmp_path, gpu_run.command_env(None))
    assert runner.run(plan) == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(row["name"], row["rc"]) for row in summary][0] == ("fails", 3)
    assert summary[1]["name"] == "hangs" and summary[1]["rc"] != 0 and "limit" in summary[1]["note"]
    assert summary[2]["rc"] == 0 and json.loads((tmp_path / "window.json").read_text()) == {"sampled": True}
    assert (tmp_path / "fails.log").exists()


@pytest.mark.slow
def test_every_option_a_plan_passes_is_one_its_command_takes(capsys) -> None:
    """``--help`` of each command the plans run (bench, server, train, evaluate, demo, export, the load generator,
    proc_cpu, pytest) lists every ``--option`` the plans give it."""
    by_target: dict[tuple[str, ...], set[str]] = {}
    for argv in PLANS:
        plan = _plan(capsys, argv)
        for command in [item["command"] for item in plan if "server" in item] + [s["command"] for s in _steps(plan)]:
            words = shlex.split(command)
            if words[0] != sys.executable or words[1] == "-c":
                continue  # py-spy, inline code: not a project command
            target = tuple(words[1:3]) if words[1] == "-m" else (words[1],)
            if words[1] == "-m" and len(words) > 3 and words[3] in ("scenarios", "calibrate", "suite"):
                target += (words[3],)  # a sub-command: its own options
            by_target.setdefault(target, set()).update(w.split("=")[0] for w in words if w.startswith("--"))
    assert {t[-1] for t in by_target} >= {"foundationpose.bench", "server", "foundationpose.train",
                                         "foundationpose.evaluate", "foundationpose.demo", "engines.export",
                                         "tools.loadtest", "tools/proc_cpu.py", "pytest"}
    targets = sorted(by_target)

    def help_of(target: tuple[str, ...]) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *target, "--help"], cwd=ROOT, capture_output=True, text=True,
                              timeout=300, env=gpu_run.command_env(None))

    # the commands' interpreters start side by side (most of each is importing torch): one wait for all of them
    with ThreadPoolExecutor(max_workers=4) as pool:
        answers = dict(zip(targets, pool.map(help_of, targets), strict=True))
    for target in targets:
        done, options = answers[target], by_target[target]
        assert done.returncode == 0, (target, done.stderr[-2000:])
        offered = set(re.findall(r"--[a-z0-9][a-z0-9-]*", done.stdout))
        assert options <= offered, (target, sorted(options - offered))


@pytest.mark.slow
def test_edge_smoke_runs_on_the_cpu(tmp_path: Path) -> None:
    """The edge variant end to end on the CPU (tiny networks, short windows, no ingest workers): the server gets
    ready, every load test answers, the summary says so."""
    done = subprocess.run([sys.executable, "tools/gpu_run.py", "edge", "--smoke", "--ingest-workers", "0",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=gpu_run.command_env(None))
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "edge"
    summary = json.loads((out / "summary.json").read_text())
    assert [row["name"] for row in summary] == ["server_main", "main_http_png_1", "main_http_binary_1",
                                                "main_stream_1", "main_http_binary_4", "main_http_binary_4_no_registers",
                                                "main_stream_4", "bench_sessions", "edge_ratio"]
    for name in ("main_http_png_1", "main_http_binary_1", "main_stream_1"):
        report = json.loads((out / f"{name}.json").read_text())
        assert report["tracks_per_s"] > 0 and not report["errors_by_status"], (name, report)
    # the engine of the same call, and each many-client load's share of it
    ratio = json.loads((out / "edge_ratio.json").read_text())
    in_process = ratio["in_process_frames_per_s"]["4"]
    assert in_process > 0
    assert set(ratio["loads"]) == {"main_http_binary_4", "main_http_binary_4_no_registers", "main_stream_4"}
    for name, row in ratio["loads"].items():
        report = json.loads((out / f"{name}.json").read_text())
        assert row["share_of_in_process"] == round(report["tracks_per_s"] / in_process, 3), (name, row)
    # each load window's digest is logged beside its exit
    assert done.stderr.count(" tracks/s, ") == 6, done.stderr[-3000:]


def test_the_edge_plan_ends_with_the_engine_of_the_same_call_and_the_share_of_it(capsys) -> None:
    """After the servers: the in-process bench at the load's session count (with the server's weights), then the
    ratio of each many-client load to it."""
    for argv, sessions, weights in ((["edge", "--server-args", "--weights W"], "64", "W"),
                                    (["edge", "--smoke"], "4", None)):
        plan = _plan(capsys, argv + ["--ingest-workers", "0"])
        bench, ratio = plan[-2], plan[-1]
        assert (bench["name"], ratio["name"], ratio["stdout"]) == ("bench_sessions", "edge_ratio", "edge_ratio.json")
        words = shlex.split(bench["command"])
        assert words[words.index("--sessions") + 1] == sessions
        assert (words[words.index("--weights") + 1] if "--weights" in words else None) == weights
        assert ("--tiny" in words) == (sessions == "4")


def test_every_gpu_variant_refuses_a_machine_without_cuda_before_running_anything(capsys, monkeypatch) -> None:
    monkeypatch.setattr(gpu_run, "missing_cuda", lambda: "this machine has no CUDA device (torch 0)")
    monkeypatch.setattr(gpu_run, "build_plan", lambda *a: pytest.fail("a plan was built"))
    for argv in (["bench"], ["record", "--part", "checks"], ["cuda-tests"]):
        assert gpu_run.main(argv) == 2
        assert "this machine has no CUDA device (torch 0); nothing was run" in capsys.readouterr().err


def test_a_plan_that_starts_the_server_is_refused_before_anything_runs_when_the_server_extra_is_missing(
        capsys, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(gpu_run, "missing_cuda", lambda: None)
    monkeypatch.setattr(gpu_run, "missing_server_packages", lambda env: "'opentelemetry' (needed by 'fastapi')")
    monkeypatch.setattr(gpu_run.Runner, "run", lambda *a: pytest.fail("a command ran"))
    monkeypatch.setattr(gpu_run, "run_record_part", lambda *a: pytest.fail("a record part ran"))
    for argv in (["edge", "--smoke"], ["record", "--part", "edge"], ["record", "--part", "first-requests"]):
        assert gpu_run.main([*argv, "--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert "the package 'opentelemetry' (needed by 'fastapi') is missing" in err and "nothing was run" in err
    # a plan without a server does not ask
    monkeypatch.setattr(gpu_run, "missing_server_packages", lambda env: pytest.fail("checked for the server"))
    monkeypatch.setattr(gpu_run.Runner, "run", lambda *a: 0)
    assert gpu_run.main(["cuda-tests", "--out", str(tmp_path)]) == 0


def test_the_server_extra_is_checked_in_the_environment_the_commands_run_in(tmp_path: Path) -> None:
    env = gpu_run.command_env(None)
    assert gpu_run.missing_server_packages(env) is None  # this test environment has the server extra
    shadow = tmp_path / "site" / "fastapi"  # a fastapi whose own dependency is not installed, first on the path
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("import opentelemetry_not_installed_here\n")
    env["PYTHONPATH"] = f"{tmp_path / 'site'}:{env['PYTHONPATH']}"
    assert gpu_run.missing_server_packages(env) == "'opentelemetry_not_installed_here' (needed by 'fastapi')"


def test_record_needs_a_part_and_a_part_needs_record(capsys) -> None:
    for argv in (["record", "--dry-run"], ["bench", "--part", "edge", "--dry-run"]):
        with pytest.raises(SystemExit):
            gpu_run.main(argv)
        assert "--part goes with the record variant" in capsys.readouterr().err


def _fake_machine(gpu: str):  # noqa: ANN202
    return lambda: ({"gpu": gpu, "driver": "580.1", "gpus": 1, "cpus": 2},
                    {"python": "3.12", "torch": "2.11", "cuda": "13.0", "cudnn": 91900, "triton": "3.6", "numpy": "2.5"})


def test_a_record_part_writes_its_reports_and_a_whole_summary_and_parts_merge(tmp_path: Path, monkeypatch) -> None:
    from tools import records

    monkeypatch.setattr(records, "machine_and_versions", _fake_machine("Test GPU"))
    monkeypatch.setenv("FP_RECORD_COMMIT", "0123abc")
    record, scratch = tmp_path / "record", tmp_path / "scratch"
    junit = ('<testsuite><testcase classname="t" name="ok"/><testcase classname="t" name="bad">'
             '<failure message="assert 1 == 2"/></testcase><testcase classname="t" name="skip">'
             '<skipped message="needs CUDA"/></testcase></testsuite>')
    py = sys.executable
    plan = [
        gpu_run.Step("cuda_tests", (py, "-c", f"open('{{out}}/cuda_tests.xml', 'w').write({junit!r})"), 60),
        gpu_run.Step("bench", (py, "-c", "import json; json.dump({'headline': {'track_p50_ms': 2.0}}, "
                                         "open('{out}/bench.json', 'w'))"), 60),
        gpu_run.Step("objects", (py, "-c", "import sys; print('boom: no GPU', file=sys.stderr); sys.exit(3)"), 60),
    ]
    args = gpu_run.build_parser().parse_args(["record", "--part", "checks", "--record", str(record)])
    out = tmp_path / "out"
    out.mkdir()
    assert gpu_run.run_record_part(args, plan, out, scratch, gpu_run.command_env(None)) == 1
    summary = records.check_record(record)
    assert summary["commit"] == "0123abc" and summary["machine"]["gpu"] == "Test GPU"
    commands = summary["parts"]["checks"]["commands"]
    assert [(c["name"], c["rc"], c.get("file")) for c in commands] == [
        ("cuda_tests", 0, "cuda_tests.json"), ("bench", 0, "bench.json"), ("objects", 3, None)]
    assert commands[2]["log_tail"] == ["boom: no GPU"]
    tests = json.loads((record / "cuda_tests.json").read_text())
    assert (tests["passed"], tests["failed"], tests["skipped"]) == (1, 1, 1)
    assert tests["failures"] == [{"test": "t::bad", "message": "assert 1 == 2"}]
    assert summary["parts"]["checks"]["defaults_fingerprint"] == records.defaults_fingerprint(
        records.PART_DEFAULTS["checks"])
    assert sorted(p.name for p in record.iterdir()) == ["bench.json", "cuda_tests.json", "summary.json"]

    edge = gpu_run.build_parser().parse_args(["record", "--part", "edge", "--record", str(record)])
    assert gpu_run.run_record_part(edge, plan[1:2], out, scratch, gpu_run.command_env(None)) == 0
    assert set(records.check_record(record)["parts"]) == {"checks", "edge"}

    monkeypatch.setattr(records, "machine_and_versions", _fake_machine("Another GPU"))
    assert gpu_run.run_record_part(edge, plan[1:2], out, scratch, gpu_run.command_env(None)) == 2


def test_the_accuracy_part_trains_short_enough_to_fit_one_call_and_train_keeps_its_own_time(capsys) -> None:
    def train_command(argv: list[str]) -> str:
        return next(s["command"] for s in _steps(_plan(capsys, argv)) if s["name"] == "train")

    assert "--minutes 6.0" in train_command(["record", "--part", "accuracy"])
    assert "--minutes 8.0" in train_command(["train"])
    assert "--minutes 2.5" in train_command(["record", "--part", "accuracy", "--minutes", "2.5"])
    train_step = next(s for s in _steps(_plan(capsys, ["record", "--part", "accuracy"])) if s["name"] == "train")
    assert train_step["timeout_s"] == 6.0 * 60 + 300
    with pytest.raises(SystemExit):
        gpu_run.main(["train", "--minutes", "0", "--dry-run"])
    assert "--minutes must be > 0" in capsys.readouterr().err
