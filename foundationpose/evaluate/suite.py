"""The object suite's evaluation: per object, trained weights (or cached ones), register, track and scenarios.

For each object of :mod:`foundationpose.synthetic.objects`:

1. weights: trained for that object (:class:`foundationpose.train.loop.Trainer`; :func:`train_objects` runs several
   at once, each in its own process) into
   ``CACHE/<name>-<key>/``, where ``key`` hashes the mesh file's bytes and every training setting; a folder whose
   training finished (its ``train_summary.json`` written) is reused, an interrupted one resumes;
2. register: held-out synthetic views (:func:`foundationpose.evaluate.runs.evaluate_views`, never a training
   seed), each registered from scratch;
3. track and scenarios: the robustness scenarios (:func:`foundationpose.evaluate.scenarios.run_scenarios`); the
   ``clean`` one, registered on its first frame and tracked to its last, gives the track figures.

Symmetries: the object's are detected from its geometry (:func:`foundationpose.symmetry_detect.detect_symmetries`)
and only the real ones (not broken by the texture) are declared; every object of the suite breaks its
near-symmetries by a detail or by its print, so none is expected, and a pose is judged by its ADD under the real
symmetries: plain ADD, orientation counts. Figures (:data:`DEFINITIONS`):

* register success: ADD under the real symmetries < 0.1 diameter; ADD and ADD-S statistics over the views;
* flip: a pose whose rotation is more than 90 degrees wrong while its ADD-S is below 0.05 diameter (the shape
  fits), and that is no success (no real symmetry excuses it): the object is the wrong way round; the flip rate
  is over the poses given;
* track: ADD, ADD-S and the flip rate over the frames of the clean scenario that have a pose;
* scenarios: per scenario the figures of :func:`~foundationpose.evaluate.scenarios.scenario_metrics` that judge
  trust (false alarms, loss detection, silent failures, recovery), and ``valid_flip_frames``: frames reported
  valid whose pose is a flip.

:func:`summarise` pools the objects per split and overall: rates as pooled counts (every view or frame weighs the
same), ADD as the mean of the objects' means.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import multiprocessing
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from foundationpose.estimator import PoseEstimator
from foundationpose.evaluate.flip_views import LOOK_ALIKE_NCC, look_alike_ncc
from foundationpose.evaluate.runs import evaluate_views
from foundationpose.evaluate.scenarios import SEED_STREAMS, run_scenarios, scenario_seeds
from foundationpose.mesh import ObjectModel
from foundationpose.surface import SurfaceSamples
from foundationpose.synthetic.objects import SPLITS, SuiteObject
from foundationpose.synthetic.scenarios import DEFAULT_FRAMES, SCENARIOS, demo_intrinsics
from foundationpose.synthetic.sensor import SensorColourConfig, SensorDepthConfig
from foundationpose.train.config import TrainConfig
from foundationpose.train.loop import SUMMARY_FILE
from foundationpose.train.scorer_ranking import RankingConfig
from foundationpose.validity import ValidityConfig

__all__ = ["DEFINITIONS", "FLIP_ADDS_DIAMETERS", "FLIP_ROTATION_DEG", "SUITE_FILE", "SUCCESS_DIAMETERS",
           "SuiteEvaluation", "SuiteTraining", "evaluate_object", "is_flip", "is_success", "register_figures", "scenario_figures",
           "summarise", "track_figures", "train_objects", "trained_weights", "valid_flip_causes", "weights_dir"]

logger = logging.getLogger(__name__)

SUITE_FILE = "suite.json"
SUCCESS_DIAMETERS = 0.1
FLIP_ROTATION_DEG = 90.0
FLIP_ADDS_DIAMETERS = 0.05
DEFINITIONS = {
    "success": f"ADD under the object's real symmetries < {SUCCESS_DIAMETERS} diameter (real: found in its geometry, "
               "not broken by its texture; with none, plain ADD: the orientation counts)",
    "flip": f"rotation error > {FLIP_ROTATION_DEG:g} deg while ADD-S < {FLIP_ADDS_DIAMETERS} diameter, and no "
            "success: the shape fits, the object is the wrong way round",
    "flip_rate": "flips / poses given (register: views with a pose; track: clean-scenario frames with a pose)",
    "track": "the clean scenario: registered on its first frame (client mask), tracked to its last",
    "valid_flip_frames": "scenario frames reported valid whose pose is a flip",
    "valid_flip_look_alike": f"of those, frames whose estimate's clean render correlates with the truth's at >= "
                             f"{LOOK_ALIKE_NCC} (appearance correlation): no print shows the flip from that view",
    "valid_flip_unjudged": "of the rest, frames whose appearance was not judged (too few cells or too little contrast)",
    "valid_flip_missed": "of the rest, frames whose appearance was judged and passed: the validity's misses",
    "refiner_misses": "register views where no refined hypothesis had plain ADD < 0.1 diameter",
    "scorer_misses": "register views where a refined hypothesis had plain ADD < 0.1 diameter and the pick failed",
    "pick_within_rate": "register views whose scorer's pick had plain ADD < 0.1 diameter (the oracle's criterion)",
    "pick_within_rate_by_iterations": "the same for the scorer's pick when each view is registered again with "
                                      "fewer refine iterations (by count)",
    "pooled": "split and overall rates are pooled counts; ADD figures are the mean of the objects' means",
}
_VALID_FLIP_KEYS = ("valid_flip_frames", "valid_flip_look_alike", "valid_flip_unjudged", "valid_flip_missed")
_SCENARIO_KEYS = ("frames", "good_frames", "false_alarms", "false_alarm_rate", "loss_detection_rate",
                  "silent_failures", "recovery_rate_1s", "unobserved_recoveries", "reported_valid_frames")


@dataclass(frozen=True, slots=True, kw_only=True)
class SuiteTraining:
    """How each object's weights are trained (the defaults of ``python -m foundationpose.train`` where not
    named). minutes / steps: the budget (whichever ends first); device: auto, cpu or cuda."""

    minutes: float = 7.0
    steps: int | None = None
    seed: int = 0
    batch: int = 128
    crop_size: int = 160
    frame_hw: tuple[int, int] = (256, 320)
    scorer_sets: int = 4
    set_size: int = 16
    device: str = "auto"
    renderer: str = "auto"

    def train_config(self, mesh: Path, out_dir: Path) -> TrainConfig:
        """The training run of one object."""
        per_scene = next(n for n in (4, 2, 1) if self.batch % n == 0)
        return TrainConfig(mesh=mesh, out_dir=out_dir, minutes=self.minutes, steps=self.steps, seed=self.seed,
                           device=self.device, renderer=self.renderer, refiner_batch=self.batch,
                           hypotheses_per_scene=per_scene, crop_size=self.crop_size, frame_hw=self.frame_hw,
                           scorer_sets=self.scorer_sets, ranking=RankingConfig(set_size=self.set_size),
                           progress=False)

    def key(self, mesh_bytes: bytes) -> str:
        """16 hex digits naming the weights of this mesh trained with these settings."""
        text = json.dumps(dataclasses.asdict(self), sort_keys=True, default=list)
        return hashlib.sha256(hashlib.sha256(mesh_bytes).digest() + text.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True, kw_only=True)
class SuiteEvaluation:
    """What is measured per object: ``views`` held-out register views (seed ``view_seed``), the ``scenarios``
    (``frames`` each, first seed ``scenario_seed`` of the scenarios stream) at image size ``hw`` with the demo
    intrinsics scaled to it, sensor-like depth and colour."""

    views: int = 50
    view_seed: int = 0
    scenarios: tuple[str, ...] = SCENARIOS
    frames: int = DEFAULT_FRAMES
    hw: tuple[int, int] = (480, 640)
    scenario_seed: int = SEED_STREAMS["scenarios"][0]
    # each view registered again with these refine iterations (those below the estimator's): their accuracy
    fewer_register_iterations: tuple[int, ...] = (3,)

    def __post_init__(self) -> None:
        if self.views < 1:
            raise ValueError(f"views must be >= 1, got {self.views}")
        if any(k < 1 for k in self.fewer_register_iterations):
            raise ValueError(f"fewer_register_iterations must be >= 1, got {list(self.fewer_register_iterations)}")
        if "clean" not in self.scenarios:
            raise ValueError(f"the scenarios must include 'clean' (the track figures), got {list(self.scenarios)}")
        unknown = [s for s in self.scenarios if s not in SCENARIOS]
        if unknown:
            raise ValueError(f"scenarios must be among {', '.join(SCENARIOS)}, got {', '.join(unknown)}")


def weights_dir(name: str, mesh: Path, cache: Path, training: SuiteTraining) -> Path:
    """``cache/<name>-<key>``: the folder of ``name``'s weights trained on ``mesh`` with ``training``."""
    return cache / f"{name}-{training.key(mesh.read_bytes())}"


def trained_weights(name: str, mesh: Path, cache: Path, training: SuiteTraining) -> tuple[Path, dict[str, Any]]:
    """The weights folder of ``name`` trained on ``mesh`` with ``training``, trained now unless the cache holds a
    finished run; returns it and ``{"key", "dir", "reused", "summary"}`` (the training summary)."""
    from foundationpose.train.loop import Trainer

    out = weights_dir(name, mesh, cache, training)
    key = out.name.removeprefix(f"{name}-")
    summary_file = out / SUMMARY_FILE
    reused = summary_file.is_file()
    if reused:
        logger.info("%s: cached weights %s", name, out)
    else:
        logger.info("%s: training %s (%s)", name, out,
                    f"{training.steps} steps or {training.minutes:g} min" if training.steps else f"{training.minutes:g} min")
        Trainer(training.train_config(mesh, out)).run()
    summary = json.loads(summary_file.read_text(encoding="utf-8"))
    return out, {"key": key, "dir": str(out), "reused": reused, "summary": summary}


def _train_timed(name: str, mesh: Path, cache: Path, training: SuiteTraining,
                 log_level: int | None = None) -> tuple[Path, dict[str, Any], float]:
    """:func:`trained_weights` and its seconds; ``log_level``: a worker process's logging (its root has none)."""
    if log_level is not None and not logging.getLogger().handlers:
        logging.basicConfig(level=log_level, format=f"%(asctime)s {name} %(name)s: %(message)s")
    began = time.perf_counter()
    weights, info = trained_weights(name, mesh, cache, training)
    return weights, info, time.perf_counter() - began


def _train_in_worker(name: str, mesh: Path, cache: Path, training: SuiteTraining,
                     log_level: int) -> tuple[Path, dict[str, Any], float]:
    """:func:`_train_timed` in a worker process; a failure comes back as a RuntimeError carrying the original's type
    and message (the project's errors take other arguments than their message, so they do not unpickle)."""
    try:
        return _train_timed(name, mesh, cache, training, log_level)
    except Exception as exc:
        raise RuntimeError(f"{type(exc).__name__}: {exc}") from None


def train_objects(meshes: Mapping[str, Path], cache: Path, training: SuiteTraining,
                  jobs: int = 1) -> dict[str, tuple[Path, dict[str, Any], float]]:
    """Every object's weights (:func:`trained_weights`), ``jobs`` objects at once: in this process when 1, else
    each in its own process sharing the device. Finished weights in the cache are reused here, no process started.
    Returns ``name -> (weights, info, seconds)`` in ``meshes``' order.

    The minutes of the budget are wall-clock minutes, so objects trained at once share the device within them.
    A failed training stops the others and raises naming its object."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    done: dict[str, tuple[Path, dict[str, Any], float]] = {}
    to_train = []
    for name, mesh in meshes.items():
        if (weights_dir(name, mesh, cache, training) / SUMMARY_FILE).is_file():
            done[name] = _train_timed(name, mesh, cache, training)  # finished: read back
        else:
            to_train.append(name)
    workers = min(jobs, len(to_train))
    if workers <= 1:
        for index, name in enumerate(to_train, start=1):
            logger.info("[%d/%d] weights of %s", index, len(to_train), name)
            try:
                done[name] = _train_timed(name, meshes[name], cache, training)
            except Exception as exc:
                raise RuntimeError(f"training the weights of {name} failed: {exc}") from exc
        return {name: done[name] for name in meshes}
    level = logging.getLogger().getEffectiveLevel()
    spawn = multiprocessing.get_context("spawn")  # a fresh CUDA context per worker
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=spawn) as pool:
        futures = {pool.submit(_train_in_worker, name, meshes[name], cache, training, level): name
                   for name in to_train}
        logger.info("weights of %d objects, %d at once", len(to_train), workers)
        for finished, future in enumerate(concurrent.futures.as_completed(futures), start=1):
            name = futures[future]
            try:
                done[name] = future.result()
            except Exception as exc:
                pool.shutdown(cancel_futures=True)
                raise RuntimeError(f"training the weights of {name} failed: {exc}") from exc
            logger.info("weights of %s ready (%.0f s), %d of %d", name, done[name][2], finished, len(futures))
    return {name: done[name] for name in meshes}


def is_success(row: Mapping[str, Any], diameter: float) -> bool:
    """ADD under the real symmetries (``add_sym_m``) below 0.1 diameter."""
    return row.get("add_sym_m") is not None and row["add_sym_m"] < SUCCESS_DIAMETERS * diameter


def is_flip(row: Mapping[str, Any], diameter: float) -> bool:
    """The module docstring's flip: rotation error > 90 degrees with ADD-S < 0.05 diameter, and no success."""
    return (row.get("rot_deg") is not None and row.get("adds_m") is not None and row["rot_deg"] > FLIP_ROTATION_DEG
            and row["adds_m"] < FLIP_ADDS_DIAMETERS * diameter and not is_success(row, diameter))


def _stats(values: Iterable[float]) -> dict[str, float] | None:
    arr = np.asarray(list(values), dtype=np.float64)
    if arr.size == 0:
        return None
    return {"mean": float(arr.mean()), "median": float(np.median(arr)), "max": float(arr.max())}


def _pose_figures(posed: list[dict[str, Any]], total: int, diameter: float) -> dict[str, Any]:
    """Success, flips and error statistics of the rows that have a pose, out of ``total``."""
    successes = int(sum(is_success(r, diameter) for r in posed))
    flips = int(sum(is_flip(r, diameter) for r in posed))
    return {"posed": len(posed), "successes": successes, "success_rate": successes / total if total else None,
            "flips": flips, "flip_rate": flips / len(posed) if posed else None,
            "add_m": _stats(r["add_m"] for r in posed), "adds_m": _stats(r["adds_m"] for r in posed),
            "rot_deg": _stats(r["rot_deg"] for r in posed)}


def register_figures(views: dict[str, Any], diameter: float) -> dict[str, Any]:
    """The register figures of an :func:`~foundationpose.evaluate.runs.evaluate_views` report (a view without a
    pose counts as a miss)."""
    posed = [r for r in views["per_view"] if "add_m" in r]
    return {"views": views["frames"], "failed_inputs": views["frames"] - len(posed)} | _pose_figures(
        posed, views["frames"], diameter) | {"candidates": views["candidates"]}


def track_figures(rows: list[dict[str, Any]], diameter: float) -> dict[str, Any]:
    """The track figures of the clean scenario's rows (:func:`~foundationpose.evaluate.scenarios.run_scenario`; a
    frame without a pose counts as a miss)."""
    return {"frames": len(rows)} | _pose_figures([r for r in rows if r["add_m"] is not None], len(rows), diameter)


def scenario_figures(report: dict[str, Any], obj: ObjectModel, K: np.ndarray, hw: tuple[int, int]) -> dict[str, Any]:
    """The trust figures of one scenario of :func:`~foundationpose.evaluate.scenarios.run_scenarios`, its
    ``valid_flip_frames`` and why each passed (:func:`valid_flip_causes`)."""
    flipped = [r for r in report["per_frame"] if r["pose_valid"] and is_flip(r, obj.diameter)]
    return ({k: report[k] for k in _SCENARIO_KEYS} | {"valid_flip_frames": len(flipped)}
            | valid_flip_causes(flipped, obj, K, hw))


def valid_flip_causes(rows: list[dict[str, Any]], obj: ObjectModel, K: np.ndarray, hw: tuple[int, int]) -> dict[str, int]:
    """Why flipped frames (scenario rows) were reported valid, each counted once, in this order:

    * ``valid_flip_look_alike``: the estimate's clean render looks like the truth's from that view
      (:func:`~foundationpose.evaluate.flip_views.look_alike_ncc` at least ``LOOK_ALIKE_NCC``): no print shows
      the flip there;
    * ``valid_flip_unjudged``: the appearance was not judged (too few compared cells or too little contrast);
    * ``valid_flip_missed``: judged, and its correlation passed the threshold: the validity's misses."""
    cfg = obj.validity or ValidityConfig()
    causes = {"valid_flip_look_alike": 0, "valid_flip_unjudged": 0, "valid_flip_missed": 0}
    if not rows:
        return causes
    mesh_from_centred = np.linalg.inv(obj.centred_from_mesh)
    est = np.stack([np.asarray(r["cam_from_mesh"]) @ mesh_from_centred for r in rows])
    truth = np.stack([np.asarray(r["gt_cam_from_mesh"]) @ mesh_from_centred for r in rows])
    alike = look_alike_ncc(obj, K, hw, est, truth, cfg) >= LOOK_ALIKE_NCC
    for row, same_look in zip(rows, alike, strict=True):
        m = row["measurements"]
        judged = m["appearance_cells"] >= cfg.min_appearance_cells and m["texture_contrast"] >= cfg.min_texture_contrast
        key = "look_alike" if same_look else "missed" if judged else "unjudged"
        causes[f"valid_flip_{key}"] += 1
    return causes


def evaluate_object(estimator: PoseEstimator, obj: ObjectModel, points: SurfaceSamples, distractor: ObjectModel,
                    evaluation: SuiteEvaluation, progress=None) -> dict[str, Any]:
    """Register, track and scenario figures of one object, judged under its declared symmetries (``obj.symmetry``:
    the real ones)."""
    K = demo_intrinsics(evaluation.hw)
    fewer = [k for k in evaluation.fewer_register_iterations if k < estimator.config.register_iterations]
    views = evaluate_views(estimator, obj, evaluation.views, evaluation.view_seed, None, points=points, K=K,
                           hw=evaluation.hw, overlays=0, fewer_iterations=fewer, progress=progress)
    seeds = scenario_seeds("scenarios", evaluation.scenario_seed, evaluation.scenarios)
    scenarios = run_scenarios(estimator, obj, seeds, points_mesh=points.points, distractor=distractor,
                              frames=evaluation.frames, hw=evaluation.hw, depth=SensorDepthConfig(),
                              colour=SensorColourConfig(), progress=progress)
    return {"register": register_figures(views, obj.diameter),
            "track": track_figures(scenarios["clean"]["per_frame"], obj.diameter),
            "scenarios": {name: scenario_figures(s, obj, K, evaluation.hw) for name, s in scenarios.items()}}


def _pooled(objects: list[dict[str, Any]], part: str) -> dict[str, Any]:
    count = "views" if part == "register" else "frames"
    total = sum(o[part][count] for o in objects)
    posed = sum(o[part]["posed"] for o in objects)
    flips = sum(o[part]["flips"] for o in objects)
    means = [o[part]["add_m"]["mean"] for o in objects if o[part]["add_m"] is not None]
    adds = [o[part]["adds_m"]["mean"] for o in objects if o[part]["adds_m"] is not None]
    return {count: total, "success_rate": sum(o[part]["successes"] for o in objects) / total if total else None,
            "flip_rate": flips / posed if posed else None, "flips": flips,
            "add_m_mean": float(np.mean(means)) if means else None,
            "adds_m_mean": float(np.mean(adds)) if adds else None}


def _pick_what_if(figures: list[dict[str, Any]]) -> dict[str, Any]:
    """The scorer's pick on the oracle's criterion and its what-if with fewer refine iterations
    (``evaluate.runs.candidate_summary``) pooled over the objects' views; empty when an object's report lacks them."""
    rows = [(f["register"]["views"], f["register"]["candidates"]) for f in figures]
    total = sum(n for n, _ in rows)
    if not total or not all("pick_within_rate" in c for _, c in rows):
        return {}
    out: dict[str, Any] = {"pick_within_rate": sum(n * c["pick_within_rate"] for n, c in rows) / total}
    field = "pick_within_rate_by_iterations"
    if all(field in c for _, c in rows):
        out[field] = {k: sum(n * c[field][k] for n, c in rows) / total for k in rows[0][1][field]}
    return out


def summarise(per_object: dict[str, dict[str, Any]], objects: Iterable[SuiteObject]) -> dict[str, Any]:
    """Per split present and ``overall``: the objects, pooled register / track figures and summed scenario
    counts (silent failures, valid flip frames, false alarms)."""
    split_of = {o.name: o.split for o in objects}
    groups = {split: [n for n in per_object if split_of[n] == split] for split in SPLITS}
    groups = {k: v for k, v in groups.items() if v} | {"overall": list(per_object)}
    out: dict[str, Any] = {}
    for label, names in groups.items():
        figures = [per_object[n] for n in names]
        scenarios = [s for f in figures for s in f["scenarios"].values()]
        # whose register misses: no refined hypothesis within 0.1 d (refiner) or one was, not picked (scorer)
        misses = {key: sum(f["register"]["candidates"][key] for f in figures) for key in ("refiner_misses", "scorer_misses")}
        out[label] = {"objects": names, "register": _pooled(figures, "register") | misses | _pick_what_if(figures),
                      "track": _pooled(figures, "track"),
                      "scenarios": {"silent_failures": sum(s["silent_failures"] for s in scenarios),
                                    **{k: sum(s[k] for s in scenarios) for k in _VALID_FLIP_KEYS},
                                    "false_alarms": sum(s["false_alarms"] for s in scenarios),
                                    "reported_valid_frames": sum(s["reported_valid_frames"] for s in scenarios)}}
    return out
