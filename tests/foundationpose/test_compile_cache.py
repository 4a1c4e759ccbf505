"""foundationpose.compile_cache: a torch.compile cache file written by one process makes a fresh process (an empty
inductor cache directory: a new machine) find its compiled graph instead of compiling it again."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from foundationpose.compile_cache import load_compile_cache

_ROOT = Path(__file__).resolve().parents[2]

# one process: load the cache file (if any), compile a small function, save the file (if it was not loaded), report
_CHILD = """
import json, sys, torch
from torch._dynamo.utils import counters
from foundationpose.compile_cache import load_compile_cache, save_compile_cache
path = sys.argv[1]
cache = load_compile_cache(path)
f = torch.compile(lambda x: torch.sin(x) * 2.0 + x.cos())
y = f(torch.linspace(0, 1, 64))
saved = 0 if cache.loaded else save_compile_cache(path)
print(json.dumps({"loaded": cache.loaded, "reason": cache.reason, "artifacts": cache.artifacts, "saved": saved,
                  "hits": counters["inductor"]["fxgraph_cache_hit"], "misses": counters["inductor"]["fxgraph_cache_miss"],
                  "y": y.tolist()}))
"""


def _fresh_process(cache_file: Path, inductor_dir: Path) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir), "PYTHONPATH": str(_ROOT)}
    done = subprocess.run([sys.executable, "-c", _CHILD, str(cache_file)], capture_output=True, text=True, env=env,
                          timeout=300, cwd=_ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_fresh_process_with_the_file_finds_the_compiled_graph(tmp_path):
    cache_file = tmp_path / "compile.cache"
    first = _fresh_process(cache_file, tmp_path / "inductor_a")  # a cold machine: compiles, writes the file
    assert not first["loaded"] and first["reason"] == "no file yet"
    assert first["saved"] == cache_file.stat().st_size > 0
    assert first["misses"] >= 1 and first["hits"] == 0
    second = _fresh_process(cache_file, tmp_path / "inductor_b")  # another empty inductor dir: a new machine
    assert second["loaded"] and second["artifacts"].get("inductor", 0) >= 1 and second["saved"] == 0
    assert second["hits"] >= 1 and second["misses"] == 0  # found in the loaded cache, not compiled again
    assert second["y"] == first["y"]


def test_a_missing_empty_or_corrupted_file_is_reported_not_raised(tmp_path, caplog):
    assert load_compile_cache(tmp_path / "none.cache").reason == "no file yet"
    empty = tmp_path / "empty.cache"
    empty.write_bytes(b"")
    assert load_compile_cache(empty).reason == "empty file"
    bad = tmp_path / "bad.cache"
    bad.write_bytes(b"not a cache at all")
    with caplog.at_level(logging.WARNING, logger="foundationpose.compile_cache"):
        result = load_compile_cache(bad)
    assert not result.loaded and result.artifacts == {}
    assert any(str(bad) in r.getMessage() and "compiling from scratch" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_saving_with_nothing_compiled_writes_no_file(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import sys; from foundationpose.compile_cache import "
                           "save_compile_cache; print(save_compile_cache(sys.argv[1]))", str(tmp_path / "x.cache")],
                          capture_output=True, text=True, timeout=120, cwd=_ROOT,
                          env={**os.environ, "PYTHONPATH": str(_ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "0" and not (tmp_path / "x.cache").exists()
