"""tools/pyspy_top.py: the summary of a py-spy recording (tools/gpu_run.py edge --profile prints one per load window)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "tools" / "pyspy_top.py"
_spec = importlib.util.spec_from_file_location("fp_pyspy_top", _PATH)
pyspy_top = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pyspy_top)

RAW = """\
thread (0x1): fp-step;_bootstrap (threading.py:1030);run (threading.py:1010);_stage (track_graph.py:496) 30
thread (0x2): Thread-7 (session);_bootstrap (threading.py:1030);session (e2e.py:95);validate_depth (validate.py:148) 10
thread (0x3): Thread-8 (session);_bootstrap (threading.py:1030);session (e2e.py:95);validate_depth (validate.py:148) 10
thread (0x4): MainThread;<module> (bench.py:7);compile (dynamo.py:1) 50
not a stack line
"""


def test_threads_of_one_name_are_summed_and_shares_are_of_all_samples():
    text = pyspy_top.summarise(RAW.splitlines(), rate_hz=100, workers_only=False, top=3)
    lines = text.splitlines()
    assert lines[0] == "100 samples (1.0 s of samples at 100 Hz)"
    assert lines[1:4] == ["== by thread name", " 50.00%     0.50 s  MainThread", " 30.00%     0.30 s  fp-step"]
    assert " 10.00%     0.10 s  Thread-7 (session)" in lines  # ids differ, names differ: two lines
    self_part = lines[lines.index("== self") + 1:lines.index("== total")]
    assert self_part == [" 50.00%  compile (dynamo.py:1)", " 30.00%  _stage (track_graph.py:496)",
                         " 20.00%  validate_depth (validate.py:148)"]


def test_workers_only_drops_the_main_thread():
    text = pyspy_top.summarise(RAW.splitlines(), rate_hz=100, workers_only=True, top=2)
    assert text.splitlines()[0] == "50 samples (0.5 s of samples at 100 Hz; worker threads only)"
    assert "MainThread" not in text and " 60.00%     0.30 s  fp-step" in text
    total = text.splitlines()[text.splitlines().index("== total") + 1:]
    assert total[0] == "100.00%  _bootstrap (threading.py:1030)"


def test_a_missing_file_is_an_error(tmp_path, capsys):
    assert pyspy_top.main([str(tmp_path / "none.txt")]) == 1
    assert "no py-spy output" in capsys.readouterr().err
