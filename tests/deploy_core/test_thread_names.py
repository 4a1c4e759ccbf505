"""The OS names of the service's threads (deploy_core.thread_names): what top -H and tools/proc_cpu.py show."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

from deploy_core.pipeline import BaseAsyncPipeline, Stage
from deploy_core.thread_names import NATIVE_NAME_MAX, name_native_thread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OS thread names are read from /proc")


def _comm(tid: int) -> str:
    return Path(f"/proc/{os.getpid()}/task/{tid}/comm").read_text(encoding="utf-8").strip()


def _run_in_thread(fn, name: str) -> object:
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(fn()), name=name)
    thread.start()
    thread.join()
    return out[0]


def test_the_python_name_becomes_the_os_name_cut_to_fifteen_bytes() -> None:
    def named() -> tuple[bool, str]:
        return name_native_thread(), _comm(threading.get_native_id())

    assert _run_in_thread(named, "fp-a") == (True, "fp-a")
    ok, comm = _run_in_thread(named, "fp-refine_score-long")
    assert ok and comm == "fp-refine_score-long"[:NATIVE_NAME_MAX] == "fp-refine_score"


def test_an_explicit_name_wins_over_the_python_name() -> None:
    def named() -> str:
        name_native_thread("fp-other")
        return _comm(threading.get_native_id())

    assert _run_in_thread(named, "python-name") == "fp-other"


def test_pipeline_stage_threads_carry_their_stage_names() -> None:
    seen: dict[str, str] = {}

    def record(stage: str):
        def fn(x):
            seen[stage] = _comm(threading.get_native_id())
            return x
        return fn

    with BaseAsyncPipeline([Stage("decode", record("decode")), Stage("refine", record("refine"))], name="p") as p:
        assert p.submit(1).result(timeout=10) == 1
    assert seen == {"decode": "fp-decode", "refine": "fp-refine"}
