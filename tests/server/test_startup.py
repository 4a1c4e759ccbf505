"""Start-up and shutdown: the warm-up's own deadline, retrying a failed start-up, a prompt SIGTERM,
an instant ``--help`` and a clear message when the server extra is missing (issue 12, items 13-15)."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from server import create_app
from server.cli import config_from_args
from server.config import CPU_DEFAULTS
from server.warmup import APP_PATHS
from tests.server._helpers import READY_TIMEOUT_S, assert_error, tiny_config, write_objects_dir

ROOT = Path(__file__).resolve().parents[2]


def _python(*args: str, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=120, **kwargs)


@pytest.mark.slow
def test_warm_up_does_not_use_the_request_timeout(tiny_estimator, tmp_path):
    # before: the warm-up waited request_timeout_s for its register, so a short request timeout failed start-up
    config = tiny_config(write_objects_dir(tmp_path / "objects"), request_timeout_s=0.001)
    app = create_app(config, estimator=tiny_estimator)
    with TestClient(app) as c:
        assert app.state.fp.wait_ready(READY_TIMEOUT_S), app.state.fp.failure
        body = c.get("/readyz").json()
        assert body["ready"] is True and body["warmup_ms"] > 0
        assert body["settings"] == {"hypotheses": 4, "register_iterations": 1, "track_iterations": 1}


@pytest.mark.slow
def test_a_warm_up_past_its_deadline_fails_and_is_retried_without_resubmitting(tiny_estimator, tmp_path):
    config = tiny_config(write_objects_dir(tmp_path / "objects"), warmup_timeout_s=1e-6)
    app = create_app(config, estimator=tiny_estimator)
    state = app.state.fp
    with TestClient(app) as c:
        assert state.wait_ready(READY_TIMEOUT_S) is False
        body = c.get("/readyz").json()
        assert body["phase"] == "failed" and "warm-up did not finish within 1e-06 s" in body["reason"]
        assert "POST /readyz/retry" in body["reason"]
        register = state._warmup_pending[0]
        register.result(READY_TIMEOUT_S)  # the register goes on; wait for it, not for time
        registers_before = state.service.stats().register.submitted
        retried = c.post("/readyz/retry")
        assert retried.status_code == 202 and retried.json()["phase"] == "starting"
        assert state.wait_ready(READY_TIMEOUT_S) is False  # the track step, again past the tiny deadline
        assert "warm-up did not finish" in state.failure
        state._warmup_pending[1].result(READY_TIMEOUT_S)
        # the steps after the pipeline's (the objects', the request paths') do their work inside the attempt, so
        # no attempt of 1e-6 s can finish them: lift the deadline (0: none) for the last retry
        state.config = dataclasses.replace(state.config, warmup_timeout_s=0.0)
        assert c.post("/readyz/retry").status_code == 202
        assert state.wait_ready(READY_TIMEOUT_S), state.failure
        # the pipeline step's register is never submitted twice; the request paths' registers (PNG, binary) are new
        request_registers = sum(1 for path in APP_PATHS if path.startswith("register"))
        assert state.service.stats().register.submitted == registers_before + request_registers
        assert c.get("/readyz").status_code == 200
        assert_error(c.post("/readyz/retry"), 409, "ConflictError", match=r"^nothing to retry: the server is ready")


def test_a_failed_start_up_can_be_retried_once_the_cause_is_fixed(tiny_estimator, tmp_path):
    objects = tmp_path / "objects"
    objects.write_text("a file where the objects directory should be")
    app = create_app(tiny_config(objects, warmup=False), estimator=tiny_estimator)
    with TestClient(app) as c:
        assert app.state.fp.wait_ready(READY_TIMEOUT_S) is False
        assert "FileExistsError" in c.get("/readyz").json()["reason"]
        objects.unlink()
        write_objects_dir(objects)
        assert c.post("/readyz/retry").status_code == 202
        assert app.state.fp.wait_ready(READY_TIMEOUT_S), app.state.fp.failure
        assert c.get("/objects").status_code == 200


def test_cpu_defaults_to_a_small_config_and_says_so(tmp_path):
    config, _ = config_from_args(["--objects", str(tmp_path), "--device", "cpu"], {})
    assert config.estimator.num_hypotheses == CPU_DEFAULTS["num_hypotheses"]
    assert config.estimator.register_iterations == CPU_DEFAULTS["register_iterations"]
    assert config.settings_note.startswith("CPU: small default config (hypotheses 16, register iterations 2)")
    full, _ = config_from_args(["--objects", str(tmp_path), "--device", "cpu", "--hypotheses", "252",
                                "--register-iterations", "5"], {})
    assert (full.estimator.num_hypotheses, full.estimator.register_iterations, full.settings_note) == (252, 5, None)
    (tmp_path / "fp.toml").write_text("max_mesh_faces = 1000\nmax_texture_side = 512\nwarmup_timeout_s = 0\n")
    limits, _ = config_from_args(["--objects", str(tmp_path), "--config", str(tmp_path / "fp.toml")], {})
    assert limits.object_limits.max_faces == 1000 and limits.object_limits.max_texture_side == 512
    assert limits.warmup_timeout_s == 0


@pytest.mark.parametrize(("flag", "listed"), [("--help", "FP_REQUEST_TIMEOUT_S")])
def test_help_is_answered_without_importing_torch_or_fastapi(flag, listed):
    probe = (f"import runpy, sys\nsys.argv = ['server', '{flag}']\n"
             "try:\n    runpy.run_module('server', run_name='__main__')\nexcept SystemExit:\n    pass\n"
             "print('heavy:', sorted(m for m in ('torch', 'fastapi', 'trimesh') if m in sys.modules))")
    done = _python("-c", probe)
    assert listed in done.stdout
    assert done.stdout.rstrip().endswith("heavy: []"), done.stdout[-300:] + done.stderr[-2000:]


def test_a_missing_server_extra_is_named_with_the_install_command(tmp_path):
    probe = ("import sys\nsys.modules['fastapi'] = None  # as if not installed\n"
             f"from server.cli import main\nsys.exit(main(['--objects', {str(tmp_path)!r}]))")
    done = _python("-c", probe)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "the package 'fastapi' is missing" in done.stderr
    assert "install the server extra: pip install 'foundationpose-deploy[server]'" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_missing_dependency_of_the_server_extra_is_named_with_the_package_that_needs_it(monkeypatch):
    import importlib

    from server import cli

    real = importlib.import_module

    def without_a_dependency(name, *args, **kwargs):
        if name == "fastapi":  # installed, but a package it imports is not
            raise ModuleNotFoundError("No module named 'opentelemetry.trace'", name="opentelemetry.trace")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", without_a_dependency)
    assert cli.missing_server_packages() == "'opentelemetry' (needed by 'fastapi')"
    monkeypatch.setattr(importlib, "import_module", real)
    assert cli.missing_server_packages() is None


@pytest.mark.slow
def test_sigterm_during_the_warm_up_exits_promptly_and_cleanly(tmp_path):
    # The full 252-hypothesis warm-up takes minutes on a CPU; SIGTERM arrives while it computes.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    (tmp_path / "fp.toml").write_text("shutdown_timeout_s = 2\n")
    cmd = [sys.executable, "-m", "server", "--objects", str(tmp_path / "objects"), "--device", "cpu", "--port", str(port),
           "--hypotheses", "252", "--register-iterations", "5", "--config", str(tmp_path / "fp.toml")]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        for line in proc.stdout:  # wait for the state "networks and objects loaded, warm-up running"
            lines.append(line)
            if "loaded 0 objects from" in line:
                break
        else:
            pytest.fail("the server ended before loading its objects:\n" + "".join(lines[-40:]))
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = "".join(lines) + rest
    assert proc.returncode == 0, log[-3000:]
    assert "Application shutdown failed" not in log, log[-3000:]
    assert took < 15, f"SIGTERM took {took:.1f} s:\n{log[-3000:]}"
    assert "stopped (was starting)" in log


class _Runner:
    def __init__(self, fail_on: str | None = None) -> None:
        self.prepared: list[tuple[str, int, tuple[int, int], int]] = []
        self.fail_on = fail_on

    def prepare(self, obj, n: int, hw: tuple[int, int], iterations: int) -> bool:  # noqa: ANN001
        if obj.name == self.fail_on:
            raise RuntimeError("CUDA error: out of memory (injected)")
        self.prepared.append((obj.name, n, hw, iterations))
        return True


class _Service:
    def __init__(self) -> None:
        self.prepared: list[tuple[str, tuple[int, int]]] = []
        self.replayed: list[tuple[str, tuple[int, int], int]] = []

    def prepare_track(self, obj, hw: tuple[int, int]) -> int:  # noqa: ANN001
        self.prepared.append((_name(obj), hw))
        return 10

    def time_track_steps(self, obj, hw: tuple[int, int], *, repeats: int) -> dict:  # noqa: ANN001
        self.replayed.append((_name(obj), hw, repeats))
        return {}


def _name(obj) -> str | tuple[str, ...]:  # noqa: ANN001
    """An object's name, or a group's names (a sequence of objects)."""
    return obj.name if hasattr(obj, "name") else tuple(o.name for o in obj)


def _warming_state(tmp_path: Path, device: str, runner: _Runner, service: _Service):  # noqa: ANN202
    from types import SimpleNamespace

    from server.state import ServerState

    config = tiny_config(tmp_path, max_image_hw=(480, 640), num_hypotheses=42, register_iterations=3)
    estimator = SimpleNamespace(device=SimpleNamespace(type=device), register_runner=runner,
                                rotation_grid=lambda: range(252))
    state = ServerState(config, estimator=estimator, service=service)
    entries = [SimpleNamespace(object_id=name, model=SimpleNamespace(name=name)) for name in ("mug", "drill")]
    state.objects = SimpleNamespace(entries=lambda: entries, __len__=lambda: 2)
    return state


def test_ready_means_every_loaded_object_is_warm_at_the_largest_image_size(tmp_path: Path) -> None:
    runner, service = _Runner(), _Service()
    _warming_state(tmp_path, "cuda", runner, service)._warm_objects()
    assert runner.prepared == [("mug", 42, (480, 640), 3), ("drill", 42, (480, 640), 3)]
    # each object's track steps, then the group of both (any batch mixing them replays its steps)
    assert service.prepared == [("mug", (480, 640)), ("drill", (480, 640)), (("mug", "drill"), (480, 640))]
    assert service.replayed == [("mug", (480, 640), 1), ("drill", (480, 640), 1),
                                (("mug", "drill"), (480, 640), 1)]  # each batch size launched once


def test_more_objects_than_a_group_holds_warm_the_first_ones_and_say_so(tmp_path: Path, monkeypatch,
                                                                        caplog) -> None:
    from server import state as state_module

    monkeypatch.setattr(state_module, "MAX_GROUP_OBJECTS", 2)
    runner, service = _Runner(), _Service()
    state = _warming_state(tmp_path, "cuda", runner, service)
    state.objects.entries().append(SimpleNamespace(object_id="can", model=SimpleNamespace(name="can")))
    with caplog.at_level(logging.WARNING, logger="server.state"):
        state._warm_group((480, 640), None)
    assert service.prepared == [(("mug", "drill"), (480, 640))]
    assert any("3 objects loaded, a track group holds at most 2" in r.getMessage() for r in caplog.records)


def test_nothing_is_captured_ahead_on_a_cpu(tmp_path: Path) -> None:
    runner, service = _Runner(), _Service()
    _warming_state(tmp_path, "cpu", runner, service)._warm_objects()
    assert runner.prepared == [] and service.prepared == []


def test_an_object_that_fails_to_warm_fails_the_start_up_naming_it(tmp_path: Path) -> None:
    runner, service = _Runner(fail_on="drill"), _Service()
    state = _warming_state(tmp_path, "cuda", runner, service)
    with pytest.raises(RuntimeError, match=r"^warming object 'drill' at 640x480 failed: RuntimeError: CUDA error"):
        state._warm_objects()
    assert service.prepared == [("mug", (480, 640))]
