"""``tools/proc_cpu.py``: CPU per process and per thread of a process tree over a window, the busiest thread named.

Behaviour only: which thread ranks first and under which name, who is counted where. No bound on how much CPU a
thread got, since a busy machine gives a spinning thread anything from a sliver to a whole core; each check samples
again until the spinner has been scheduled in a window (a state), never for a set time.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("fp_proc_cpu", ROOT / "tools" / "proc_cpu.py")
proc_cpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(proc_cpu)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="proc_cpu reads /proc (Linux only)")

WINDOW_S = 0.3
MAX_WINDOWS = 50  # a spinner that got no CPU in 50 windows in a row is a broken machine, not a busy one

SPINNER = (
    "import threading, time\n"
    "from deploy_core.thread_names import name_native_thread\n"
    "def spin():\n"
    "    name_native_thread('fp-spinner')\n"
    "    print('spinning', flush=True)\n"
    "    while True: pass\n"
    "threading.Thread(target=spin, daemon=True).start()\n"
    "time.sleep(600)\n"
)


@contextlib.contextmanager
def _spawned(*argv: str, ready_line: str | None = None) -> Iterator[subprocess.Popen]:
    """A child process, killed with every descendant it started at the end; waits for its ``ready_line``."""
    child = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        if ready_line is not None:
            assert child.stdout.readline().strip() == ready_line
        yield child
    finally:
        for pid in _descendants(child.pid) + [child.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        child.wait()


def _descendants(pid: int) -> list[int]:
    parents = {}
    for task in Path("/proc").iterdir():
        if task.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (task / "stat").read_text()
                parents[int(task.name)] = int(stat[stat.rfind(")") + 2:].split()[1])
    out, frontier = [], [pid]
    while frontier:
        frontier = [p for p, parent in parents.items() if parent in frontier]
        out += frontier
    return out


def _sample_until(capsys, argv: list[str], scheduled: Callable[[dict], bool]) -> dict:
    """Run the tool's ``main`` on successive windows until ``scheduled(report)`` holds; the last report."""
    for _ in range(MAX_WINDOWS):
        assert proc_cpu.main(argv) == 0
        out = capsys.readouterr().out
        report = json.loads(out[out.index("{"):])
        if scheduled(report):
            return report
    pytest.fail(f"the spinning process got no CPU in {MAX_WINDOWS} windows: {report}")


def test_the_busy_thread_is_named_and_ranked_first(capsys) -> None:
    with _spawned("-c", SPINNER, ready_line="spinning") as child:
        argv = ["--pid", str(child.pid), "--duration-s", str(WINDOW_S)]
        report = _sample_until(capsys, argv, lambda r: (r["processes"][0]["cpu"] or 0) > 0)
    assert report["cores"] == os.cpu_count() and 0 <= report["machine_busy"] <= 1
    (proc,) = report["processes"]  # the child has no children: its tree is itself
    assert proc["pid"] == child.pid
    top, *rest = proc["threads"]
    assert top["name"] == "fp-spinner", proc["threads"]  # its OS name (deploy_core.thread_names), ranked first
    assert top["cpu"] > 0 and all(t["cpu"] <= top["cpu"] for t in rest), proc["threads"]
    assert [t["cpu"] for t in proc["threads"]] == sorted((t["cpu"] for t in proc["threads"]), reverse=True)
    assert report["tree_cpu"] == pytest.approx(proc["cpu"], abs=1e-3)


def test_a_missing_process_exits_1(capsys) -> None:
    with _spawned("-c", "pass") as child:
        child.wait()
    assert proc_cpu.main(["--pid", str(child.pid), "--duration-s", "0.1"]) == 1
    assert f"no process {child.pid}" in capsys.readouterr().err


def test_also_sums_matched_processes_with_their_children_apart_from_the_tree(capsys) -> None:
    marker = f"fp-proc-cpu-test-{os.getpid()}"
    parent_code = (
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'print(1, flush=True)\\nwhile True: pass'],"
        " stdout=subprocess.PIPE, text=True)\n"
        "child.stdout.readline(); print('child spinning', flush=True)\n"
        "child.wait()\n"
    )
    with _spawned("-c", parent_code, marker, ready_line="child spinning"), \
            _spawned("-c", "import time; time.sleep(600)") as sleeper:  # the --pid tree: not matched
        argv = ["--pid", str(sleeper.pid), "--duration-s", str(WINDOW_S), "--also", marker]
        also = _sample_until(capsys, argv, lambda r: r["also"]["cpu"] > 0)["also"]
        tree = json.loads(_last_json(capsys, ["--pid", str(sleeper.pid), "--duration-s", "0.05"]))
    # the matched parent (its command line holds the marker) and its spinning child (whose does not)
    assert also == {"patterns": [marker], "processes": 2, "cpu": also["cpu"]} and also["cpu"] > 0
    assert [p["pid"] for p in tree["processes"]] == [sleeper.pid]
    assert tree["also"] == {"patterns": [], "processes": 0, "cpu": 0}


def test_a_pattern_nothing_matches_counts_nothing(capsys) -> None:
    assert proc_cpu.main(["--pid", str(os.getpid()), "--duration-s", "0.05", "--also", "no-such-command-xyz"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{"):])["also"] == {"patterns": ["no-such-command-xyz"], "processes": 0, "cpu": 0}


def test_window_must_be_positive() -> None:
    with pytest.raises(SystemExit) as exc:
        proc_cpu.main(["--pid", "1", "--duration-s", "0"])
    assert exc.value.code == 2


def _last_json(capsys, argv: list[str]) -> str:
    assert proc_cpu.main(argv) == 0
    out = capsys.readouterr().out
    return out[out.index("{"):]
