"""Console tables of the evaluation reports (the JSON files hold every figure; these are for people)."""

from __future__ import annotations

from typing import Any

from foundationpose.demo.tables import format_table

__all__ = ["calibration_tables", "scenario_tables", "suite_tables"]


def _pct(value: float | None) -> str | None:
    return None if value is None else f"{100 * value:.1f}%"


def _mm(stats: dict[str, float] | None) -> str | None:
    return None if stats is None else f"{1000 * stats['mean']:.1f}"


def scenario_tables(report: dict[str, Any]) -> str:
    """One row per scenario: the robustness figures of :func:`foundationpose.evaluate.scenarios.scenario_metrics`,
    and a legend that defines them."""
    rows = []
    for name, s in report["scenarios"].items():
        delay = s["loss_detection_delay_frames"]
        recover = s["time_to_recover_frames"]
        rows.append([name, s["frames"], s["good_frames"], s["false_alarms"], _pct(s["false_alarm_rate"]),
                     s["confirmation_frames"], len(s["losses"]), _pct(s["loss_detection_rate"]),
                     None if delay is None else delay["max"], s["silent_failures"], len(s["recoveries"]),
                     s["unobserved_recoveries"], _pct(s["recovery_rate_1s"]),
                     None if recover is None else recover["median"], s["reported_valid_frames"],
                     _mm(s["add_m_on_valid"]), s["confidence_roc"]["auc"]])
    headers = ["scenario", "frames", "good", "false alarms", "rate", "confirming", "losses", "detected",
               "max delay", "silent fails", "reappear", "unobserved", "recovered <=1s", "median frames", "valid",
               "ADD valid mm", "ROC AUC"]
    window = next((s["recovery_window_frames"] for s in report["scenarios"].values()), 30)
    note = ("correct: ADD under the object's declared symmetries < 0.1 diameter. good: in view (visible >= 50 %) "
            "and correct. false alarms: good frames not tracking, confirmation frames excluded (confirming: good "
            "frames in recovering, a recovered pose being confirmed); rate over good frames less those.\n"
            "losses: runs of gone (visible < 10 %) or wrong frames; detected: reached lost (max delay in frames). "
            "silent fails: gone or wrong frames reported valid.\n"
            f"reappear: losses after which the object is in view again; recovered <=1s: correct and reported valid "
            f"within {window} frames, over the observed ones; unobserved: not recovered yet when the scenario ends "
            "before the window does (never counted as failures).")
    if report.get("random_weights"):
        note += "\nRANDOM WEIGHTS: the tracker fails on purpose; these figures test the trust machinery only."
    return format_table(f"Robustness scenarios: {report['object']['name']} ({report['device']})", headers, rows, note)


def calibration_tables(report: dict[str, Any]) -> str:
    """The chosen thresholds per object and pooled, and how they judge each kind of probe."""
    rows = []
    for label, entry in [*report["objects"].items(), ("default (pooled)", report["default"])]:
        c = entry["chosen"]
        rows.append([label, c["depth_tolerance_diameters"], c["min_support"], c["min_consistent"],
                     c["max_translation_m"], c["max_rotation_deg"]])
    out = [format_table("Validity thresholds chosen", ["object", "tolerance (d)", "min support", "min consistent",
                                                       "max step m", "max step deg"], rows)]
    kinds = ("good", "partial", "teleport", "gone", "near_miss", "far", "stale", "estimator")
    krows = []
    for shape, figures in report["default"]["per_object"].items():
        by_kind = figures["by_kind"]
        krows.append([shape, _pct(figures["false_alarm_on_good"]), _pct(figures["detection_of_bad"]),
                      *(_pct(by_kind[k]["judged_valid"]) if k in by_kind else None for k in kinds)])
    out.append(format_table("Share judged valid with the default, per probe kind",
                            ["object", "false alarms", "bad detected", *kinds], krows,
                            "good / partial: correct poses in view / partly hidden; gone: the object is not there; "
                            "near_miss / far / stale: wrong poses; estimator: the given weights' one-step tracks."))
    return "\n\n".join(out)


def suite_tables(report: dict[str, Any]) -> str:
    """One row per object of :mod:`foundationpose.evaluate.suite`'s report, then one per split and overall."""
    rows = []
    for name, o in report["objects"].items():
        reg, track = o["register"], o["track"]
        scenarios = o["scenarios"].values()
        rows.append([name, o["split"], _pct(reg["success_rate"]), _pct(reg["flip_rate"]), _mm(reg["add_m"]),
                     _pct(track["success_rate"]), _mm(track["add_m"]), _mm(track["adds_m"]), _pct(track["flip_rate"]),
                     sum(s["silent_failures"] for s in scenarios), sum(s["valid_flip_frames"] for s in scenarios),
                     sum(s["valid_flip_missed"] for s in scenarios), "cached" if o["weights"].get("reused") else "trained"])
    for label, g in report["splits"].items():
        reg, track, sc = g["register"], g["track"], g["scenarios"]
        rows.append([label, f"{len(g['objects'])} objects", _pct(reg["success_rate"]), _pct(reg["flip_rate"]),
                     _mean_mm(reg["add_m_mean"]), _pct(track["success_rate"]), _mean_mm(track["add_m_mean"]),
                     _mean_mm(track["adds_m_mean"]), _pct(track["flip_rate"]), sc["silent_failures"],
                     sc["valid_flip_frames"], sc["valid_flip_missed"], None])
    headers = ["object", "split", "register ok", "reg flips", "reg ADD mm", "track ok", "track ADD mm",
               "track ADD-S mm", "track flips", "silent fails", "valid flips", "flips missed", "weights"]
    d = report["definitions"]
    note = (f"ok: {d['success']}. flips: {d['flip']}; {d['flip_rate']}.\ntrack: {d['track']}. silent fails: "
            f"bad frames reported valid, all scenarios; valid flips: {d['valid_flip_frames']}; flips missed: "
            f"{d['valid_flip_missed']}. Splits: {d['pooled']}.")
    if any(o["random_weights"] for o in report["objects"].values()):
        note += "\nRANDOM WEIGHTS for some objects: their figures test the machinery only."
    return format_table("Object suite", headers, rows, note)


def _mean_mm(value: float | None) -> str | None:
    return None if value is None else f"{1000 * value:.1f}"
