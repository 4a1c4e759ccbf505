"""Accuracy of one set of weights at several network precisions, on the same frames and views.

``python -m foundationpose.evaluate --precision fp16,bf16`` runs the evaluation once per precision with the same
seeds; :func:`compare_precisions` states how far each precision's figures are from the first one's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["compare_precisions"]


def _get(report: Mapping[str, Any], *path: str) -> float | None:
    node: Any = report
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    return float(node) if isinstance(node, (int, float)) else None


def compare_precisions(reports: Mapping[str, Mapping[str, Any]], baseline: str) -> dict[str, Any]:
    """Differences of ``foundationpose.evaluate`` reports (one per precision, same data) from ``baseline``'s.

    reports: precision -> the evaluate JSON of that precision (``views`` and / or ``sequence`` sections). Returns,
    per other precision: ``register_success_points`` (views' register success rate, percentage points),
    ``views_adds_mean_mm`` / ``views_add_mean_mm`` and ``sequence_adds_mean_mm`` / ``sequence_add_mean_mm`` (mean
    differences in millimetres), ``sequence_success_points`` and ``sequence_drift_mm`` (difference of the
    sequence's last-minus-first ADD). Positive = worse than the baseline; None where a report lacks the figure.
    Raises ValueError when ``baseline`` has no report.
    """
    if baseline not in reports:
        raise ValueError(f"compare_precisions: no report for the baseline {baseline!r}; got {sorted(reports)}")
    base = reports[baseline]
    out: dict[str, Any] = {"baseline": baseline, "precisions": {}}
    for precision, report in reports.items():
        if precision == baseline:
            continue

        def diff(*path: str, scale: float = 1.0, sign: float = 1.0, _r: Mapping[str, Any] = report) -> float | None:
            a, b = _get(_r, *path), _get(base, *path)
            return None if a is None or b is None else sign * (a - b) * scale

        out["precisions"][precision] = {
            "register_success_points": diff("views", "register_success_rate", scale=100.0, sign=-1.0),
            "views_adds_mean_mm": diff("views", "adds_m", "mean", scale=1000.0),
            "views_add_mean_mm": diff("views", "add_m", "mean", scale=1000.0),
            "sequence_adds_mean_mm": diff("sequence", "adds_m", "mean", scale=1000.0),
            "sequence_add_mean_mm": diff("sequence", "add_m", "mean", scale=1000.0),
            "sequence_success_points": diff("sequence", "success_rate", scale=100.0, sign=-1.0),
            "sequence_drift_mm": diff("sequence", "drift", "add_last_minus_first_m", scale=1000.0),
        }
    return out
