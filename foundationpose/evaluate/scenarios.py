"""Robustness scenarios: a session (validity, state machine, recovery) run through each synthetic scenario.

Per frame: the first frame is registered with the ground-truth mask (a client mask: ``forced``); then the session
tracks from its last estimate; while it is LOST it re-registers on the best-ranked recovery candidate of the frame
(:func:`foundationpose.recovery.recovery_candidates`, one register per frame, cycling through the candidates on
the following frames) and tracks when there is none: a :class:`foundationpose.estimator.Tracker`, whose results
carry the validity measured in their register or track step.

Ground-truth labels of a frame (``visible`` = the scenario's ``visible_fraction``; ``correct`` = ADD under the
object's declared symmetries below 0.1 diameter, the success threshold of every accuracy figure here):

* good:  ``visible >= SEEN_ABOVE`` and correct (tracking should report it valid);
* bad:   ``visible < GONE_BELOW`` or not correct (a pose nobody should trust);
* neither (partly hidden, correct): not counted for false alarms or losses.

Figures per scenario (:func:`scenario_metrics`):

* false alarms: good frames whose state is not TRACKING, except confirmation frames (RECOVERING: a recovered pose
  waits ``confirm_frames`` valid frames before it is reported, by design; counted apart);
* loss events (a run of bad frames after a non-bad one) and the delay until the session is LOST; a loss that the
  scenario's end cuts off before ``detect_within`` frames, still undetected, is *unobserved*;
* silent failures: bad frames reported valid;
* recoveries: from the first frame of a loss in which the object is in view again until a reported-valid correct
  pose, within ``fps`` frames (1 s). A recovery is *unobserved* when it has not happened and the scenario ends
  before its 1 s window does: counted apart, never as a failure; the rate is over the observed ones;
* ADD / ADD-S on frames reported valid; the ROC of the confidence (positive = correct with
  ``visible >= GONE_BELOW``).

Seeds: each command draws its scenarios from its own stream (:data:`SEED_STREAMS`: ``calibrate`` and
``scenarios``, disjoint ranges of scenario seeds), so that thresholds are never evaluated on the scenes they were
fitted to; :func:`scenario_seeds` refuses a first seed whose run would leave its stream, and
:func:`check_disjoint` a run whose seeds a calibration used.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from foundationpose.demo.metrics import pose_errors
from foundationpose.errors import InputError
from foundationpose.estimator import PoseEstimator, Tracker
from foundationpose.mesh import ObjectModel
from foundationpose.recovery import RecoveryConfig
from foundationpose.session_state import SessionConfig, State
from foundationpose.synthetic.scenarios import SCENARIOS, Scenario, make_scenario
from foundationpose.synthetic.sensor import SensorColourConfig, SensorDepthConfig
from foundationpose.validity import MEASUREMENTS

__all__ = ["CORRECT_BELOW_DIAMETERS", "DEFINITIONS", "GONE_BELOW", "SEED_STREAMS", "SEEN_ABOVE", "check_disjoint",
           "confidence_roc", "run_scenario", "run_scenarios", "scenario_metrics", "scenario_seeds",
           "seed_range_text"]

GONE_BELOW = 0.1  # visible fraction under which the object counts as gone (fully hidden or out of view)
SEEN_ABOVE = 0.5  # visible fraction from which it counts as in view
CORRECT_BELOW_DIAMETERS = 0.1  # a pose is correct when its ADD under the declared symmetries is below this
# Each command's scenario seeds, [first, end): the thresholds in validity.ValidityConfig were calibrated on seeds
# 0-4 (calibrate --seed 0); the robustness evaluation draws from a range no calibration run can reach.
SEED_STREAMS: dict[str, tuple[int, int]] = {"calibrate": (0, 1_000_000), "scenarios": (1_000_000, 2_000_000)}

DEFINITIONS = {
    "correct": f"ADD under the object's declared symmetries < {CORRECT_BELOW_DIAMETERS} diameter",
    "good": f"visible fraction >= {SEEN_ABOVE} and correct",
    "bad": f"visible fraction < {GONE_BELOW} (gone) or not correct",
    "false_alarm": "a good frame whose state is not tracking; confirmation frames (recovering) are not counted",
    "confirmation_frame": "a good frame in the recovering state: a recovered pose being confirmed, by design",
    "silent_failure": "a bad frame reported valid",
    "loss": "a run of bad frames after a frame that was not bad; detected: the session reached lost in it",
    "recovery": "from the first frame of a loss with the object in view again (visible fraction >= "
                f"{SEEN_ABOVE}) to a correct pose reported valid",
    "unobserved": "an event the scenario ends too early to judge (a recovery not yet made whose 1 s window runs "
                  "past the last frame; a loss cut off undetected within its first detect_within frames): "
                  "counted apart, never as a failure",
}


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


def run_scenarios(estimator: PoseEstimator, obj: ObjectModel, seeds: dict[str, int], *, points_mesh: np.ndarray,
                  distractor: ObjectModel, frames: int, hw: tuple[int, int],
                  depth: SensorDepthConfig | None = None, colour: SensorColourConfig | None = None,
                  recover: bool = True, progress=None) -> dict[str, dict[str, Any]]:
    """Each scenario of ``seeds`` (name -> scenario seed) made (:func:`foundationpose.synthetic.scenarios.make_scenario`
    with ``distractor``, the estimator's renderer), run (:func:`run_scenario`) and measured
    (:func:`scenario_metrics`): per name its description, seed, fps, sensor effects, event frames, the figures and
    ``per_frame`` (the rows)."""
    out: dict[str, dict[str, Any]] = {}
    for name, seed in seeds.items():
        scenario = make_scenario(name, obj, estimator.renderer, frames=frames, hw=hw, seed=seed,
                                 depth=depth, colour=colour, distractor=distractor)
        rows = run_scenario(estimator, obj, scenario, points_mesh=points_mesh, recover=recover, progress=progress)
        out[name] = {"description": scenario.description, "seed": scenario.seed, "fps": scenario.fps,
                     "depth": scenario.depth, "colour": scenario.colour,
                     "events": {k: v for k, v in scenario.events.items() if not k.endswith("cam_from_centred")},
                     **scenario_metrics(rows, fps=scenario.fps), "per_frame": rows}
    return out


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
                "trans_m": err.trans_m, "correct": bool(err.add_sym_m < CORRECT_BELOW_DIAMETERS * obj.diameter),
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


def scenario_metrics(rows: list[dict[str, Any]], fps: float = 30.0, *, recover_within_s: float = 1.0,
                     detect_within: int = 3) -> dict[str, Any]:
    """The figures of the module docstring from :func:`run_scenario`'s rows.

    fps: the frame rate the rows stand for; a recovery counts within ``recover_within_s`` seconds
    (``round(fps * recover_within_s)`` frames). detect_within: the frames a loss's detection is judged on (3: the
    issue's "loss detected within 3 frames"), which decides when a loss at the scenario's end is unobserved.
    """
    if fps <= 0 or recover_within_s <= 0 or detect_within < 1:
        raise ValueError(f"fps and recover_within_s must be > 0 and detect_within >= 1, got {fps}, "
                         f"{recover_within_s}, {detect_within}")
    window = int(round(fps * recover_within_s))
    last = len(rows) - 1
    visible = np.array([r["visible_fraction"] for r in rows])
    correct = np.array([r["correct"] for r in rows], dtype=bool)
    state = np.array([r["state"] for r in rows])
    reported = np.array([r["pose_valid"] for r in rows], dtype=bool)
    good = (visible >= SEEN_ABOVE) & correct
    bad = (visible < GONE_BELOW) | ~correct
    confirming = good & (state == State.RECOVERING.value)
    counted = good & ~confirming
    n_counted = int(counted.sum())
    alarms = counted & (state != State.TRACKING.value)
    losses, recoveries = [], []
    for start, end in _runs(bad):
        if start == 0:
            continue  # the register itself failed: not a loss of a tracked object
        lost = [j for j in range(start, end) if state[j] == State.LOST.value]
        invalid = [j for j in range(start, end) if not reported[j]]
        losses.append({"start": start, "end": end, "detected": bool(lost),
                       "delay_frames": (lost[0] - start) if lost else None,
                       "first_invalid_delay_frames": (invalid[0] - start) if invalid else None,
                       "observed": bool(lost) or end <= last or end - start >= detect_within})
        seen = [j for j in range(start, len(rows)) if visible[j] >= SEEN_ABOVE]
        if seen:
            back = seen[0]
            ok = [j for j in range(back, len(rows)) if reported[j] and correct[j]]
            observed = bool(ok) or back + window <= last
            if ok:
                outcome = "within_1s" if ok[0] - back <= window else "late"
            else:
                outcome = "not_recovered" if observed else "unobserved"
            recoveries.append({"visible_again": back, "recovered_at": ok[0] if ok else None,
                               "frames_to_recover": (ok[0] - back) if ok else None,
                               "within_1s": (bool(ok) and ok[0] - back <= window) if observed else None,
                               "observed": observed, "outcome": outcome, "window_ends": back + window})
    observed_losses = [e for e in losses if e["observed"]]
    observed_recoveries = [e for e in recoveries if e["observed"]]
    valid_rows = [r for r in rows if r["pose_valid"]]
    scored = [r for r in rows if r["confidence"] is not None]
    delays = [e["delay_frames"] for e in losses if e["delay_frames"] is not None]
    return {
        "frames": len(rows), "good_frames": int(good.sum()), "bad_frames": int(bad.sum()),
        "confirmation_frames": int(confirming.sum()), "false_alarms": int(alarms.sum()),
        "false_alarm_rate": None if n_counted == 0 else float(alarms.sum() / n_counted),
        "false_invalid_rate": None if n_counted == 0 else float((counted & ~reported).sum() / n_counted),
        "silent_failures": int((bad & reported).sum()),
        "losses": losses,
        "unobserved_losses": len(losses) - len(observed_losses),
        "loss_detection_rate": (None if not observed_losses
                                else sum(e["detected"] for e in observed_losses) / len(observed_losses)),
        "loss_detection_delay_frames": _stats(delays),
        "recoveries": recoveries,
        "unobserved_recoveries": len(recoveries) - len(observed_recoveries),
        "recovery_window_frames": window,
        "recovery_rate_1s": (None if not observed_recoveries
                             else sum(e["within_1s"] for e in observed_recoveries) / len(observed_recoveries)),
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


def seed_range_text(seeds: Iterable[int]) -> str:
    """``"first-last"`` of a set of seeds (``"s"`` for one)."""
    values = sorted(set(seeds))
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"


def scenario_seeds(stream: str, first: int, names: Iterable[str] = SCENARIOS) -> dict[str, int]:
    """The seed of each scenario of a run of ``stream`` (a key of :data:`SEED_STREAMS`) that starts at ``first``:
    ``first`` + the scenario's index in :data:`~foundationpose.synthetic.scenarios.SCENARIOS` (the same scene
    whichever others run with it). Raises InputError (``--seed``, naming both streams' ranges) when the run's
    seeds would leave the stream."""
    if stream not in SEED_STREAMS:
        raise ValueError(f"stream must be one of {', '.join(SEED_STREAMS)}; got {stream!r}")
    lo, hi = SEED_STREAMS[stream]
    if not lo <= first <= hi - len(SCENARIOS):
        others = "; ".join(f"{name}'s: [{a}, {b})" for name, (a, b) in SEED_STREAMS.items() if name != stream)
        raise InputError("--seed", f"a first seed in [{lo}, {hi - len(SCENARIOS)}] (the {stream} stream, scenario "
                         f"seeds [{lo}, {hi})), so that no scenario shares a seed with another stream ({others})",
                         f"{first} (scenario seeds {seed_range_text(range(first, first + len(SCENARIOS)))})")
    return {name: first + SCENARIOS.index(name) for name in names}


def check_disjoint(seeds: Iterable[int], calibration_seeds: Iterable[int], calibration: str) -> None:
    """Raise InputError (``--seed``, naming both ranges) when a run's scenario seeds overlap those its validity
    thresholds were calibrated on (``calibration``: where those come from, for the message)."""
    mine, theirs = set(seeds), set(calibration_seeds)
    if mine & theirs:
        raise InputError("--seed", f"scenario seeds disjoint from the calibration's {seed_range_text(theirs)} "
                         f"({calibration}): thresholds must not be evaluated on the scenes they were fitted to",
                         f"scenario seeds {seed_range_text(mine)}")
