"""Robustness scenarios: a session (validity, state machine, recovery) run through each synthetic scenario.

Per frame: the first frame is registered with the ground-truth mask (a client mask: ``forced``); then the session
tracks from its last estimate; while it is LOST it re-registers on the best-ranked recovery candidate of the frame
(:func:`foundationpose.recovery.recovery_candidates`, one register per frame, cycling through the candidates on
the following frames) and tracks when there is none: a :class:`foundationpose.estimator.Tracker`, whose results
carry the validity measured in their register or track step.

Ground-truth labels of a frame (``visible`` = the scenario's ``visible_fraction``; ``correct`` = ADD under the
declared symmetries below 0.1 diameters, the success threshold of every accuracy figure here):

* good:  ``visible >= SEEN_ABOVE`` and correct (tracking should report it valid);
* bad:   ``visible < GONE_BELOW`` or not correct (a pose nobody should trust);
* neither (partly hidden, correct): not counted for false alarms or losses.

Figures per scenario (:func:`scenario_metrics`): false alarms on good frames (state not TRACKING, or pose not
reported valid); loss events (a run of bad frames after a non-bad one) with the delay until the session is LOST;
silent failures (bad frames reported valid); recoveries (from the first frame of a loss in which the object is in
view again until a reported-valid correct pose) within ``fps`` frames (1 s); ADD / ADD-S on frames reported
valid; the ROC of the confidence (positive = correct with ``visible >= GONE_BELOW``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from foundationpose.demo.metrics import pose_errors
from foundationpose.errors import InputError
from foundationpose.estimator import PoseEstimator, Tracker
from foundationpose.mesh import ObjectModel
from foundationpose.recovery import RecoveryConfig
from foundationpose.session_state import SessionConfig, State
from foundationpose.synthetic.scenarios import Scenario
from foundationpose.validity import MEASUREMENTS

__all__ = ["GONE_BELOW", "SEEN_ABOVE", "confidence_roc", "run_scenario", "scenario_metrics"]

GONE_BELOW = 0.1  # visible fraction under which the object counts as gone (fully hidden or out of view)
SEEN_ABOVE = 0.5  # visible fraction from which it counts as in view
_SUCCESS_DIAMETERS = 0.1


def run_scenario(estimator: PoseEstimator, obj: ObjectModel, scenario: Scenario, *,
                 points_mesh: np.ndarray, session: SessionConfig | None = None,
                 recovery: RecoveryConfig | None = None, recover: bool = True,
                 progress=None) -> list[dict[str, Any]]:
    """One row per frame: ground truth, the estimate (``cam_from_mesh``, the canonical member when symmetries are
    declared), its errors, the validity measurements, the session state and the pose's source.

    obj: the object, its ``validity`` thresholds included. points_mesh: (P, 3) metric points (uniform surface
    samples, mesh frame). recover: re-register on recovery candidates while LOST (else keep tracking).
    """
    tracker = Tracker(estimator, obj, config=session or SessionConfig(),
                      recovery=(recovery or RecoveryConfig()) if recover else None)
    rows = []
    for i, f in enumerate(scenario.frames):
        result, source = None, None
        try:
            if i == 0:
                result = tracker.register(f.rgb, f.depth, f.mask, scenario.K)
            else:
                result = tracker.track(f.rgb, f.depth, scenario.K)
        except InputError:  # too few depth pixels under the client's mask: no pose from this frame
            source = "no register (client mask): too little depth under the mask"
        except RuntimeError:  # no pose yet, and no recovery candidate in this frame
            source = "none (no pose yet)"
        rows.append(_row(i, f, result, obj, points_mesh, tracker.state.state, source))
        if progress is not None:
            progress.update(1)
    return rows


def _row(i: int, f, result: Any, obj: ObjectModel, points: np.ndarray, state: State, no_pose: str | None) -> dict[str, Any]:
    gt = f.cam_from_centred.astype(np.float64) @ obj.centred_from_mesh
    judgement = None if result is None else result.validity
    report = None if result is None else result.session
    row: dict[str, Any] = {
        "frame": i, "visible_fraction": round(f.visible_fraction, 4),
        "source": no_pose if report is None else report.source, "state": state.value,
        "pose_valid": bool(report is not None and report.pose_valid),
        "frame_valid": None if judgement is None else judgement.valid,
        "confidence": None if judgement is None else round(judgement.confidence, 4),
        "add_m": None, "adds_m": None, "add_sym_m": None, "rot_deg": None, "trans_m": None, "correct": False,
        "cam_from_mesh": None, "gt_cam_from_mesh": gt.round(7).tolist(),
        "measurements": None if judgement is None else dict(zip(MEASUREMENTS, judgement.measurements.round(5).tolist(),
                                                                strict=True)),
    }
    if result is not None:
        est = np.asarray(result.cam_from_mesh, dtype=np.float64)
        err = pose_errors(est, gt, points, None if obj.symmetry is None else obj.symmetry.tfs_mesh)
        row |= {"add_m": err.add_m, "adds_m": err.adds_m, "add_sym_m": err.add_sym_m, "rot_deg": err.rot_deg,
                "trans_m": err.trans_m, "correct": bool(err.add_sym_m < _SUCCESS_DIAMETERS * obj.diameter),
                "cam_from_mesh": est.round(7).tolist()}
    return row


def confidence_roc(confidence: np.ndarray, positive: np.ndarray, points: int = 21) -> dict[str, Any]:
    """ROC of a score: ``auc`` (trapezoids over every threshold; None without both classes) and ``points``
    ``[threshold, fpr, tpr]`` at ``points`` evenly spaced thresholds in [0, 1] (predicted positive: >= t)."""
    conf = np.asarray(confidence, dtype=np.float64)
    pos = np.asarray(positive, dtype=bool)
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    out: dict[str, Any] = {"positives": n_pos, "negatives": n_neg, "auc": None, "points": []}
    if n_pos == 0 or n_neg == 0:
        return out
    for t in np.linspace(0.0, 1.0, points):
        hit = conf >= t
        out["points"].append([round(float(t), 3), round(float((hit & ~pos).sum() / n_neg), 4),
                              round(float((hit & pos).sum() / n_pos), 4)])
    order = np.argsort(-conf, kind="stable")
    tpr = np.concatenate([[0.0], np.cumsum(pos[order]) / n_pos])
    fpr = np.concatenate([[0.0], np.cumsum(~pos[order]) / n_neg])
    distinct = np.concatenate([np.diff(conf[order]) != 0, [True]])  # one ROC point per distinct score
    keep = np.concatenate([[True], distinct])
    x, y = fpr[keep], tpr[keep]
    out["auc"] = round(float(((x[1:] - x[:-1]) * (y[1:] + y[:-1]) / 2).sum()), 4)  # trapezoids
    return out


def _runs(flags: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of True."""
    runs, start = [], None
    for i, f in enumerate(flags):
        if f and start is None:
            start = i
        if not f and start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(flags)))
    return runs


def _stats(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    arr = np.asarray(values, dtype=np.float64)
    return {"mean": float(arr.mean()), "median": float(np.median(arr)), "max": float(arr.max())}


def scenario_metrics(rows: list[dict[str, Any]], fps: float = 30.0) -> dict[str, Any]:
    """The figures of the module docstring from :func:`run_scenario`'s rows."""
    visible = np.array([r["visible_fraction"] for r in rows])
    correct = np.array([r["correct"] for r in rows])
    state = np.array([r["state"] for r in rows])
    reported = np.array([r["pose_valid"] for r in rows])
    good = (visible >= SEEN_ABOVE) & correct
    bad = (visible < GONE_BELOW) | ~correct
    n_good = int(good.sum())
    losses, recoveries = [], []
    for start, end in _runs(bad):
        if start == 0:
            continue  # the register itself failed: not a loss of a tracked object
        lost = [j for j in range(start, end) if state[j] == State.LOST.value]
        invalid = [j for j in range(start, end) if not reported[j]]
        losses.append({"start": start, "end": end, "detected": bool(lost),
                       "delay_frames": (lost[0] - start) if lost else None,
                       "first_invalid_delay_frames": (invalid[0] - start) if invalid else None})
        seen = [j for j in range(start, len(rows)) if visible[j] >= SEEN_ABOVE]
        if seen:
            back = seen[0]
            ok = [j for j in range(back, len(rows)) if reported[j] and correct[j]]
            recoveries.append({"visible_again": back, "recovered_at": ok[0] if ok else None,
                               "frames_to_recover": (ok[0] - back) if ok else None,
                               "within_1s": bool(ok) and ok[0] - back <= fps})
    valid_rows = [r for r in rows if r["pose_valid"]]
    scored = [r for r in rows if r["confidence"] is not None]
    delays = [e["delay_frames"] for e in losses if e["delay_frames"] is not None]
    return {
        "frames": len(rows), "good_frames": n_good, "bad_frames": int(bad.sum()),
        "false_alarm_rate": None if n_good == 0 else float((state[good] != State.TRACKING.value).mean()),
        "false_invalid_rate": None if n_good == 0 else float((~reported[good]).mean()),
        "silent_failures": int((bad & reported).sum()),
        "losses": losses,
        "loss_detection_rate": None if not losses else sum(e["detected"] for e in losses) / len(losses),
        "loss_detection_delay_frames": _stats(delays),
        "recoveries": recoveries,
        "recovery_rate_1s": None if not recoveries else sum(e["within_1s"] for e in recoveries) / len(recoveries),
        "time_to_recover_frames": _stats([e["frames_to_recover"] for e in recoveries
                                          if e["frames_to_recover"] is not None]),
        "reported_valid_frames": len(valid_rows),
        "add_m_on_valid": _stats([r["add_m"] for r in valid_rows]),
        "adds_m_on_valid": _stats([r["adds_m"] for r in valid_rows]),
        "confidence_roc": confidence_roc(np.array([r["confidence"] for r in scored]),
                                         np.array([r["correct"] and r["visible_fraction"] >= GONE_BELOW
                                                   for r in scored])),
        "states": {s.value: int((state == s.value).sum()) for s in State},
    }
