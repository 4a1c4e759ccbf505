"""Every code block of the README runs as written, so the examples cannot rot.

Each block is preceded by ``<!-- readme-test: KIND -->``, which says how it is run:

* ``setup``: the install line is the one CI runs (``.ci/run``), and its demo command runs here;
* ``run``: a Python block, run as it is (the CPU configuration it shows);
* ``server``: starts the HTTP server; here on a free port instead of 8000, in a scratch folder;
* ``against-server``: bash or Python run against that live server (``127.0.0.1:8000`` becomes its address);
* ``train``: the training and evaluation commands, with the budgets cut to a few steps and views;
* ``dry-run``: a GPU command, printed by ``--dry-run`` (its plan must build).

A block without a marker fails the first test. The blocks are run from a scratch folder that links the package's
bundled data, so the README's relative paths work and nothing is written into the checkout.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.server._helpers import free_port

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
KINDS = ("setup", "run", "server", "against-server", "train", "dry-run")
SERVER_READY_S = 600  # a CPU server's start-up is about a minute here; far beyond means a hang
BLOCK_TIMEOUT_S = 900


@dataclass(frozen=True)
class Block:
    kind: str
    language: str
    code: str
    line: int


def readme_blocks() -> list[Block]:
    """The README's fenced code blocks with their test markers (KeyError-free: a missing marker is kind None)."""
    text = README.read_text(encoding="utf-8")
    blocks = []
    for match in re.finditer(r"(?:<!-- readme-test: ([a-z-]+) -->\n)?```(\w+)\n(.*?)```", text, re.S):
        blocks.append(Block(match.group(1), match.group(2), match.group(3), text[: match.start()].count("\n") + 1))
    return blocks


BLOCKS = readme_blocks()


def _blocks(kind: str) -> list[Block]:
    return [b for b in BLOCKS if b.kind == kind]


def test_every_block_says_how_it_is_tested_and_the_readme_is_short() -> None:
    assert BLOCKS, "no code blocks found in README.md"
    unmarked = [b.line for b in BLOCKS if b.kind not in KINDS]
    assert not unmarked, f"README code blocks without a readme-test marker at lines {unmarked}"
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 400


def test_the_setup_line_is_what_ci_runs() -> None:
    (setup,) = _blocks("setup")
    install, tests = setup.code.strip().splitlines()
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert install.startswith('pip install torch==2.13.0 && pip install -e ".[dev]" && python -m foundationpose.demo')
    assert "pip install -q torch==2.13.0" in ci and 'pip install -q -e ".[dev]"' in ci
    assert tests == "python -m pytest -q" and "python3 -m pytest -q" in ci


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """A folder where the README's relative paths resolve (``foundationpose/data/...``) without touching ROOT."""
    folder = tmp_path_factory.mktemp("readme")
    (folder / "foundationpose").mkdir()
    (folder / "foundationpose" / "data").symlink_to(ROOT / "foundationpose" / "data")
    return folder


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def _run(block: Block, cwd: Path, *, replace: dict[str, str] | None = None) -> str:
    code = block.code
    for old, new in (replace or {}).items():
        assert old in code, f"README line {block.line}: expected {old!r} in the block"
        code = code.replace(old, new)
    argv = [sys.executable, "-c", code] if block.language == "python" else ["bash", "-euo", "pipefail", "-c", code]
    done = subprocess.run(argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    assert done.returncode == 0, f"README line {block.line} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.slow
def test_the_setup_demo_command_runs(scratch: Path) -> None:
    (setup,) = _blocks("setup")
    demo = setup.code.splitlines()[0].split("&& ")[-1]
    assert demo.startswith("python -m foundationpose.demo")
    _run(Block("setup", "bash", demo.replace("python ", f"{sys.executable} ", 1), setup.line), scratch)
    summary = json.loads((scratch / "demo_out" / "summary.json").read_text())
    assert summary["frames"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("block", _blocks("run"), ids=lambda b: f"line{b.line}")
def test_python_blocks_run_as_written(block: Block, scratch: Path) -> None:
    out = _run(block, scratch)
    assert out.strip(), f"README line {block.line} printed nothing"


@pytest.fixture(scope="module")
def server(scratch: Path):
    """The README's server block, on a free port; yields its URL (``http://127.0.0.1:PORT``)."""
    (block,) = _blocks("server")
    prepare, start = block.code.strip().splitlines()
    _run(Block("server", "bash", prepare, block.line), scratch)
    port = free_port(consecutive=2)
    argv = [sys.executable, *start.split()[1:], "--port", str(port)]
    log = (scratch / "server.log").open("w")
    proc = subprocess.Popen(argv, cwd=scratch, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_READY_S
        while True:
            assert proc.poll() is None, (scratch / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(url + "/readyz", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, (scratch / "server.log").read_text()[-3000:]
            time.sleep(1.0)  # polling a readiness endpoint: the answer, not the sleep, decides
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()


@pytest.mark.slow
@pytest.mark.parametrize("block", _blocks("against-server"), ids=lambda b: f"line{b.line}")
def test_blocks_against_a_live_server(block: Block, server: str, scratch: Path) -> None:
    port = server.rsplit(":", 1)[1]
    out = _run(block, scratch, replace={"127.0.0.1:8000": f"127.0.0.1:{port}"})
    assert out.strip(), f"README line {block.line} printed nothing"


@pytest.mark.slow
def test_the_training_commands_run_with_tiny_budgets(scratch: Path) -> None:
    (block,) = _blocks("train")
    _run(block, scratch, replace={
        "--minutes 8": "--steps 2 --batch 8 --scorer-sets 2 --set-size 4 --frame-size 96 96 --no-progress --device cpu",
        "--weights my_weights": "--weights my_weights --views 1 --max-frames 2 --hypotheses 6 --register-iterations 1 "
                                "--track-iterations 1 --overlays 0 --no-progress --device cpu",
    })
    report = json.loads((scratch / "eval_out" / "eval.json").read_text(encoding="utf-8"))
    assert report["weights"].endswith("my_weights") and report["random_weights"] is False


def test_gpu_commands_build_their_plans(scratch: Path) -> None:
    for block in _blocks("dry-run"):
        for line in block.code.strip().splitlines():
            argv = [sys.executable, *line.split()[1:], "--dry-run"]
            argv[1] = str(ROOT / argv[1])
            done = subprocess.run(argv, cwd=scratch, env=_env(), capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, f"README line {block.line}: {done.stderr[-2000:]}"
            assert json.loads(done.stdout), line
