"""Choose the validity thresholds from measurements: ``python -m foundationpose.evaluate calibrate``.

For each object, every frame of every synthetic scenario (:mod:`foundationpose.synthetic.scenarios`, sensor-like
depth and colour; scenario seeds from the ``calibrate`` stream, :func:`foundationpose.evaluate.scenarios.
scenario_seeds`, which the robustness evaluation never draws from) is measured (:func:`foundationpose.validity.measure_validity`, the step starting from the previous frame's
ground truth) at poses whose quality is known:

* ``good``: the ground truth with a working tracker's error (rotation up to ``good_rot_deg`` about a random axis,
  translation up to ``good_trans_diameters``), on frames where the object is in view (``visible >= 0.5``);
* ``near_miss``: errors of 0-30 degrees and 0-0.3 diameters, kept when ADD >= 0.1 diameters (wrong, but close);
* ``far``: errors of 30-180 degrees or 0.3-1.5 diameters;
* ``stale``: the previous frame's ground truth, labelled by its own ADD (a tracker that did not follow a jump);
* ``gone``: a good pose on frames where the object is gone (``visible < 0.1``): nothing confirms it;
* ``teleport``: a good pose on a frame reached by a jump (the jump frame, the first frame back in view): the
  motion limits should flag the step, so these count neither as good nor as bad, and are reported on their own;
* ``estimator``: the project's estimator, one track step from the previous frame's ground truth (plus a working
  tracker's error), labelled by its ADD: what the given weights make of it (random weights: wrong poses).

Then, for each depth tolerance in ``tolerances`` (diameters), ``min_support`` and ``min_consistent`` are the
largest values (rounded down to 0.01) that keep the false alarms on ``good`` samples at or below
``target_false_alarm`` (the issue's figure: 1 %), the tolerance with the best detection of the wrong samples wins,
and the motion limits are ``motion_margin`` times the largest motion between consecutive ground-truth frames of
the smooth scenarios (clean, occluder, distractor: about 1 cm and 3.4 degrees per frame for the L-block; the jump,
and the leave scenario's fast exit, are what they must catch). The report holds every figure behind the
choice; docs/tracking.md records a run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from foundationpose.demo.metrics import add_error
from foundationpose.estimator import PoseEstimator
from foundationpose.evaluate.scenarios import GONE_BELOW, SEEN_ABOVE, scenario_seeds
from foundationpose.mesh import ObjectModel
from foundationpose.render import Renderer
from foundationpose.synthetic.scenarios import SCENARIOS, Scenario, make_scenario
from foundationpose.validity import (
    MEASUREMENTS,
    FrameJudge,
    ValidityConfig,
    column,
    judge_validity,
    measure_validity,
)

__all__ = ["CalibrationConfig", "Collected", "choose", "collect", "judged", "random_rotation"]

_SUPPORT, _CONSISTENT = column("support_fraction"), column("consistent_fraction")
_SMOOTH = ("clean", "occluder", "distractor")  # scenarios whose object only follows the smooth trajectory
_TRANSLATION, _ROTATION = column("translation_m"), column("rotation_deg")


@dataclass(frozen=True, slots=True, kw_only=True)
class CalibrationConfig:
    frames: int = 36
    hw: tuple[int, int] = (480, 640)
    seed: int = 0
    probes: int = 4  # samples of each probe kind per frame
    tolerances: tuple[float, ...] = (0.02, 0.03, 0.04, 0.06, 0.08)  # depth tolerance candidates, diameters
    target_false_alarm: float = 0.01
    good_rot_deg: float = 2.0
    good_trans_diameters: float = 0.02
    motion_margin: float = 3.0
    estimator_every: int = 1  # one estimator sample every this many frames (0 = none)

    def __post_init__(self) -> None:
        scenario_seeds("calibrate", self.seed)  # the calibrate stream only: never the evaluation's scenes


def random_rotation(rng: np.random.Generator, angle_deg: float) -> np.ndarray:
    """(3, 3) rotation by ``angle_deg`` about a uniformly random axis."""
    axis = rng.standard_normal(3)
    axis /= np.linalg.norm(axis)
    k = np.array([[0, -axis[2], axis[1]], [axis[2], 0, -axis[0]], [-axis[1], axis[0], 0]])
    a = math.radians(angle_deg)
    return np.eye(3) + math.sin(a) * k + (1 - math.cos(a)) * (k @ k)


def _perturb(pose: np.ndarray, rng: np.random.Generator, rot_deg: float, trans_m: float) -> np.ndarray:
    out = pose.astype(np.float64).copy()
    out[:3, :3] = random_rotation(rng, rot_deg) @ out[:3, :3]
    direction = rng.standard_normal(3)
    out[:3, 3] += direction / np.linalg.norm(direction) * trans_m
    return out.astype(np.float32)


def _add(pose: np.ndarray, gt: np.ndarray, points: np.ndarray) -> float:
    return add_error(pose.astype(np.float64), gt.astype(np.float64), points)


def _label(visible: float, add_m: float, diameter: float) -> str:
    """good (in view, correct), bad (gone, or wrong) or partial (partly hidden, correct)."""
    if visible >= SEEN_ABOVE and add_m < 0.1 * diameter:
        return "good"
    return "bad" if (visible < GONE_BELOW or add_m >= 0.1 * diameter) else "partial"


def _samples(scenario: Scenario, obj: ObjectModel, points: np.ndarray, cfg: CalibrationConfig,
             rng: np.random.Generator, estimator: PoseEstimator | None, progress=None) -> list[dict[str, Any]]:
    """Probe poses of every frame (module docstring): dicts of scenario, frame, kind, label, start, pose, add_m."""
    d = obj.diameter
    out = []
    for i in range(1, len(scenario.frames)):
        f = scenario.frames[i]
        gt, start, v = f.cam_from_centred, scenario.frames[i - 1].cam_from_centred, f.visible_fraction
        poses: list[tuple[str, np.ndarray, np.ndarray]] = []  # (kind, start, pose)
        for _ in range(cfg.probes):
            small = _perturb(gt, rng, rng.uniform(0, cfg.good_rot_deg), rng.uniform(0, cfg.good_trans_diameters) * d)
            poses.append(("gone" if v < GONE_BELOW else ("good" if v >= SEEN_ABOVE else "partial"), start, small))
            for _attempt in range(20):  # a near miss must be wrong: ADD >= 0.1 d
                near = _perturb(gt, rng, rng.uniform(0, 30), rng.uniform(0, 0.3) * d)
                if _add(near, gt, points) >= 0.1 * d:
                    poses.append(("near_miss", start, near))
                    break
            poses.append(("far", start, _perturb(gt, rng, rng.uniform(30, 180), rng.uniform(0.3, 1.5) * d)))
        poses.append(("stale", start, start))
        if estimator is not None and cfg.estimator_every and i % cfg.estimator_every == 0:
            begin = _perturb(start, rng, rng.uniform(0, cfg.good_rot_deg), rng.uniform(0, cfg.good_trans_diameters) * d)
            result = estimator.track(obj, f.rgb, f.depth, scenario.K, begin, prev_frame="centred")
            poses.append(("estimator", begin, result.cam_from_centred))
        teleport = i in _teleports(scenario)  # the step itself is a jump: no smooth-tracking sample
        for kind, begin, pose in poses:
            err = _add(pose, gt, points)
            label = _label(v, err, d)
            if teleport and label == "good":
                kind, label = "teleport", "partial"  # correct, but after a jump: reported on its own
            out.append({"scenario": scenario.name, "frame": i, "kind": kind, "label": label,
                        "start": begin, "pose": pose, "add_m": err})
        if progress is not None:
            progress.update(1)
    return out


def _measure(samples: list[dict[str, Any]], scenario: Scenario, judge: FrameJudge, tolerances: tuple[float, ...]
             ) -> dict[float, np.ndarray]:
    """(n, M) measurements of one scenario's samples per depth tolerance (each frame filtered once, one batch)."""
    out = {tol: np.zeros((len(samples), len(MEASUREMENTS)), np.float32) for tol in tolerances}
    by_frame: dict[int, list[int]] = {}
    for k, s in enumerate(samples):
        by_frame.setdefault(s["frame"], []).append(k)
    for frame, idx in by_frame.items():
        depth_f = judge.filtered_depth(scenario.frames[frame].depth).expand(len(idx), -1, -1)
        K = torch.as_tensor(scenario.K)[None].expand(len(idx), 3, 3)
        start = torch.as_tensor(np.stack([samples[k]["start"] for k in idx]))
        pose = torch.as_tensor(np.stack([samples[k]["pose"] for k in idx]))
        for tol in tolerances:
            config = ValidityConfig(depth_tolerance_diameters=tol)
            out[tol][idx] = measure_validity(depth_f, K, start, pose, judge.model, config).numpy()
    return out


def _floor2(x: float) -> float:
    return math.floor(x * 100 + 1e-9) / 100


def _pick_fractions(m: np.ndarray, good: np.ndarray, target: float) -> tuple[float, float, float]:
    """(min_support, min_consistent, false alarm on good): the largest quantiles of the good samples, rounded
    down to 0.01 (at least 0.01: ValidityConfig's range), whose false alarms stay at or below ``target``; the
    lowest ones (and their false alarms, above the target) when none does."""
    for q in np.arange(target, -1e-9, -target / 20):
        support = max(0.01, _floor2(float(np.quantile(m[good, _SUPPORT], q))))
        consistent = max(0.01, _floor2(float(np.quantile(m[good, _CONSISTENT], q))))
        false_alarm = float(((m[good, _SUPPORT] < support) | (m[good, _CONSISTENT] < consistent)).mean())
        if false_alarm <= target:
            break
    return support, consistent, false_alarm


def _teleports(scenario: Scenario) -> set[int]:
    """Frames reached by a jump: the jump scenario's, and the first frames back in view after the object was gone."""
    frames = scenario.frames
    out = {i for i in range(1, len(frames)) if frames[i - 1].visible_fraction < SEEN_ABOVE}
    if "jump" in scenario.events:
        out.add(scenario.events["jump"])
    return out


def _step_motion(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(metres, degrees) between two (4, 4) poses."""
    cos = (np.trace(b[:3, :3] @ a[:3, :3].T) - 1) / 2
    return float(np.linalg.norm(b[:3, 3] - a[:3, 3])), math.degrees(math.acos(min(1.0, max(-1.0, cos))))


def _motion(scenarios: list[Scenario]) -> dict[str, float]:
    """The largest ground-truth motion between consecutive frames of the smooth scenarios (:data:`_SMOOTH`: the
    object moves on the smooth trajectory), and the jump's."""
    steps = [_step_motion(sc.frames[i - 1].cam_from_centred, sc.frames[i].cam_from_centred)
             for sc in scenarios if sc.name in _SMOOTH for i in range(1, len(sc.frames))]
    out = {"max_translation_m_per_frame": max(t for t, _ in steps), "max_rotation_deg_per_frame": max(r for _, r in steps)}
    for sc in scenarios:
        if sc.name == "jump":
            at = sc.events["jump"]
            out["jump_translation_m"], out["jump_rotation_deg"] = _step_motion(
                sc.frames[at - 1].cam_from_centred, sc.frames[at].cam_from_centred)
    return out


@dataclass(slots=True, eq=False)
class Collected:
    """Every sample of one object: labels / kinds (n,), measurements per tolerance (n, M), the motion figures."""

    name: str
    labels: np.ndarray
    kinds: np.ndarray
    measured: dict[float, np.ndarray]
    motion: dict[str, float]
    estimator_add_m: np.ndarray


def collect(obj: ObjectModel, renderer: Renderer, distractor: ObjectModel, cfg: CalibrationConfig,
            estimator: PoseEstimator | None = None, progress=None) -> Collected:
    """Generate the scenarios of one object, draw the probe (and estimator) samples and measure them."""
    rng = np.random.default_rng(cfg.seed)
    from foundationpose.demo.metrics import model_points

    # the metric points in the centred frame (the poses here are cam_from_centred)
    points = model_points(obj.mesh).points @ obj.centred_from_mesh[:3, :3].T + obj.centred_from_mesh[:3, 3]
    judge = FrameJudge(obj)
    seeds = scenario_seeds("calibrate", cfg.seed)
    scenarios = [make_scenario(name, obj, renderer, frames=cfg.frames, hw=cfg.hw, seed=seeds[name],
                               distractor=distractor) for name in SCENARIOS]
    samples = {sc.name: _samples(sc, obj, points, cfg, rng, estimator, progress) for sc in scenarios}
    flat = [s for sc in scenarios for s in samples[sc.name]]
    per_scenario = [_measure(samples[sc.name], sc, judge, cfg.tolerances) for sc in scenarios]
    measured = {tol: np.concatenate([m[tol] for m in per_scenario]) for tol in cfg.tolerances}
    return Collected(name=obj.name, labels=np.array([s["label"] for s in flat]),
                     kinds=np.array([s["kind"] for s in flat]), measured=measured, motion=_motion(scenarios),
                     estimator_add_m=np.array([s["add_m"] for s in flat if s["kind"] == "estimator"]))


def choose(collected: list[Collected], cfg: CalibrationConfig) -> tuple[ValidityConfig, list[dict[str, Any]]]:
    """The thresholds (module docstring) from the probe samples of one or several objects pooled."""
    labels = np.concatenate([c.labels for c in collected])
    probe = np.concatenate([c.kinds for c in collected]) != "estimator"
    good, bad = (labels == "good") & probe, (labels == "bad") & probe
    per_tolerance = []
    for tol in cfg.tolerances:
        m = np.concatenate([c.measured[tol] for c in collected])
        support, consistent, false_alarm = _pick_fractions(m, good, cfg.target_false_alarm)
        caught = (m[bad, _SUPPORT] < support) | (m[bad, _CONSISTENT] < consistent)
        per_tolerance.append({"depth_tolerance_diameters": tol, "min_support": support, "min_consistent": consistent,
                              "false_alarm_on_good": round(false_alarm, 4),
                              "detection_of_bad": round(float(caught.mean()), 4)})
    best = max(per_tolerance, key=lambda r: (r["detection_of_bad"], -r["depth_tolerance_diameters"]))
    max_t = max(c.motion["max_translation_m_per_frame"] for c in collected) * cfg.motion_margin
    max_r = max(c.motion["max_rotation_deg_per_frame"] for c in collected) * cfg.motion_margin
    chosen = ValidityConfig(depth_tolerance_diameters=best["depth_tolerance_diameters"],
                            min_support=best["min_support"], min_consistent=best["min_consistent"],
                            max_translation_m=math.ceil(max_t * 1000) / 1000, max_rotation_deg=float(math.ceil(max_r)))
    return chosen, per_tolerance


def judged(collected: Collected, config: ValidityConfig) -> dict[str, Any]:
    """How ``config`` judges one object's samples: false alarms on good probes, detection of bad ones, by kind."""
    m = torch.as_tensor(collected.measured[config.depth_tolerance_diameters])
    confidence, valid = (t.numpy() for t in judge_validity(m, config))
    labels, kinds = collected.labels, collected.kinds
    probe = kinds != "estimator"
    good, bad = (labels == "good") & probe, (labels == "bad") & probe
    by_kind = {}
    for kind in ("good", "partial", "teleport", "gone", "near_miss", "far", "stale", "estimator"):
        sel = kinds == kind
        if sel.any():
            by_kind[kind] = {"samples": int(sel.sum()), "labelled_good": int((labels[sel] == "good").sum()),
                             "labelled_bad": int((labels[sel] == "bad").sum()),
                             "judged_valid": round(float(valid[sel].mean()), 4),
                             "median_support": round(float(np.median(m[sel, _SUPPORT])), 3),
                             "median_consistent": round(float(np.median(m[sel, _CONSISTENT])), 3)}
    est = kinds == "estimator"
    return {
        "false_alarm_on_good": round(float((~valid[good]).mean()), 4),
        "detection_of_bad": round(float((~valid[bad]).mean()), 4),
        "bad_judged_valid": int(valid[bad].sum()),
        "mean_confidence": {"good": round(float(confidence[good].mean()), 3),
                            "bad": round(float(confidence[bad].mean()), 3)},
        "samples": {"good": int(good.sum()), "bad": int(bad.sum()), "total": len(labels)},
        "by_kind": by_kind,
        "motion": collected.motion,
        "estimator": None if not est.any() else {
            "samples": int(est.sum()), "labelled_good": int((labels[est] == "good").sum()),
            "valid_and_good": int((valid[est] & (labels[est] == "good")).sum()),
            "valid_and_bad": int((valid[est] & (labels[est] == "bad")).sum()),
            "median_add_m": float(np.median(collected.estimator_add_m))},
    }
