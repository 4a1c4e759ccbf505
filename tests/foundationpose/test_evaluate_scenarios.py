"""Robustness figures from per-frame rows, the ROC, and the scenarios / calibrate commands on tiny settings."""

from __future__ import annotations

import json

import numpy as np
import pytest

from foundationpose.evaluate.cli import main
from foundationpose.evaluate.scenarios import confidence_roc, scenario_metrics

TINY = ["--device", "cpu", "--renderer", "cpu", "--hypotheses", "2", "--register-iterations", "1",
        "--track-iterations", "1", "--no-progress"]


def _rows(spec: str, visible: list[float] | None = None) -> list[dict]:
    """One row per character: T tracking + valid + correct, U uncertain, L lost, R recovering, W wrong but
    reported valid (tracking), G gone (visible 0) and lost; lower case = the pose is wrong."""
    rows = []
    for i, c in enumerate(spec):
        state = {"T": "tracking", "U": "uncertain", "L": "lost", "R": "recovering", "W": "tracking", "G": "lost"}[
            c.upper()]
        correct = c.isupper() and c != "W"
        vis = visible[i] if visible is not None else (0.0 if c.upper() == "G" else 1.0)
        rows.append({"visible_fraction": vis, "correct": correct, "state": state,
                     "pose_valid": state == "tracking", "confidence": 0.9 if state == "tracking" else 0.1,
                     "add_m": 0.001 if correct else 0.05, "adds_m": 0.001 if correct else 0.04})
    return rows


def test_clean_tracking_with_one_false_alarm() -> None:
    m = scenario_metrics(_rows("TTTTUTTTTT"))
    assert m["good_frames"] == 10 and m["false_alarm_rate"] == pytest.approx(0.1)
    assert m["losses"] == [] and m["silent_failures"] == 0 and m["reported_valid_frames"] == 9
    assert m["add_m_on_valid"]["mean"] == pytest.approx(0.001)


def test_a_loss_its_detection_delay_and_the_recovery() -> None:
    # the object goes at frame 3 (two uncertain frames, lost at 5), is back at 7, recovered (valid, correct) at 9
    rows = _rows("TTTuuGGrRT", visible=[1, 1, 1, 0, 0, 0, 0, 1, 1, 1])
    m = scenario_metrics(rows, fps=30)
    assert m["losses"] == [{"start": 3, "end": 8, "detected": True, "delay_frames": 2,
                            "first_invalid_delay_frames": 0}]
    assert m["loss_detection_rate"] == 1.0 and m["loss_detection_delay_frames"]["max"] == 2
    assert m["recoveries"] == [{"visible_again": 7, "recovered_at": 9, "frames_to_recover": 2, "within_1s": True}]
    assert m["recovery_rate_1s"] == 1.0 and m["silent_failures"] == 0
    late = scenario_metrics(rows, fps=1)  # within "1 s" at 1 frame/s: 2 frames is too late
    assert late["recovery_rate_1s"] == 0.0


def test_a_wrong_pose_reported_valid_is_a_silent_failure() -> None:
    m = scenario_metrics(_rows("TTTwwwwwww"))
    assert m["silent_failures"] == 7 and m["losses"][0]["detected"] is False
    assert m["recoveries"][0]["recovered_at"] is None and m["recovery_rate_1s"] == 0.0


def test_roc_of_the_confidence() -> None:
    perfect = confidence_roc(np.array([0.9, 0.8, 0.2, 0.1]), np.array([True, True, False, False]))
    assert perfect["auc"] == 1.0 and perfect["positives"] == perfect["negatives"] == 2
    assert perfect["points"][0] == [0.0, 1.0, 1.0] and perfect["points"][-1] == [1.0, 0.0, 0.0]
    assert confidence_roc(np.array([0.1, 0.9]), np.array([True, False]))["auc"] == 0.0
    assert confidence_roc(np.array([0.5, 0.5]), np.array([True, False]))["auc"] == 0.5  # ties: the diagonal
    assert confidence_roc(np.array([0.5]), np.array([True]))["auc"] is None


@pytest.mark.slow
def test_scenarios_command(tmp_path, capsys) -> None:
    out = tmp_path / "sc"
    assert main(["scenarios", "--scenario", "jump", "--frames", "30", "--size", "120", "160", "--out", str(out),
                 "--symmetry", "z:2", *TINY]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("Robustness scenarios: procedural_textured_asym (cpu)\n") and "RANDOM WEIGHTS" in printed
    report = json.loads((out / "scenarios.json").read_text(encoding="utf-8"))
    jump = report["scenarios"]["jump"]
    assert jump["events"] == {"jump": 15} and jump["depth"]["kind"] == "sensor"
    assert len(jump["per_frame"]) == 30 and jump["per_frame"][0]["source"] == "register (client mask)"
    assert report["symmetry"] == {"declared": ["discrete z 2"], "transforms": 2}
    assert report["model_points"]["count"] == 2000 and set(jump["states"]) == {"tracking", "uncertain", "lost",
                                                                             "recovering"}
    for row in jump["per_frame"]:
        assert row["state"] != "lost" or not row["pose_valid"]  # a lost session never reports a valid pose


@pytest.mark.slow
def test_calibrate_command(tmp_path, capsys) -> None:
    out = tmp_path / "cal"
    assert main(["calibrate", "--no-estimator", "--shapes", "L", "--frames", "30", "--size", "240", "320",
                 "--probes", "1", "--out", str(out), "--no-progress", "--device", "cpu", "--renderer", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("Validity thresholds chosen\n")
    report = json.loads((out / "calibration.json").read_text(encoding="utf-8"))
    assert report["command"].startswith("python -m foundationpose.evaluate calibrate --no-estimator")
    assert report["machine"]["cpu_count"] >= 1 and report["date"]
    chosen = report["default"]["chosen"]
    assert chosen == report["objects"]["L"]["chosen"]  # one object: the pooled choice is its own
    assert 0 < chosen["min_support"] < 1 and 0 < chosen["min_consistent"] < 1
    figures = report["default"]["per_object"]["L"]
    chosen_at = next(r for r in report["default"]["per_tolerance"]
                     if r["depth_tolerance_diameters"] == chosen["depth_tolerance_diameters"])
    assert chosen_at["false_alarm_on_good"] <= 0.01  # the support / consistency thresholds keep the target
    assert figures["false_alarm_on_good"] >= chosen_at["false_alarm_on_good"]  # motion limits may add some
    assert figures["by_kind"]["far"]["judged_valid"] < 0.1 and figures["by_kind"]["gone"]["judged_valid"] < 0.1
