"""Command line of ``python -m foundationpose.evaluate`` (four commands).

``python -m foundationpose.evaluate [options]``: accuracy. Registers the first frame of a recorded sequence with
ground truth and tracks the rest (default: the bundled sequence, given sensor-like depth), then registers
``--views`` held-out synthetic views, and prints one JSON object (also written to ``OUT/eval.json``)::

    {"weights": ..., "random_weights": false, "object": {...}, "symmetry": ...,
     "model_points": {"kind": "uniform surface samples (area-weighted)", "count": 2000, "seed": 0},
     "sequence": {"depth": {"kind": "sensor", ...}, "frames", "add_m": {mean, median, max}, "adds_m", "add_sym_m",
                  "rot_deg", "trans_m", "success_rate", "states", "per_frame": [{errors, cam_from_mesh,
                  gt_cam_from_mesh, state, confidence, pose_valid}, ...]},
     "views": {"frames", "seeds", "register_success_rate", "add_m", ..., "candidates": {...}, "per_view": [...]},
     "wall_s": ...}

``python -m foundationpose.evaluate scenarios [options]``: robustness. Runs a tracking session (validity, states,
automatic recovery) through the synthetic scenarios (clean, occluder, leave, jump, distractor; 64 frames each by
default, so that every recovery has its 1 s window) and reports, per scenario, false alarms, loss-detection delay,
silent failures, recovery rate and time (events the scenario ends too early to judge: unobserved, counted apart),
ADD on valid frames and the ROC of the confidence (``OUT/scenarios.json``). Its scenario seeds come from the
``scenarios`` stream, disjoint from the calibration's (:data:`foundationpose.evaluate.scenarios.SEED_STREAMS`).

``python -m foundationpose.evaluate suite [options]``: the object suite (:mod:`foundationpose.synthetic.objects`):
trains every object's weights first (or reuses cached ones; ``--train-only`` stops there), then reports per object
and per split (tune / held_out) and overall: register success (ADD < 0.1 diameter: orientation counts), track ADD
and ADD-S, the flip rate and the scenario figures (``OUT/suite.json``, written again after each object;
:mod:`foundationpose.evaluate.suite`).

``python -m foundationpose.evaluate calibrate [options]``: chooses the validity thresholds from measurements on
the scenarios of the ``calibrate`` seed stream (``OUT/calibration.json``; docs/tracking.md records a run).

Errors of this package are printed as ``TypeName: message`` with exit status 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deploy_core.errors import DeployError
from foundationpose.demo.dataset import BUNDLED_SEQUENCE_DIR
from foundationpose.errors import InputError, PoseError
from foundationpose.runtime import PRECISIONS
from foundationpose.runtime_options import add_runtime_options, runtime_from_options
from foundationpose.symmetry import add_symmetry_options, symmetries_of_options

if TYPE_CHECKING:
    from foundationpose.validity import ValidityConfig

__all__ = ["build_calibrate_parser", "build_parser", "build_scenarios_parser", "build_suite_parser", "main"]

DEFAULT_DATA_DIR = BUNDLED_SEQUENCE_DIR
EVAL_FILE, SCENARIOS_FILE, CALIBRATION_FILE = "eval.json", "scenarios.json", "calibration.json"
logger = logging.getLogger(__name__)



def _estimator_options(p: argparse.ArgumentParser, hypotheses: int = 252, compare: bool = False) -> None:
    add_runtime_options(p, precision_list=compare)  # compare: the accuracy run compares precisions on the same data
    p.add_argument("--hypotheses", type=int, default=hypotheses, help=f"register hypotheses (default: {hypotheses})")
    p.add_argument("--register-iterations", type=int, default=5, help="default: 5")
    p.add_argument("--track-iterations", type=int, default=2, help="default: 2")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m foundationpose.evaluate",
        description="Accuracy of weights: register + track a recorded sequence with ground truth, and register "
        "held-out synthetic views; prints JSON (ADD, ADD-S, rotation / translation errors, success rate, drift, "
        "validity and session state per frame). Other commands: 'scenarios' (robustness), 'calibrate' (validity "
        "thresholds), 'suite' (the object suite: train and evaluate each object); see 'python -m foundationpose.evaluate scenarios --help'.",
    )
    p.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR, metavar="SEQ",
                   help="sequence folder with annotated_poses/ (default: the bundled sequence)")
    p.add_argument("--mesh", type=Path, default=None, metavar="FILE", help="object mesh (default: the sequence's)")
    p.add_argument("--depth", choices=("auto", "sensor", "as-recorded"), default="auto",
                   help="depth of the sequence: sensor = add sensor noise, holes, edge dropout and mm quantisation "
                   "(seeded by --seed); as-recorded = the files' depth; auto = sensor for the bundled sequence (a "
                   "noise-free render), as-recorded otherwise (default: auto)")
    p.add_argument("--views", type=int, default=100, metavar="N", help="held-out synthetic views (default: 100; 0 = none)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic views and of the sensor depth, in "
                   "[0, 2**62) (default: 0; the views never share a seed with training, whatever the seeds)")
    p.add_argument("--out", type=Path, default=Path("eval_out"), metavar="DIR", help="output folder (default: ./eval_out)")
    p.add_argument("--overlays", type=int, default=8, metavar="N", help="synthetic views written as overlays (default: 8)")
    p.add_argument("--no-sequence", action="store_true", help="skip the recorded sequence")
    p.add_argument("--max-frames", type=int, default=None, metavar="N", help="only the first N frames (default: all)")
    add_symmetry_options(p)
    _estimator_options(p, compare=True)
    return p


def build_scenarios_parser() -> argparse.ArgumentParser:
    from foundationpose.evaluate.scenarios import SEED_STREAMS
    from foundationpose.synthetic.scenarios import DEFAULT_FRAMES, EVENTS_END, MIN_FRAMES, SCENARIOS

    p = argparse.ArgumentParser(
        prog="python -m foundationpose.evaluate scenarios",
        description="Robustness: a tracking session (per-frame validity, states, automatic recovery) through "
        "synthetic scenarios with ground truth; per scenario: false alarms, loss-detection delay, silent failures, "
        "recovery rate and time, ADD on frames reported valid, ROC of the confidence. A pose is correct when its "
        "ADD under the object's declared symmetries is below 0.1 diameter.",
    )
    p.add_argument("--shape", choices=("L", "tee"), default="L",
                   help="procedural object (default: L, the bundled sequence's); the other is the distractor")
    p.add_argument("--mesh", type=Path, default=None, metavar="FILE", help="object mesh instead of --shape")
    p.add_argument("--scenario", action="append", choices=SCENARIOS, default=None,
                   help="scenario to run; repeat for several (default: all)")
    p.add_argument("--frames", type=int, default=DEFAULT_FRAMES,
                   help=f"frames per scenario, at least {MIN_FRAMES} (default: {DEFAULT_FRAMES}: the events end "
                   f"before frame {EVENTS_END}, then 1 s at 30 frames/s and a margin; with fewer, recoveries "
                   "whose 1 s window the scenario cuts off are reported as unobserved)")
    p.add_argument("--size", type=int, nargs=2, default=(480, 640), metavar=("H", "W"),
                   help="image size; the demo intrinsics are scaled to it (default: 480 640, the demo's)")
    lo, hi = SEED_STREAMS["scenarios"]
    p.add_argument("--seed", type=int, default=lo,
                   help=f"first scenario seed (trajectories and sensor effects; scenario k of "
                   f"{', '.join(SCENARIOS)} gets seed + k), in the scenarios stream [{lo}, {hi}) that no calibration "
                   f"uses (default: {lo})")
    p.add_argument("--exact-depth", action="store_true", help="noise-free depth instead of sensor-like depth")
    p.add_argument("--exact-colour", action="store_true", help="noise-free colour instead of sensor-like colour")
    p.add_argument("--no-recover", action="store_true", help="no automatic re-register when lost (track on)")
    p.add_argument("--calibration", type=Path, default=None, metavar="FILE",
                   help="validity thresholds from a calibration.json (its 'default'; default: the library's, "
                   "calibrated on scenario seeds 0-4); refused when its scenario seeds overlap this run's")
    p.add_argument("--out", type=Path, default=Path("eval_out"), metavar="DIR", help="output folder (default: ./eval_out)")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of the tables")
    add_symmetry_options(p)
    _estimator_options(p, hypotheses=42)
    return p


def build_suite_parser() -> argparse.ArgumentParser:
    from foundationpose.evaluate.scenarios import SEED_STREAMS
    from foundationpose.synthetic.objects import SPLITS, SUITE
    from foundationpose.synthetic.scenarios import DEFAULT_FRAMES, MIN_FRAMES, SCENARIOS

    p = argparse.ArgumentParser(
        prog="python -m foundationpose.evaluate suite",
        description="The object suite: textured real-object shapes whose near-symmetry only a detail or a print "
        "breaks. Trains each object's weights (or reuses them from --weights-cache), then reports per object, per "
        "split (tune / held_out) and overall: register success (ADD < 0.1 diameter: orientation counts), track ADD "
        "and ADD-S, the flip rate (rotation error > 90 deg while ADD-S < 0.05 diameter) and the scenario figures; "
        "writes OUT/suite.json after each object. Constants are chosen on the tune split only.",
    )
    p.add_argument("--objects", nargs="+", default=None, metavar="NAME",
                   help=f"objects to run (default: every one of the split: {', '.join(o.name for o in SUITE)})")
    p.add_argument("--split", choices=(*SPLITS, "all"), default="all", help="default: all")
    p.add_argument("--object-seed", type=int, default=0, help="the generator's colour and label seed (default: 0)")
    p.add_argument("--minutes", type=float, default=7.0, help="training budget per object, minutes (default: 7)")
    p.add_argument("--steps", type=int, default=None, help="optimiser-step budget per object (default: none)")
    p.add_argument("--batch", type=int, default=128, help="refiner hypotheses per training step (default: 128)")
    p.add_argument("--crop-size", type=int, default=160, help="training crop side; less only for smoke runs (default: 160)")
    p.add_argument("--frame-size", type=int, nargs=2, default=(256, 320), metavar=("H", "W"),
                   help="training observation size (default: 256 320)")
    p.add_argument("--scorer-sets", type=int, default=4, help="observations per scorer step (default: 4)")
    p.add_argument("--set-size", type=int, default=16, help="hypotheses per scorer set (default: 16)")
    p.add_argument("--train-seed", type=int, default=0, help="training seed (default: 0)")
    p.add_argument("--weights-cache", type=Path, default=None, metavar="DIR",
                   help="trained weights, one folder per object and training settings, reused when finished "
                   "(default: OUT/weights)")
    p.add_argument("--views", type=int, default=50, metavar="N", help="held-out register views per object (default: 50)")
    p.add_argument("--train-only", action="store_true",
                   help="train (or find in --weights-cache) every object's weights, then stop: the evaluation can "
                   "follow in another run with the same cache and training settings")
    p.add_argument("--seed", type=int, default=0, help="seed of the held-out views, in [0, 2**62) (default: 0)")
    p.add_argument("--scenario", action="append", choices=SCENARIOS, default=None,
                   help="scenario to run; repeat for several; clean is always run (the track figures) (default: all)")
    p.add_argument("--frames", type=int, default=DEFAULT_FRAMES,
                   help=f"frames per scenario, at least {MIN_FRAMES} (default: {DEFAULT_FRAMES})")
    p.add_argument("--size", type=int, nargs=2, default=(480, 640), metavar=("H", "W"),
                   help="image size of the views and scenarios; the demo intrinsics are scaled to it (default: 480 640)")
    lo, hi = SEED_STREAMS["scenarios"]
    p.add_argument("--scenario-seed", type=int, default=lo,
                   help=f"first scenario seed, in the scenarios stream [{lo}, {hi}) (default: {lo})")
    p.add_argument("--out", type=Path, default=Path("eval_out"), metavar="DIR", help="output folder (default: ./eval_out)")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of the tables")
    _estimator_options(p)
    for action in p._actions:  # --weights here: one folder for every object instead of training each
        if action.dest == "weights":
            action.help = ("evaluate these weights (official layout) on every object instead of training "
                           "(default: train each object)")
    return p


def build_calibrate_parser() -> argparse.ArgumentParser:
    from foundationpose.evaluate.scenarios import SEED_STREAMS

    p = argparse.ArgumentParser(
        prog="python -m foundationpose.evaluate calibrate",
        description="Choose the validity thresholds from measurements: probe poses of known quality (and the "
        "estimator's) on every frame of the synthetic scenarios, per object and pooled; writes calibration.json.",
    )
    p.add_argument("--shapes", nargs="+", choices=("L", "tee"), default=["L", "tee"],
                   help="procedural objects to calibrate (default: L tee)")
    p.add_argument("--frames", type=int, default=36,
                   help="frames per scenario (default: 36: every event happens before frame 26; calibration "
                   "measures each frame on its own, so it needs no observation window)")
    p.add_argument("--size", type=int, nargs=2, default=(480, 640), metavar=("H", "W"),
                   help="image size; the demo intrinsics are scaled to it (default: 480 640, the demo's)")
    lo, hi = SEED_STREAMS["calibrate"]
    p.add_argument("--seed", type=int, default=lo,
                   help=f"first scenario seed and probe seed, in the calibrate stream [{lo}, {hi}), disjoint from "
                   f"the scenarios evaluation's (default: {lo})")
    p.add_argument("--probes", type=int, default=4, help="probe poses of each kind per frame (default: 4)")
    p.add_argument("--target-false-alarm", type=float, default=0.01,
                   help="largest share of good poses judged invalid (default: 0.01)")
    p.add_argument("--no-estimator", action="store_true", help="probe poses only, no estimator samples")
    p.add_argument("--estimator-every", type=int, default=1, metavar="N",
                   help="one estimator track sample every N frames (default: 1)")
    p.add_argument("--out", type=Path, default=Path("eval_out"), metavar="DIR", help="output folder (default: ./eval_out)")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of the tables")
    _estimator_options(p, hypotheses=42)
    return p


def _create_estimator(args: argparse.Namespace, precision: str | None = None):
    from engines.files import engine_files  # an application: it wires the engines package in
    from foundationpose.estimator import EstimatorConfig, PoseEstimator

    try:
        runtime = runtime_from_options(args, precision=precision)
    except ValueError as exc:
        raise InputError("options", "a runtime this machine can run", str(exc)) from exc
    return PoseEstimator.create(
        runtime=runtime, engine_files=engine_files,
        config=EstimatorConfig(num_hypotheses=args.hypotheses, register_iterations=args.register_iterations,
                               track_iterations=args.track_iterations),
    )


def _check_weights(weights: Path | None) -> None:
    """The --weights folder as the estimator will need it, checked before any progress output: InputError naming
    --weights when it is missing, not a folder or lacks a run's checkpoint (None: random weights, nothing to check)."""
    from foundationpose.weights import CHECKPOINT_NAME, REFINER_RUN, SCORER_RUN

    if weights is None:
        return
    root = Path(weights).expanduser()
    expected = f"a weights folder in the official layout (<root>/<run>/{CHECKPOINT_NAME})"
    fix = "Give the folder that holds both runs, or leave --weights out for random weights"
    if not root.is_dir():
        raise InputError("--weights", expected, f"'{root}' ({'a file' if root.exists() else 'no such folder'})", fix)
    missing = [f"{run}/{CHECKPOINT_NAME}" for run in (REFINER_RUN, SCORER_RUN)
               if not (root / run / CHECKPOINT_NAME).is_file()]
    if missing:
        raise InputError("--weights", expected, f"'{root}' without {' and '.join(missing)}", fix)


def _check_start(args: argparse.Namespace, precisions: list[str]) -> None:
    """What the estimators' start-up would refuse, checked before the progress bar is drawn: the weights folder
    and the runtime of every precision (CUDA asked for without it, a precision the device cannot run)."""
    _check_weights(args.weights)
    for precision in precisions:
        try:
            runtime_from_options(args, precision=precision)
        except ValueError as exc:
            raise InputError("options", "a runtime this machine can run", str(exc)) from exc


def _progress(total: int, args: argparse.Namespace, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, file=sys.stderr, disable=args.no_progress, unit="frame", desc=desc)


def _machine() -> dict[str, Any]:
    import torch

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def _precisions(text: str | None) -> list[str]:
    precisions = [p.strip() for p in (text or "auto").split(",") if p.strip()]
    bad = [p for p in precisions if p not in PRECISIONS]
    if not precisions or bad or len(set(precisions)) != len(precisions):
        raise InputError("--precision", f"one of {', '.join(PRECISIONS)} or a comma list of distinct ones", repr(text))
    return precisions


def _accuracy(args: argparse.Namespace) -> int:
    from foundationpose.demo.dataset import RecordedSequence
    from foundationpose.demo.metrics import model_points
    from foundationpose.evaluate.runs import evaluate_sequence, evaluate_views
    from foundationpose.synthetic.sensor import SensorDepthConfig
    from foundationpose.train.scenes import DEMO_K

    if args.views < 0:
        raise InputError("--views", "a number of views >= 0", str(args.views))
    precisions = _precisions(args.precision)
    _check_start(args, precisions)  # before the bar: a bad --weights or --device fails with nothing drawn
    seq = None if args.no_sequence else RecordedSequence(args.data, max_frames=args.max_frames)
    mesh = args.mesh or (seq.mesh_path if seq is not None else None)
    if mesh is None:
        raise InputError("--mesh", "a mesh file (or a sequence with a mesh/ folder)", "none")
    sensor = args.depth == "sensor" or (args.depth == "auto" and Path(args.data).resolve() == BUNDLED_SEQUENCE_DIR)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    total = ((len(seq) if seq is not None else 0) + args.views) * len(precisions)
    bar = _progress(total, args, "evaluate")
    result: dict[str, Any] = {"weights": None if args.weights is None else str(args.weights)}
    by_precision: dict[str, dict[str, Any]] = {}
    try:
        for precision in precisions:  # the same --seed: the same sensor noise and views for every precision
            estimator = _create_estimator(args, precision)
            obj = estimator.load_object(mesh, symmetries=symmetries_of_options(args))
            symmetry = obj.symmetry
            points = model_points(obj.mesh)
            out = args.out if len(precisions) == 1 else args.out / precision
            section: dict[str, Any] = {
                "random_weights": bool(estimator.networks.random_weights), "device": str(estimator.device),
                "precision": estimator.networks.precision,
                "object": {"name": obj.name, "mesh": str(mesh), "diameter_m": obj.diameter},
                "symmetry": None if symmetry is None else symmetry.describe(), "model_points": points.describe(),
                "settings": {"hypotheses": args.hypotheses, "register_iterations": args.register_iterations,
                             "track_iterations": args.track_iterations, "views": args.views, "seed": args.seed}}
            if seq is not None:
                depth = SensorDepthConfig() if sensor else None
                section["sequence"] = {"data": str(args.data), "depth": depth.describe() | {"seed": args.seed}
                                       if depth else {"kind": "as-recorded"}}
                section["sequence"] |= evaluate_sequence(estimator, obj, seq, out / "sequence", points=points,
                                                         depth=depth, seed=args.seed, progress=bar)
            if args.views:
                K = seq.K if seq is not None else DEMO_K
                hw = seq.image_hw if seq is not None else (480, 640)
                section["views"] = {"depth": {"kind": "sensor (training's scene sampler, foundationpose.train.scenes)"}}
                section["views"] |= evaluate_views(estimator, obj, args.views, args.seed, out / "views", points=points,
                                                   K=K, hw=hw, overlays=args.overlays, progress=bar)
            by_precision[precision] = section
    finally:
        bar.close()
    if len(precisions) == 1:
        result |= by_precision[precisions[0]]  # one precision: the report as it always was
    else:
        from foundationpose.evaluate.precisions import compare_precisions

        result["by_precision"] = by_precision
        result["precision_comparison"] = compare_precisions(by_precision, baseline=precisions[0])
    result["wall_s"] = time.perf_counter() - start
    text = json.dumps(result, indent=2)
    (args.out / EVAL_FILE).write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


def _scenarios(args: argparse.Namespace) -> int:
    from foundationpose.demo.metrics import model_points
    from foundationpose.evaluate.report import scenario_tables
    from foundationpose.evaluate.scenarios import (
        DEFINITIONS,
        check_disjoint,
        run_scenarios,
        scenario_seeds,
        seed_range_text,
    )
    from foundationpose.mesh import load_object
    from foundationpose.synthetic.meshes import make_procedural_mesh
    from foundationpose.synthetic.scenarios import MIN_FRAMES, SCENARIOS
    from foundationpose.synthetic.sensor import SensorColourConfig, SensorDepthConfig

    names = [n for n in SCENARIOS if n in (args.scenario or SCENARIOS)]
    if args.frames < MIN_FRAMES:
        raise InputError("--frames", f"at least {MIN_FRAMES} frames per scenario", str(args.frames))
    seeds = scenario_seeds("scenarios", args.seed, names)
    validity, calibration = _calibration(args.calibration)
    check_disjoint(seeds.values(), calibration["scenario_seeds"], calibration["source"])
    calibration["scenario_seeds"] = seed_range_text(calibration["scenario_seeds"])
    args.out.mkdir(parents=True, exist_ok=True)
    estimator = _create_estimator(args)
    obj = (estimator.load_object(args.mesh, symmetries=symmetries_of_options(args)) if args.mesh is not None
           else load_object(make_procedural_mesh("textured_asym", shape=args.shape), device=estimator.device,
                            symmetries=symmetries_of_options(args)))
    other = "tee" if args.shape == "L" or args.mesh is not None else "L"
    distractor = load_object(make_procedural_mesh("textured_asym", shape=other), device=estimator.device)
    symmetry = obj.symmetry
    points = model_points(obj.mesh)
    obj = dataclasses.replace(obj, validity=validity)
    depth = None if args.exact_depth else SensorDepthConfig()
    colour = None if args.exact_colour else SensorColourConfig()
    bar = _progress(len(names) * args.frames, args, "scenarios")
    report: dict[str, Any] = {
        "weights": None if args.weights is None else str(args.weights),
        "random_weights": bool(estimator.networks.random_weights), "device": str(estimator.device),
        "object": {"name": obj.name, "diameter_m": obj.diameter}, "distractor": distractor.name,
        "symmetry": None if symmetry is None else symmetry.describe(), "model_points": points.describe(),
        "validity": _fields(validity), "calibration": calibration, "recover": not args.no_recover,
        "settings": {"frames": args.frames, "size": list(args.size), "seed": args.seed, "scenario_seeds": seeds,
                     "hypotheses": args.hypotheses, "register_iterations": args.register_iterations,
                     "track_iterations": args.track_iterations},
        "definitions": DEFINITIONS,
        "scenarios": {}}
    start = time.perf_counter()
    try:
        report["scenarios"] = run_scenarios(estimator, obj, seeds, points_mesh=points.points, distractor=distractor,
                                            frames=args.frames, hw=tuple(args.size), depth=depth, colour=colour,
                                            recover=not args.no_recover, progress=bar)
    finally:
        bar.close()
    report["wall_s"] = time.perf_counter() - start
    (args.out / SCENARIOS_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(report) if args.json else scenario_tables(report) + f"\n\nreport: {args.out / SCENARIOS_FILE}")
    return 0


def _train_device(device: str | None) -> str:
    """The training device of a runtime --device: auto, cpu or cuda."""
    if device in (None, "auto", "cpu"):
        return device or "auto"
    if device.startswith("cuda"):
        return "cuda"
    raise InputError("--device", "auto, cpu, cuda or cuda:N", repr(device))


def _suite(args: argparse.Namespace, argv: list[str]) -> int:
    from foundationpose.demo.metrics import model_points
    from foundationpose.evaluate.report import suite_tables
    from foundationpose.evaluate.suite import (
        DEFINITIONS,
        SUITE_FILE,
        SuiteEvaluation,
        SuiteTraining,
        evaluate_object,
        summarise,
        trained_weights,
    )
    from foundationpose.mesh import load_object
    from foundationpose.symmetry_detect import detect_symmetries, real_symmetries
    from foundationpose.synthetic.meshes import make_procedural_mesh
    from foundationpose.synthetic.objects import select_objects, write_objects
    from foundationpose.synthetic.scenarios import MIN_FRAMES, SCENARIOS

    objects = select_objects(args.objects, args.split)
    if args.frames < MIN_FRAMES:
        raise InputError("--frames", f"at least {MIN_FRAMES} frames per scenario", str(args.frames))
    if args.views < 1:
        raise InputError("--views", "a number of views >= 1", str(args.views))
    if args.train_only and args.weights is not None:
        raise InputError("--train-only", "no --weights: it trains each object's own", str(args.weights))
    _check_start(args, [args.precision or "auto"])
    wanted = {"clean", *(args.scenario or SCENARIOS)}
    evaluation = SuiteEvaluation(views=args.views, view_seed=args.seed, frames=args.frames, hw=tuple(args.size),
                                 scenarios=tuple(n for n in SCENARIOS if n in wanted), scenario_seed=args.scenario_seed)
    training = SuiteTraining(minutes=args.minutes, steps=args.steps, seed=args.train_seed, batch=args.batch,
                             crop_size=args.crop_size, frame_hw=tuple(args.frame_size), scorer_sets=args.scorer_sets,
                             set_size=args.set_size, device=_train_device(args.device), renderer=args.renderer or "auto")
    cache = args.weights_cache or args.out / "weights"
    catalogue = write_objects(args.out / "objects", [o.name for o in objects], seed=args.object_seed)
    report: dict[str, Any] = {
        "command": "python -m foundationpose.evaluate suite " + " ".join(argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": _machine(), "definitions": DEFINITIONS,
        "settings": {"object_seed": args.object_seed, "weights": None if args.weights is None else str(args.weights),
                     "training": None if args.weights is not None else _fields(training),
                     "evaluation": _fields(evaluation), "hypotheses": args.hypotheses,
                     "register_iterations": args.register_iterations, "track_iterations": args.track_iterations},
        "objects": {}, "splits": {}}
    start = time.perf_counter()
    # every object's weights first: a run stopped while training leaves no evaluation half done, and the same
    # command with the same --weights-cache reuses the finished weights and resumes the interrupted run
    trained: dict[str, tuple[Path, dict[str, Any], float]] = {}
    for index, suite_object in enumerate(objects, start=1):
        began = time.perf_counter()
        if args.weights is None:
            logger.info("[%d/%d] weights of %s (%s)", index, len(objects), suite_object.name, suite_object.split)
            mesh_file = args.out / "objects" / catalogue["objects"][suite_object.name]["file"]
            weights, weights_info = trained_weights(suite_object.name, mesh_file, cache, training)
        else:
            weights, weights_info = args.weights, {"dir": str(args.weights), "reused": True}
        trained[suite_object.name] = weights, weights_info, time.perf_counter() - began
    if args.train_only:
        report["weights"] = {name: info for name, (_, info, _) in trained.items()}
        (args.out / SUITE_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(json.dumps(report) if args.json else
              "\n".join(f"{name}: {info['dir']} ({'reused' if info['reused'] else 'trained'})"
                        for name, info in report["weights"].items()))
        return 0
    for index, suite_object in enumerate(objects, start=1):
        facts = catalogue["objects"][suite_object.name]
        logger.info("[%d/%d] %s (%s)", index, len(objects), suite_object.name, suite_object.split)
        began = time.perf_counter()
        weights, weights_info, train_s = trained[suite_object.name]
        estimator = _create_estimator(argparse.Namespace(**(vars(args) | {"weights": weights})))
        mesh_file = args.out / "objects" / facts["file"]
        detected = detect_symmetries(estimator.load_object(mesh_file).mesh)
        obj = estimator.load_object(mesh_file, symmetries=real_symmetries(detected))
        distractor = load_object(make_procedural_mesh("textured_asym", shape="tee"), device=estimator.device)
        bar = _progress(evaluation.views + evaluation.frames * len(evaluation.scenarios), args, suite_object.name)
        try:
            figures = evaluate_object(estimator, obj, model_points(obj.mesh), distractor, evaluation, progress=bar)
        finally:
            bar.close()
        report["objects"][suite_object.name] = {
            "split": suite_object.split, "diameter_m": obj.diameter, "file": facts["file"], "sha256": facts["sha256"],
            "near_symmetries": facts["near_symmetries"],
            "symmetries": {"detected": [d.describe() for d in detected],
                           "declared": None if obj.symmetry is None else obj.symmetry.describe()},
            "weights": weights_info,
            "random_weights": bool(estimator.networks.random_weights), "device": str(estimator.device), **figures,
            "train_s": train_s, "evaluate_s": time.perf_counter() - began}
        report["splits"] = summarise(report["objects"], objects)
        report["wall_s"] = time.perf_counter() - start
        (args.out / SUITE_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        logger.info("%s: register success %.2f, flips %d; %.0f s", suite_object.name,
                    figures["register"]["success_rate"], figures["register"]["flips"], time.perf_counter() - began)
        del estimator
    print(json.dumps(report) if args.json else suite_tables(report) + f"\n\nreport: {args.out / SUITE_FILE}")
    return 0


def _calibration(path: Path | None) -> tuple[ValidityConfig, dict[str, Any]]:
    """The validity thresholds a scenarios run uses and where they come from: ``path``'s pooled choice (a
    calibration.json), or the library's defaults (calibrated on the scenario seeds 0-4, docs/tracking.md).
    The second value holds ``source`` and ``scenario_seeds`` (the seeds that calibration measured)."""
    from foundationpose.evaluate.scenarios import SEED_STREAMS
    from foundationpose.synthetic.scenarios import SCENARIOS
    from foundationpose.validity import ValidityConfig

    if path is None:
        first = SEED_STREAMS["calibrate"][0]
        return ValidityConfig(), {"source": "the library's defaults (foundationpose.validity.ValidityConfig)",
                                  "scenario_seeds": list(range(first, first + len(SCENARIOS)))}
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
        chosen, settings = report["default"]["chosen"], report["settings"]
        recorded = settings.get("scenario_seeds")  # older files: scenario k had seed + k
        seeds = ([int(v) for v in recorded.values()] if recorded
                 else list(range(int(settings["seed"]), int(settings["seed"]) + len(SCENARIOS))))
        validity = ValidityConfig(**chosen)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InputError("--calibration", "a calibration.json written by 'calibrate'",
                         f"{path} ({type(exc).__name__}: {exc})") from exc
    return validity, {"source": str(path), "scenario_seeds": seeds}


def _calibrate(args: argparse.Namespace, argv: list[str]) -> int:
    from foundationpose.evaluate.calibrate import CalibrationConfig, choose, collect, judged
    from foundationpose.evaluate.report import calibration_tables
    from foundationpose.evaluate.scenarios import scenario_seeds
    from foundationpose.mesh import load_object
    from foundationpose.render import make_renderer
    from foundationpose.synthetic.meshes import make_procedural_mesh

    scenario_seeds("calibrate", args.seed)  # refuses a seed outside the calibrate stream, naming both ranges
    cfg = CalibrationConfig(frames=args.frames, hw=tuple(args.size), seed=args.seed, probes=args.probes,
                            target_false_alarm=args.target_false_alarm,
                            estimator_every=0 if args.no_estimator else args.estimator_every)
    args.out.mkdir(parents=True, exist_ok=True)
    estimator = None if args.no_estimator else _create_estimator(args)
    device = estimator.device if estimator is not None else ("cuda" if args.device == "cuda" else "cpu")
    renderer = estimator.renderer if estimator is not None else make_renderer(args.renderer or "auto", device)
    objects = {shape: load_object(make_procedural_mesh("textured_asym", shape=shape), device=device)
               for shape in ("L", "tee")}
    start = time.perf_counter()
    bar = _progress(len(args.shapes) * 5 * (cfg.frames - 1), args, "calibrate")
    try:
        collected = [collect(objects[s], renderer, objects["tee" if s == "L" else "L"], cfg, estimator, bar)
                     for s in args.shapes]
    finally:
        bar.close()
    report: dict[str, Any] = {
        "command": "python -m foundationpose.evaluate calibrate " + " ".join(argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": _machine(),
        "weights": None if args.weights is None else str(args.weights),
        "random_weights": None if estimator is None else bool(estimator.networks.random_weights),
        "settings": _fields(cfg) | {"scenario_seeds": scenario_seeds("calibrate", cfg.seed)},
        "objects": {}}
    for shape, c in zip(args.shapes, collected, strict=True):
        chosen, per_tol = choose([c], cfg)
        report["objects"][shape] = {"name": c.name, "diameter_m": objects[shape].diameter, "chosen": _fields(chosen),
                                    "per_tolerance": per_tol, **judged(c, chosen)}
    default, per_tol = choose(collected, cfg)
    report["default"] = {"chosen": _fields(default), "per_tolerance": per_tol,
                         "per_object": {s: judged(c, default) for s, c in zip(args.shapes, collected, strict=True)}}
    report["wall_s"] = time.perf_counter() - start
    (args.out / CALIBRATION_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(report) if args.json else calibration_tables(report) + f"\n\nreport: {args.out / CALIBRATION_FILE}")
    return 0


def _fields(obj: Any) -> dict[str, Any]:
    from dataclasses import fields

    return {f.name: (list(v) if isinstance(v := getattr(obj, f.name), tuple) else v) for f in fields(obj)}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    command = argv[0] if argv and argv[0] in ("scenarios", "calibrate", "suite") else None
    try:
        if command == "suite":
            logger.setLevel(logging.INFO)  # progress on stderr
            logging.getLogger("foundationpose.evaluate.suite").setLevel(logging.INFO)
            return _suite(build_suite_parser().parse_args(argv[1:]), argv[1:])
        if command == "scenarios":
            return _scenarios(build_scenarios_parser().parse_args(argv[1:]))
        if command == "calibrate":
            return _calibrate(build_calibrate_parser().parse_args(argv[1:]), argv[1:])
        return _accuracy(build_parser().parse_args(argv))
    except (PoseError, DeployError, ValueError) as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
