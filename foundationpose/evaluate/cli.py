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
trains every object's weights first (``--train-jobs N`` at once; or reuses cached ones; ``--train-only`` stops there),
then reports per object
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
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deploy_core.errors import DeployError
from foundationpose.demo.dataset import BUNDLED_SEQUENCE_DIR
from foundationpose.errors import InputError, PoseError
from foundationpose.evaluate.command_common import (
    check_start,
    create_estimator,
    dataclass_fields,
    estimator_options,
    machine_facts,
    progress_bar,
)
from foundationpose.evaluate.suite_command import build_suite_parser, run_suite
from foundationpose.runtime import PRECISIONS
from foundationpose.symmetry import add_symmetry_options, symmetries_of_options

if TYPE_CHECKING:
    from foundationpose.validity import ValidityConfig

__all__ = ["build_calibrate_parser", "build_parser", "build_scenarios_parser", "build_suite_parser", "main"]

DEFAULT_DATA_DIR = BUNDLED_SEQUENCE_DIR
EVAL_FILE, SCENARIOS_FILE, CALIBRATION_FILE = "eval.json", "scenarios.json", "calibration.json"
logger = logging.getLogger(__name__)


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
    estimator_options(p, compare=True)
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
    estimator_options(p, hypotheses=42)
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
    estimator_options(p, hypotheses=42)
    return p


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
    check_start(args, precisions)  # before the bar: a bad --weights or --device fails with nothing drawn
    seq = None if args.no_sequence else RecordedSequence(args.data, max_frames=args.max_frames)
    mesh = args.mesh or (seq.mesh_path if seq is not None else None)
    if mesh is None:
        raise InputError("--mesh", "a mesh file (or a sequence with a mesh/ folder)", "none")
    sensor = args.depth == "sensor" or (args.depth == "auto" and Path(args.data).resolve() == BUNDLED_SEQUENCE_DIR)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    total = ((len(seq) if seq is not None else 0) + args.views) * len(precisions)
    bar = progress_bar(total, args, "evaluate")
    result: dict[str, Any] = {"weights": None if args.weights is None else str(args.weights)}
    by_precision: dict[str, dict[str, Any]] = {}
    try:
        for precision in precisions:  # the same --seed: the same sensor noise and views for every precision
            estimator = create_estimator(args, precision)
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
    estimator = create_estimator(args)
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
    bar = progress_bar(len(names) * args.frames, args, "scenarios")
    report: dict[str, Any] = {
        "weights": None if args.weights is None else str(args.weights),
        "random_weights": bool(estimator.networks.random_weights), "device": str(estimator.device),
        "object": {"name": obj.name, "diameter_m": obj.diameter}, "distractor": distractor.name,
        "symmetry": None if symmetry is None else symmetry.describe(), "model_points": points.describe(),
        "validity": dataclass_fields(validity), "calibration": calibration, "recover": not args.no_recover,
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
    estimator = None if args.no_estimator else create_estimator(args)
    device = estimator.device if estimator is not None else ("cuda" if args.device == "cuda" else "cpu")
    renderer = estimator.renderer if estimator is not None else make_renderer(args.renderer or "auto", device)
    objects = {shape: load_object(make_procedural_mesh("textured_asym", shape=shape), device=device)
               for shape in ("L", "tee")}
    start = time.perf_counter()
    bar = progress_bar(len(args.shapes) * 5 * (cfg.frames - 1), args, "calibrate")
    try:
        collected = [collect(objects[s], renderer, objects["tee" if s == "L" else "L"], cfg, estimator, bar)
                     for s in args.shapes]
    finally:
        bar.close()
    report: dict[str, Any] = {
        "command": "python -m foundationpose.evaluate calibrate " + " ".join(argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_facts(),
        "weights": None if args.weights is None else str(args.weights),
        "random_weights": None if estimator is None else bool(estimator.networks.random_weights),
        "settings": dataclass_fields(cfg) | {"scenario_seeds": scenario_seeds("calibrate", cfg.seed)},
        "objects": {}}
    for shape, c in zip(args.shapes, collected, strict=True):
        chosen, per_tol = choose([c], cfg)
        report["objects"][shape] = {"name": c.name, "diameter_m": objects[shape].diameter, "chosen": dataclass_fields(chosen),
                                    "per_tolerance": per_tol, **judged(c, chosen)}
    default, per_tol = choose(collected, cfg)
    report["default"] = {"chosen": dataclass_fields(default), "per_tolerance": per_tol,
                         "per_object": {s: judged(c, default) for s, c in zip(args.shapes, collected, strict=True)}}
    report["wall_s"] = time.perf_counter() - start
    (args.out / CALIBRATION_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(report) if args.json else calibration_tables(report) + f"\n\nreport: {args.out / CALIBRATION_FILE}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    command = argv[0] if argv and argv[0] in ("scenarios", "calibrate", "suite") else None
    try:
        if command == "suite":
            for name in ("foundationpose.evaluate.suite_command", "foundationpose.evaluate.suite"):
                logging.getLogger(name).setLevel(logging.INFO)  # progress on stderr
            return run_suite(build_suite_parser().parse_args(argv[1:]), argv[1:])
        if command == "scenarios":
            return _scenarios(build_scenarios_parser().parse_args(argv[1:]))
        if command == "calibrate":
            return _calibrate(build_calibrate_parser().parse_args(argv[1:]), argv[1:])
        return _accuracy(build_parser().parse_args(argv))
    except (PoseError, DeployError, ValueError) as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
