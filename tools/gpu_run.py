"""Run one of the project's GPU measurements on a CUDA machine and collect its results in one folder.

    python tools/gpu_run.py bench        # in-process figures: python -m foundationpose.bench, 1 and 64 sessions
    python tools/gpu_run.py startup      # start-up on a fresh machine (empty caches), then again with warm caches
    python tools/gpu_run.py edge         # python -m server under load: one client per transport, 64 clients
    python tools/gpu_run.py train        # train weights for one object, evaluate them, run the demo, export ONNX
    python tools/gpu_run.py cuda-tests   # the test suite's CUDA tests
    python tools/gpu_run.py record --part checks|edge|accuracy   # a committed record, in three calls
    python tools/gpu_run.py edge --dry-run   # print the commands, run nothing

Every variant writes ``OUT/<variant>/`` (``--out``, default ``$OUT`` or ``gpu_run_out``): each command's JSON report
or log, and ``summary.json`` (per command: the command line, exit status, seconds, files). The commands are the
project's own (``python -m foundationpose.bench``, ``python -m server``, ``python -m tools.loadtest``, ...), run with their
defaults plus what the variant sets; ``--bench-args`` / ``--server-args`` / ``--train-args`` append options to every
bench, server or training command (e.g. ``--server-args "--weights DIR"``). Variants in detail:

* ``bench``: ``bench.json`` (the bench with no flags: both session models at 1 and 64 sessions, frames in
  page-locked slots) and ``bench_pageable.json`` (64 sessions whose frames are ordinary arrays: a copy per request).
* ``startup``: the bench's start-up (``startup_s``) twice with the same cache directories: first empty
  (``HOME``, so the compile cache's default folder, ``XDG_CACHE_HOME``, ``TORCHINDUCTOR_CACHE_DIR`` and
  ``TRITON_CACHE_DIR`` in a new folder: a fresh machine), then filled by the first run: ``cold.json``,
  ``warm.json``.
* ``edge``: ``python -m server`` on 127.0.0.1, first with no flags about its layout (``main``: on CUDA its ingest
  workers take its port), then with ``--ingest-workers N`` (``ingest``: the same port, an explicit worker count;
  ``--ingest-workers 0`` here leaves that layout out). Every client connects to the server's port, as a user's
  would. Per layout: one client each of ``POST /track/binary`` and ``WS /track/stream`` (and PNG ``POST /track`` on
  ``main``), 64 binary clients in 8 load processes with 4 register clients offering 5 registers/s, the same without
  registers, and 64 streams with the registers. The clients send the load generator's synthetic frame, or with
  ``--server-args "--weights DIR"`` the bundled sequence's (``--scene bundled``: trained weights recognise only the
  object they were trained on, the bundled one by default). During each 64-client window
  ``tools/proc_cpu.py`` records the CPU of every process and thread of the server and the load generator
  (``cpu_<run>.json``); with ``--profile`` py-spy records the server too (``pyspy_<run>.txt``, summarised by
  ``tools/pyspy_top.py``). Reports: ``<layout>_<run>.json`` (the load generator's JSON), ``server_<layout>.log``.
  Then, the servers stopped, the engine of the same call: ``python -m foundationpose.bench`` at 64 sessions (with
  the server's ``--weights``; ``bench_sessions.json``), and each many-client load's share of its rate against the
  service's goal (``tools/edge_ratio.py``: ``edge_ratio.json``).
* ``train``: ``python -m foundationpose.train`` for ``--minutes`` on ``--mesh`` (default: the bundled object), then
  ``python -m foundationpose.evaluate`` (``--views`` held-out views and the sequence ``--data``), the demo with the
  trained weights and ``python -m engines.export --check``; ``results.json`` holds the headline figures.
  ``--phase train`` / ``--phase post`` split training from the rest (two jobs on one machine, ``--work`` kept).
* ``cuda-tests``: ``pytest -k "cuda or nvdiffrast or triton"`` over the suite, then the service tests with
  ``FP_TEST_DEVICE=cuda`` (pipelined == reference on the GPU).

* ``record``: the whole GPU verification as one record (``--record DIR``, default
  ``benchmarks/records/<date>-<gpu>-<commit>``), JSON only, in parts that each fit one 10-minute call:
  ``checks`` (the CUDA tests, the bench, the validity and several-objects benches), ``edge`` (start-up cold and warm,
  then the server under load in the no-flag layout and with ingest workers), ``first-requests`` (a fresh server with
  the bundled object, then ``python -m tools.first_requests``), ``accuracy`` (training ``--minutes``,
  default 6 there, on the bundled object, ``evaluate``, ``evaluate scenarios`` and the demo with those weights), and
  ``suite-tune`` / ``suite-held-out`` (``evaluate suite`` on one half of the object suite: its four objects trained
  at once for ``--minutes``, default 5.5 there, then 20 register views and the clean and jump scenarios of 40 frames).
  Each part adds its files and its entry to the record's ``summary.json`` (machine, versions, commit, defaults fingerprint: see
  ``tools/records.py``); a part measured under other defaults than the record's is refused.

``--smoke`` runs ``bench`` or ``edge`` on the CPU with a tiny configuration and short windows: it checks the
variant's commands here, not the GPU's figures. ``--wheels DIR`` first installs the wheels of DIR (no index, no
dependencies) into a private folder put first on every command's ``PYTHONPATH``: for a machine without a package
index. Every variant but ``--smoke`` and ``--dry-run`` needs a CUDA device and exits with status 2 before running
anything without one; a variant that starts ``python -m server`` (``edge``, record parts ``edge`` and
``first-requests``) first checks, in the environment its commands run in (``--wheels`` included), that the server
extra imports, and exits with status 2 naming the missing package (or the missing dependency of one) before running
anything. The exit status is 0 when every command exited 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as ``python tools/gpu_run.py``: the repository root holds the ``tools`` package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools.ports import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
LOADTEST = (PY, "-m", "tools.loadtest")
PROC_CPU = (PY, "tools/proc_cpu.py")
PYSPY_TOP = (PY, "tools/pyspy_top.py")
BUNDLED_MESH = "foundationpose/data/demo_sequence/mesh/textured_simple.obj"
VARIANTS = ("bench", "startup", "edge", "train", "cuda-tests", "record")
RECORD_PARTS = ("checks", "edge", "first-requests", "accuracy", "suite-tune", "suite-held-out")
TRAIN_MINUTES = 8.0  # the train variant's training time
RECORD_TRAIN_MINUTES = 6.0  # record --part accuracy: training, evaluate, scenarios and the demo in one 10-minute call
# record --part suite-*: four objects trained at once and evaluated in one 10-minute call (about 25 s of
# evaluation each)
SUITE_TRAIN_MINUTES = 5.5
SUITE_TRAIN_JOBS = 4
SUITE_EVALUATION = ("--views", "20", "--scenario", "clean", "--scenario", "jump", "--frames", "40")
# 64 closed-loop clients: what the service figures are measured with (8 clients per load process keeps the load
# generator below a core each: its own CPU is inside every round trip).
MANY_CLIENTS, LOAD_PROCESSES = 64, 8
WINDOW_MARKER = "the window of"  # the load generator's line on stderr when the measured window starts


@dataclass(frozen=True)
class Step:
    """One command: its argv (run in the repository root), a time limit, where its stdout goes (a file name in the
    variant's folder; None = ``<name>.stdout``; stderr always goes to ``<name>.log``), extra environment, and the
    samplers started when the command's stderr shows ``WINDOW_MARKER`` (the profilers of a load window)."""

    name: str
    argv: tuple[str, ...]
    timeout_s: float
    stdout: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    window_samplers: tuple[Step, ...] = ()


@dataclass(frozen=True)
class Server:
    """A ``python -m server`` started before its steps and stopped (SIGINT, then SIGKILL) after them."""

    name: str
    argv: tuple[str, ...]
    url: str
    ready_timeout_s: float
    steps: tuple[Step, ...]


Plan = list["Step | Server"]


# ---------------------------------------------------------------------------------------------------- the plans


def plan_bench(args: argparse.Namespace) -> Plan:
    extra = tuple(shlex.split(args.bench_args))
    bench = (PY, "-m", "foundationpose.bench")
    if args.smoke:
        return [Step("bench", (*bench, "--device", "cpu", "--tiny", *extra, "--out", "{out}/bench.json"), 600,
                     stdout="bench.stdout")]
    return [
        Step("bench", (*bench, *extra, "--out", "{out}/bench.json"), 600, stdout="bench.stdout"),
        Step("bench_pageable", (*bench, "--sessions", "64", "--track-frames", "60", "--runs", "3",
                                "--pageable-frames", *extra, "--out", "{out}/bench_pageable.json"), 600,
             stdout="bench_pageable.stdout"),
    ]


def plan_startup(args: argparse.Namespace, caches: Path) -> Plan:
    env = {"HOME": str(caches / "home"), "XDG_CACHE_HOME": str(caches / "xdg"),
           "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"), "TRITON_CACHE_DIR": str(caches / "triton")}
    short = ("--sessions", "1", "--track-frames", "5", "--runs", "3")
    extra = tuple(shlex.split(args.bench_args))
    return [Step(run, (PY, "-m", "foundationpose.bench", *short, *extra, "--out", f"{{out}}/{run}.json"), 300,
                 stdout=f"{run}.stdout", env=env) for run in ("cold", "warm")]


def plan_edge(args: argparse.Namespace, objects: Path) -> Plan:
    device, image = ("cpu", "160x120") if args.smoke else ("cuda", "640x480")
    clients, processes = (4, 2) if args.smoke else (MANY_CLIENTS, LOAD_PROCESSES)
    # the smoke checks the commands, not their figures: windows of a few CPU tracks each
    one_s, many_s, setup_s = (1, 2, 60) if args.smoke else (6, 10, 45)
    sample_s = max(1, many_s - 4)  # the samplers' window, inside the load's (it starts when the load's does)
    tiny = ("--hypotheses", "4", "--register-iterations", "1", "--track-iterations", "1") if args.smoke else ()
    extra = tuple(shlex.split(args.server_args))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    endless = ("--tracks-per-register", "100000", "--max-requests", "1000000")
    # trained weights recognise their own object only: the clients then send the bundled sequence's frame (the
    # object python -m foundationpose.train trains on by default), else every session would be lost and recovering
    scene = ("--scene", "bundled") if "--weights" in extra and not args.smoke else ()
    server = (PY, "-m", "server", "--objects", str(objects), "--host", "127.0.0.1", "--port", str(port),
              "--device", device, "--max-image", image, *tiny, *extra)

    def load(name: str, mode: str, n: int, seconds: float, *more: str) -> Step:
        argv = (*LOADTEST, "--url", url, "--image", image, "--clients", str(n), "--mode", mode, "--duration-s",
                str(seconds), *endless, *scene, *more)
        if n == 1:
            return Step(name, argv, 120, stdout=f"{name}.json")
        argv += ("--processes", str(processes), "--on-diverge", "stateless", "--setup-timeout-s", str(setup_s))
        samplers = [Step(f"cpu_{name}", (*PROC_CPU, "--pid", "{server_pid}", "--also", "tools.loadtest",
                                         "--duration-s", str(sample_s)), 30, stdout=f"cpu_{name}.json")]
        if args.profile:
            samplers.append(Step(f"pyspy_{name}", ("py-spy", "record", "--pid", "{server_pid}",
                                                   "--duration", str(sample_s),
                                                   "--rate", "250", "--threads", "--nonblocking", "--format", "raw",
                                                   "-o", f"pyspy_{name}.raw"), 30))
        return Step(name, argv, 180, stdout=f"{name}.json", window_samplers=tuple(samplers))

    with_regs = ("--registers-alongside", "4", "--register-rate", "5")

    def many(layout: str) -> tuple[Step, ...]:
        return (load(f"{layout}_http_binary_{clients}", "http-binary", clients, many_s, *with_regs),
                load(f"{layout}_http_binary_{clients}_no_registers", "http-binary", clients, many_s),
                load(f"{layout}_stream_{clients}", "stream", clients, many_s, *with_regs))

    layouts: Plan = [Server("main", server, url, 600, (
        load("main_http_png_1", "http-png", 1, one_s),
        load("main_http_binary_1", "http-binary", 1, one_s),
        load("main_stream_1", "stream", 1, one_s),
        *many("main"),
    ))]
    if args.ingest_workers > 0:
        layouts.append(Server("ingest", (*server, "--ingest-workers", str(args.ingest_workers)), url, 600, (
            load("ingest_http_binary_1", "http-binary", 1, one_s),
            load("ingest_stream_1", "stream", 1, one_s),
            *many("ingest"),
        )))
    # the engine in the same call, with the servers stopped: the share of it each load reached (edge_ratio.json)
    weights = ("--weights", extra[extra.index("--weights") + 1]) if "--weights" in extra[:-1] else ()
    small = ("--device", "cpu", "--tiny", "--track-frames", "4") if args.smoke else ("--track-frames", "200")
    bench = Step("bench_sessions", (PY, "-m", "foundationpose.bench", "--sessions", str(clients), "--runs", "1",
                                    *small, *weights, "--out", "{out}/bench_sessions.json"), 300,
                 stdout="bench_sessions.stdout")
    return [*layouts, bench, Step("edge_ratio", (PY, "-m", "tools.edge_ratio", "{out}"), 60, stdout="edge_ratio.json")]


def plan_first_requests(objects: Path) -> Plan:
    """A freshly started ``python -m server`` (no flags but the device and image size) with the bundled object
    loaded, then ``python -m tools.first_requests``: each transport's first request after ready against its steady
    latency, and the warm-up's time per path."""
    from foundationpose.demo.dataset import BUNDLED_SEQUENCE_DIR

    shutil.copytree(BUNDLED_SEQUENCE_DIR / "mesh", objects / "bundled", dirs_exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = (PY, "-m", "server", "--objects", str(objects), "--host", "127.0.0.1", "--port", str(port),
              "--device", "cuda", "--max-image", "640x480")
    first = Step("first_requests", (PY, "-m", "tools.first_requests", "--url", url, "--image", "640x480",
                                    "--object-id", "bundled"), 180, stdout="first_requests.json")
    return [Server("first", server, url, 600, (first,))]


def plan_train(args: argparse.Namespace, work: Path) -> Plan:
    weights = work / "weights"
    extra = tuple(shlex.split(args.train_args))
    train = Step("train", (PY, "-m", "foundationpose.train", "--mesh", args.mesh, "--out", str(weights),
                           "--minutes", str(args.minutes), "--no-progress", *extra),
                 args.minutes * 60 + 300, stdout="train.stdout")
    data = ("--data", args.data) if args.data else ()
    post = [
        Step("evaluate", (PY, "-m", "foundationpose.evaluate", "--weights", str(weights), *data, "--mesh", args.mesh,
                          "--views", str(args.views), "--out", str(work / "eval"), "--no-progress"), 600,
             stdout="evaluate.json"),
        Step("demo", (PY, "-m", "foundationpose.demo", "--weights", str(weights), *data,
                      "--out", str(work / "demo"), "--no-video", "--no-progress", "--json"), 600, stdout="demo.json"),
        Step("export", (PY, "-m", "engines.export", "--weights", str(weights), "--out", str(work / "onnx"),
                        "--check"), 600, stdout="export.stdout"),
    ]
    return {"all": [train, *post], "train": [train], "post": post}[args.phase]


def plan_cuda_tests(args: argparse.Namespace) -> Plan:
    pytest = (PY, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider")
    return [
        Step("cuda_tests", (*pytest, "tests", "-k", "cuda or nvdiffrast or triton"), 900, stdout="cuda_tests.txt"),
        Step("service_on_cuda", (*pytest, "tests/foundationpose/test_service.py",
                                 "tests/foundationpose/test_service_batching.py"), 600,
             stdout="service_on_cuda.txt", env={"FP_TEST_DEVICE": "cuda"}),
    ]


def plan_record(args: argparse.Namespace, scratch: Path) -> Plan:
    """One part of the record: its commands write their JSON reports into the variant's folder (``{out}``)."""
    if args.part == "checks":
        pytest = (PY, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider")
        return [
            Step("cuda_tests", (*pytest, "tests", "-k", "cuda or nvdiffrast or triton",
                                "--junit-xml", "{out}/cuda_tests.xml"), 300, stdout="cuda_tests.txt"),
            Step("bench", (PY, "-m", "foundationpose.bench", "--out", "{out}/bench.json"), 200, stdout="bench.stdout"),
            Step("validity", (PY, "-m", "foundationpose.bench.validity", "--batches", "1,16,64"), 90,
                 stdout="validity.json"),
            Step("objects", (PY, "-m", "foundationpose.bench.objects", "--out", "{out}/objects.json"), 120,
                 stdout="objects.stdout"),
            Step("service_on_cuda", (*pytest, "tests/foundationpose/test_service.py",
                                     "tests/foundationpose/test_service_batching.py",
                                     "--junit-xml", "{out}/service_on_cuda.xml"), 150,
                 stdout="service_on_cuda.txt", env={"FP_TEST_DEVICE": "cuda"}),
        ]
    if args.part == "edge":
        return [*plan_startup(args, scratch / "caches"), *plan_edge(args, scratch / "objects")]
    if args.part == "first-requests":
        return plan_first_requests(scratch / "first_objects")
    if args.part.startswith("suite-"):  # one half of the object suite: trained here, evaluated, one JSON report
        split = args.part.removeprefix("suite-").replace("-", "_")
        name = f"suite_{split}"
        cache = ("--weights-cache", str(args.weights_cache)) if args.weights_cache else ()
        return [Step(name, (PY, "-m", "foundationpose.evaluate", "suite", "--split", split, "--minutes",
                            str(args.minutes), "--train-jobs", str(SUITE_TRAIN_JOBS), *SUITE_EVALUATION, *cache,
                            "--out", str(scratch / name), "--json", "--no-progress"), 590, stdout=f"{name}.json")]
    train, evaluate, demo, _export = plan_train(args, scratch / "train")  # the train variant's steps, less export
    work = scratch / "train"
    scenarios = Step("scenarios", (PY, "-m", "foundationpose.evaluate", "scenarios", "--weights", str(work / "weights"),
                                   "--out", str(work / "scenarios"), "--json", "--no-progress"), 300,
                     stdout="scenarios.json")
    return [train, evaluate, scenarios, demo]


def build_plan(args: argparse.Namespace, scratch: Path) -> Plan:
    """The variant's commands, in order; ``scratch`` holds what they share but nobody reads (caches, objects)."""
    if args.smoke and args.variant not in ("bench", "edge"):
        raise SystemExit(f"gpu_run: --smoke applies to bench and edge only, not {args.variant}")
    if args.variant == "bench":
        return plan_bench(args)
    if args.variant == "startup":
        return plan_startup(args, scratch / "caches")
    if args.variant == "edge":
        return plan_edge(args, scratch / "objects")
    if args.variant == "train":
        return plan_train(args, Path(args.work) if args.work else scratch / "train")
    if args.variant == "record":
        return plan_record(args, scratch)
    return plan_cuda_tests(args)


def plan_as_json(plan: Plan) -> list[dict]:
    def step(s: Step) -> dict:
        row = {"name": s.name, "command": shlex.join(s.argv), "timeout_s": s.timeout_s, "stdout": s.stdout}
        if s.env:
            row["env"] = s.env
        if s.window_samplers:
            row["window_samplers"] = [step(w) for w in s.window_samplers]
        return row
    return [{"server": item.name, "command": shlex.join(item.argv), "url": item.url,
             "steps": [step(s) for s in item.steps]} if isinstance(item, Server) else step(item) for item in plan]


# ---------------------------------------------------------------------------------------------------- running


class Runner:
    """Runs a plan's steps one after the other in ``out``, records each in ``summary``; never raises for a failed
    command (the next one runs; the exit status says how many failed)."""

    def __init__(self, out: Path, env: dict[str, str], after_step: Callable[[dict], None] | None = None) -> None:
        self.out, self.env, self.summary, self.after_step = out, env, [], after_step

    def log(self, text: str) -> None:
        print(f"=== {time.strftime('%H:%M:%S')} {text}", file=sys.stderr, flush=True)

    def run(self, plan: Plan) -> int:
        for item in plan:
            if isinstance(item, Server):
                with self.server(item) as pid:
                    for step in item.steps:
                        if pid is None:
                            self.record(step, None, 0.0, "not run: the server never got ready")
                        else:
                            self.step(step, server_pid=pid)
            else:
                self.step(item)
        (self.out / "summary.json").write_text(json.dumps(self.summary, indent=1) + "\n", encoding="utf-8")
        return 0 if all(row["rc"] == 0 for row in self.summary) else 1

    def record(self, step: Step, rc: int | None, seconds: float, note: str = "") -> None:
        row = {"name": step.name, "argv": list(step.argv), "rc": rc, "seconds": round(seconds, 1), "stdout": step.stdout}
        if note:
            row["note"] = note
        self.summary.append(row)
        self.log(f"{step.name}: exit {rc} after {seconds:.1f} s {note}")
        if rc == 0 and step.argv[:len(LOADTEST)] == LOADTEST and step.stdout:
            self._digest(self.out / step.stdout)
        if self.after_step is not None:
            self.after_step(row)

    def step(self, step: Step, server_pid: int | None = None) -> None:
        argv = [a.replace("{server_pid}", str(server_pid)).replace("{out}", str(self.out)) for a in step.argv]
        self.log(f"{step.name}: {shlex.join(argv)}")
        stdout_path = self.out / (step.stdout or f"{step.name}.stdout")
        err_path = self.out / f"{step.name}.log"
        t0 = time.monotonic()
        with open(stdout_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=err, env={**self.env, **step.env})
            samplers = self._samplers(step, proc, err_path, server_pid)
            try:
                rc = proc.wait(timeout=step.timeout_s)
                note = ""
            except subprocess.TimeoutExpired:
                proc.kill()
                rc, note = proc.wait(), f"killed after its {step.timeout_s:g} s limit"
        for sampler in samplers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                sampler.wait(timeout=60)
        self.record(step, rc, time.monotonic() - t0, note)
        self._summarise_pyspy(step)

    def _digest(self, report: Path) -> None:
        """A load test's one-line digest (:func:`tools.loadtest.digest`) in the log, beside its exit."""
        from tools.loadtest import digest

        with contextlib.suppress(OSError, ValueError):
            self.log(f"  {digest(json.loads(report.read_text(encoding='utf-8')))}")

    def _samplers(self, step: Step, proc: subprocess.Popen, err_path: Path, server_pid: int | None) -> list:
        """Start the step's window samplers once its stderr shows the window's start (or never, if it ends first)."""
        if not step.window_samplers:
            return []
        while proc.poll() is None and WINDOW_MARKER not in err_path.read_text(encoding="utf-8", errors="replace"):
            time.sleep(0.2)
        if proc.poll() is not None:
            return []
        started = []
        for sampler in step.window_samplers:
            argv = [a.replace("{server_pid}", str(server_pid)) for a in sampler.argv]
            stdout = open(self.out / (sampler.stdout or f"{sampler.name}.stdout"), "wb")  # noqa: SIM115
            with stdout:
                try:
                    started.append(subprocess.Popen(argv, cwd=self.out if sampler.argv[0] == "py-spy" else ROOT,
                                                    stdout=stdout, stderr=subprocess.STDOUT, env=self.env))
                except FileNotFoundError as exc:  # py-spy not installed
                    self.log(f"{sampler.name}: not run ({exc})")
        return started

    def _summarise_pyspy(self, step: Step) -> None:
        for sampler in step.window_samplers:
            raw = self.out / f"{sampler.name}.raw"
            if sampler.argv[0] == "py-spy" and raw.exists():
                with open(self.out / f"{sampler.name}.txt", "wb") as out:
                    subprocess.run([*PYSPY_TOP, str(raw), "--rate", "250", "--top", "30"], cwd=ROOT, stdout=out,
                                   env=self.env, check=False)

    @contextlib.contextmanager
    def server(self, server: Server) -> Iterator[int | None]:
        """Start the server, wait for ``/readyz`` (its readiness, not a time), yield its pid (None if it never got
        ready), then stop it."""
        self.log(f"server {server.name}: {shlex.join(server.argv)}")
        Path(server.argv[server.argv.index("--objects") + 1]).mkdir(parents=True, exist_ok=True)
        log = open(self.out / f"server_{server.name}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(server.argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        t0 = time.monotonic()
        try:
            ready = self._wait_ready(proc, server.url, server.ready_timeout_s)
            self.summary.append({"name": f"server_{server.name}", "argv": list(server.argv), "rc": 0 if ready else 1,
                                 "seconds": round(time.monotonic() - t0, 1), "ready": ready})
            if self.after_step is not None:
                self.after_step(self.summary[-1])
            self.log(f"server {server.name}: {'ready' if ready else 'NOT ready'} after {time.monotonic() - t0:.1f} s")
            yield proc.pid if ready else None
        finally:
            proc.send_signal(signal.SIGINT)  # the server drains and exits 0
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()

    @staticmethod
    def _wait_ready(proc: subprocess.Popen, url: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(url + "/readyz", timeout=2) as answer:
                    if answer.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        return False


def install_wheels(wheels: Path, site: Path) -> None:
    subprocess.run([PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
                    "--upgrade", "--target", str(site), *map(str, sorted(wheels.glob("*.whl")))], check=True)


def command_env(site: Path | None) -> dict[str, str]:
    """The environment of every command: this checkout first on the path (with ``site`` before it), unbuffered
    output and UTF-8 text whatever the machine's locale."""
    env = dict(os.environ)
    paths = [str(site)] if site else []
    env["PYTHONPATH"] = os.pathsep.join([*paths, str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    if site:
        env["PATH"] = os.pathsep.join([str(site / "bin"), env.get("PATH", "")])
    env.update(PYTHONUNBUFFERED="1", PYTHONIOENCODING="utf-8", LANG="C.UTF-8")
    return env


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python tools/gpu_run.py", description=__doc__.split("\n\n")[0])
    p.add_argument("variant", choices=VARIANTS)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_run_out")),
                   help="results folder; the variant writes OUT/<variant>/ (default $OUT, else gpu_run_out)")
    p.add_argument("--dry-run", action="store_true", help="print the commands as JSON, run nothing")
    p.add_argument("--smoke", action="store_true", help="bench, edge: on the CPU, tiny settings, short windows")
    p.add_argument("--wheels", type=Path, default=None, help="install these wheels first (no index, no dependencies)")
    p.add_argument("--bench-args", default="", help="options appended to every bench command (bench, startup)")
    p.add_argument("--server-args", default="", help="options appended to the server command (edge)")
    p.add_argument("--ingest-workers", type=int, default=8, help="edge: the second layout's ingest workers, on the "
                   "server's port like the no-flag layout's (0: the no-flag layout only; default %(default)s)")
    p.add_argument("--profile", action="store_true", help="edge: py-spy records the server in each 64-client window")
    p.add_argument("--mesh", default=BUNDLED_MESH, help="train: the object's mesh (default: the bundled object)")
    p.add_argument("--data", default=None, help="train: a sequence with ground truth for the evaluation and the demo "
                   "(default: the bundled one; tools/make_demo_sequence.py --shape tee makes a second object's)")
    p.add_argument("--minutes", type=float, default=None,
                   help=f"training minutes (default {TRAIN_MINUTES} for train, {RECORD_TRAIN_MINUTES} for record "
                   f"--part accuracy and {SUITE_TRAIN_MINUTES} per object for the suite parts, whose commands must "
                   "fit one 10-minute call)")
    p.add_argument("--views", type=int, default=100, help="train: held-out views evaluated (default %(default)s)")
    p.add_argument("--train-args", default="", help="train: options appended to python -m foundationpose.train")
    p.add_argument("--phase", choices=("all", "train", "post"), default="all",
                   help="train: everything, the training only, or what follows it (evaluation, demo, export) on "
                   "weights an earlier --phase train left in --work (default all)")
    p.add_argument("--part", choices=RECORD_PARTS, default=None, help="record: which part to measure (one call each)")
    p.add_argument("--record", type=Path, default=None, help="record: the record folder (default "
                   "benchmarks/records/<date>-<gpu>; parts measured under the same defaults on the same GPU merge)")
    p.add_argument("--weights-cache", type=Path, default=None,
                   help="record --part suite-*: the objects' trained weights, reused when finished and resumed when "
                   "interrupted (default: a temporary folder); with weights trained beforehand by python -m "
                   "foundationpose.evaluate suite --train-only and the same --minutes, the part only evaluates")
    p.add_argument("--work", default=None, help="train: folder of the weights and evaluation outputs (default: a "
                   "temporary one; give one to split --phase train / post)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.ingest_workers < 0:
        parser.error(f"--ingest-workers must be >= 0, got {args.ingest_workers}")
    if args.phase == "post" and not args.work:
        parser.error("--phase post needs --work: the folder an earlier --phase train wrote")
    if (args.variant == "record") != (args.part is not None):
        parser.error("--part goes with the record variant, and the record variant needs --part "
                     f"({' | '.join(RECORD_PARTS)}: one call each)")
    if args.minutes is None:
        args.minutes = (TRAIN_MINUTES if args.variant != "record" else
                        SUITE_TRAIN_MINUTES if args.part.startswith("suite-") else RECORD_TRAIN_MINUTES)
    elif args.minutes <= 0:
        parser.error(f"--minutes must be > 0, got {args.minutes}")
    if not (args.dry_run or args.smoke) and (why := missing_cuda()):
        print(f"gpu_run: {args.variant} measures the GPU path, and {why}; nothing was run. Run it on a CUDA "
              "machine (--smoke checks bench and edge on the CPU, --dry-run prints the commands).", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="gpu_run_") as scratch:
        plan = build_plan(args, Path(scratch))
        if args.dry_run:
            print(json.dumps({"variant": args.variant, "plan": plan_as_json(plan)}, indent=1))
            return 0
        out = (args.out / args.variant).resolve()
        out.mkdir(parents=True, exist_ok=True)
        site = None
        if args.wheels is not None:
            site = Path(scratch) / "site"
            install_wheels(args.wheels, site)
        env = command_env(site)
        if any(isinstance(item, Server) for item in plan) and (missing := missing_server_packages(env)):
            print(f"gpu_run: {args.variant} starts python -m server, and the package {missing} is missing from the "
                  "environment its commands run in; nothing was run. Install the server extra (pip install "
                  "'foundationpose-deploy[server]'), or give its wheels with --wheels DIR.", file=sys.stderr)
            return 2
        if args.variant == "record":
            return run_record_part(args, plan, out, Path(scratch), env)
        runner = Runner(out, env)
        rc = runner.run(plan)
        if args.variant == "train" and args.phase != "train":
            write_train_results(Path(args.work) if args.work else Path(scratch) / "train", out)
    return rc


def missing_server_packages(env: dict[str, str]) -> str | None:
    """What the server's commands would miss of the server extra, checked in their environment (``env``: their
    ``PYTHONPATH``, wheels included) by :func:`server.cli.missing_server_packages`; None when nothing is missing."""
    probe = ("import sys\nfrom server.cli import missing_server_packages\nmissing = missing_server_packages()\n"
             "print(missing or '')\nsys.exit(1 if missing else 0)")
    done = subprocess.run([PY, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    if done.returncode == 0:
        return None
    return done.stdout.strip() or f"(the check failed: {done.stderr.strip()[-300:]})"


def missing_cuda() -> str | None:
    """Why this machine cannot run the GPU measurements (None when it can)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"this machine has no CUDA device (torch {torch.__version__})"
    return None


def current_commit() -> str:
    """``FP_RECORD_COMMIT`` when set (a copy of a checkout whose ``.git`` is not its own), else this checkout's
    commit (``git rev-parse HEAD``, with ``-dirty`` for uncommitted changes to tracked files), else ""."""
    if os.environ.get("FP_RECORD_COMMIT"):
        return os.environ["FP_RECORD_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True,
                              timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True, timeout=30).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return ""


def run_record_part(args: argparse.Namespace, plan: Plan, out: Path, scratch: Path, env: dict[str, str]) -> int:
    """Run one part of a record and add it to the record folder: each command's JSON report (pytest's as
    counts and failures), its exit status and time, and the last lines of its log when it failed."""
    from tools import records

    machine, _ = records.machine_and_versions()
    record = (args.record or records.RECORDS_DIR / records.record_id(machine["gpu"], time.strftime("%Y-%m-%d")))
    record = record.resolve()
    try:
        summary = records.start_part(record, args.part, current_commit())
    except records.RecordError as exc:
        print(f"gpu_run: {exc}", file=sys.stderr)
        return 2
    commands = summary["parts"][args.part]["commands"]
    record.mkdir(parents=True, exist_ok=True)

    def add(row: dict) -> None:  # after each command: a part cut short still leaves a whole summary
        entry = {"name": row["name"], "rc": row["rc"], "seconds": row["seconds"]}
        if row.get("note"):
            entry["note"] = row["note"]
        report = _record_report(row["name"], out, scratch)
        if "ready" in row:  # a server: when /readyz first answered ready
            report = {"ready": row["ready"], "ready_after_s": row["seconds"], "command": row["argv"][1:]}
        if report is not None:
            file = f"{row['name']}.json"
            (record / file).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
            entry["file"] = file
        if row["rc"] != 0 and (out / f"{row['name']}.log").exists():
            lines = (out / f"{row['name']}.log").read_text(encoding="utf-8", errors="replace").splitlines()
            entry["log_tail"] = lines[-30:]
        commands.append(entry)
        records.write_summary(record, summary)

    rc = Runner(out, env, after_step=add).run(plan)
    print(json.dumps({"record": str(record), "part": args.part, "commands": commands}, indent=1))
    return rc


def _record_report(name: str, out: Path, scratch: Path) -> dict | list | None:
    """The JSON report of one command of a record part (None when it wrote none that parses)."""
    summaries = sorted((scratch / "train" / "weights").glob("**/train_summary.json"))
    candidates = {"cold": out / "cold.json", "warm": out / "warm.json",
                  "evaluate": scratch / "train" / "eval" / "eval.json",
                  "train": summaries[0] if summaries else out / "train.json"}
    if (out / f"{name}.xml").exists():  # pytest's junit file
        from tools import records

        return records.junit_report(out / f"{name}.xml")
    path = candidates.get(name, out / f"{name}.json")
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if name == "demo":
        poses = sorted((scratch / "train" / "demo" / "ob_in_cam").glob("*.txt"))
        report = {**report, "ob_in_cam": {p.stem: [[float(v) for v in line.split()] for line in
                                                   p.read_text(encoding="utf-8").splitlines() if line.strip()]
                                          for p in poses}}
    return report


def write_train_results(work: Path, out: Path) -> None:
    """``results.json``: the figures the training section of docs/benchmarks.md quotes, from the evaluation's and
    the demo's reports (None where a report lacks one), and the trained loss curve next to it."""
    def load(path: Path) -> dict:
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}

    ev, demo = load(work / "eval" / "eval.json"), load(work / "demo" / "summary.json")
    seq, views = ev.get("sequence", {}), ev.get("views", {})
    diameter = (ev.get("object") or {}).get("diameter_m")
    first_add = (seq.get("register") or {}).get("add_m")
    figures = {
        "register_first_frame_add_diameters": first_add / diameter if first_add is not None and diameter else None,
        "views_register_success_rate": views.get("register_success_rate"),
        "views_oracle_success_rate": (views.get("candidates") or {}).get("oracle_success_rate"),
        "track_mean_adds_mm": 1000 * seq["adds_m"]["mean"] if "mean" in (seq.get("adds_m") or {}) else None,
        "track_worst_add_diameters": seq.get("worst_add_diameters"),
    }
    summaries = sorted(work.glob("weights/**/train_summary.json"))
    result = {"figures": figures, "train_summary": load(summaries[0]) if summaries else None,
              "demo": {k: demo.get(k) for k in ("frames", "fps", "metrics")} if demo else None}
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    for curve in work.glob("weights/**/loss_curve.png"):
        (out / "loss_curve.png").write_bytes(curve.read_bytes())


if __name__ == "__main__":
    sys.exit(main())
