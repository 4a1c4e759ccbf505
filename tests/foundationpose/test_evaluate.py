"""python -m foundationpose.evaluate on the CPU: JSON report, overlays, held-out views, errors."""

from __future__ import annotations

import json

import cv2
import pytest

from foundationpose.evaluate.cli import main

TINY = ["--device", "cpu", "--renderer", "cpu", "--hypotheses", "2", "--register-iterations", "1",
        "--track-iterations", "1", "--no-progress"]


def test_evaluate_sequence_and_views(tmp_path, capsys) -> None:
    out = tmp_path / "ev"
    assert main(["--max-frames", "2", "--views", "2", "--overlays", "1", "--out", str(out), *TINY]) == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads((out / "eval.json").read_text(encoding="utf-8"))
    assert printed == saved
    assert saved["random_weights"] is True  # no --weights: random networks, the numbers are meaningless
    seq, views = saved["sequence"], saved["views"]
    assert seq["frames"] == 2 and [r["id"] for r in seq["per_frame"]] == ["000000", "000001"]
    assert seq["register"]["id"] == "000000"
    for key in ("add_m", "adds_m", "rot_deg", "trans_m"):
        assert seq[key]["max"] >= seq[key]["median"] >= 0 and views[key]["max"] >= 0
    assert set(seq["drift"]) == {"add_last_minus_first_m", "trans_last_minus_first_m", "add_slope_m_per_frame"}
    assert seq["success_threshold_m"] == pytest.approx(0.1 * saved["object"]["diameter_m"])
    assert views["frames"] == 2 and len(views["per_view"]) == 2 and 0.0 <= views["register_success_rate"] <= 1.0
    assert cv2.imread(str(out / "sequence" / "000001.png")).shape == (480, 640, 3)
    assert (out / "views" / "view_000.png").is_file() and not (out / "views" / "view_001.png").exists()


def test_evaluate_reports_bad_input(tmp_path, capsys) -> None:
    assert main(["--data", str(tmp_path / "missing"), "--out", str(tmp_path / "o"), *TINY]) == 1
    assert capsys.readouterr().err.startswith("DatasetError: data: ")
    assert main(["--views", "-1", "--no-sequence", "--mesh", "x.obj", "--out", str(tmp_path / "o"), *TINY]) == 1
    assert capsys.readouterr().err.startswith("InputError: --views: ")
