"""``tools/track_host_ceiling.py``: the in-process track lane with its step reduced to one copy (CPU, tiny)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "tools" / "track_host_ceiling.py"


def test_reports_frames_per_s_and_restores_the_step(capsys) -> None:
    from foundationpose.track_graph import TrackGraphRunner

    spec = importlib.util.spec_from_file_location("fp_track_host_ceiling", _PATH)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    step = TrackGraphRunner._step
    assert tool.main(["--device", "cpu", "--image", "80x60", "--sessions", "3", "--frames", "4"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out[out.index("{"):])
    assert report["frames"] == 12 and report["frames_per_s"] > 0 and report["host_us_per_frame"] > 0
    assert report["latency_p50_ms"] <= report["latency_p99_ms"]  # (a lone request into an idle lane runs inline: no batch)
    assert report["mean_batch"] is None or report["mean_batch"] >= 1
    assert TrackGraphRunner._step is step  # the reduced step stays inside the tool's run
