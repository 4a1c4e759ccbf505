"""compare_precisions: differences of evaluation reports from the baseline precision's, worse = positive."""

from __future__ import annotations

import pytest

from foundationpose.evaluate.precisions import compare_precisions


def _report(success: float, adds_mm: float, seq_add_mm: float | None = None) -> dict:
    report = {"views": {"register_success_rate": success, "adds_m": {"mean": adds_mm / 1000}, "add_m": {"mean": 0.01}}}
    if seq_add_mm is not None:
        report["sequence"] = {"add_m": {"mean": seq_add_mm / 1000}, "success_rate": 1.0,
                              "drift": {"add_last_minus_first_m": 0.001}}
    return report


def test_differences_are_signed_so_that_worse_is_positive() -> None:
    out = compare_precisions({"fp32": _report(0.96, 2.0, 3.0), "bf16": _report(0.94, 2.5, 2.0)}, baseline="fp32")
    row = out["precisions"]["bf16"]
    assert out["baseline"] == "fp32" and list(out["precisions"]) == ["bf16"]
    assert row["register_success_points"] == pytest.approx(2.0)  # 96% -> 94%: 2 points worse
    assert row["views_adds_mean_mm"] == pytest.approx(0.5)
    assert row["sequence_add_mean_mm"] == pytest.approx(-1.0)  # better than the baseline
    assert row["sequence_success_points"] == 0.0 and row["sequence_drift_mm"] == 0.0


def test_a_figure_missing_from_either_report_is_none() -> None:
    row = compare_precisions({"fp16": _report(0.9, 1.0), "bf16": _report(0.9, 1.0, 2.0)}, "fp16")["precisions"]["bf16"]
    assert row["sequence_add_mean_mm"] is None and row["views_adds_mean_mm"] == 0.0


def test_an_unknown_baseline_is_refused_naming_the_reports() -> None:
    with pytest.raises(ValueError, match=r"no report for the baseline 'fp8'; got \['bf16', 'fp16'\]"):
        compare_precisions({"fp16": _report(1, 1), "bf16": _report(1, 1)}, "fp8")
