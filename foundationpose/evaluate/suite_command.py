"""``python -m foundationpose.evaluate suite``: the object suite (:mod:`foundationpose.synthetic.objects`), each
object's weights trained (or reused from a cache) before any is evaluated, then the figures of
:mod:`foundationpose.evaluate.suite` per object, per split and overall in ``OUT/suite.json``."""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import time
from pathlib import Path
from typing import Any

from foundationpose.errors import InputError
from foundationpose.evaluate.command_common import (
    check_start,
    create_estimator,
    dataclass_fields,
    estimator_options,
    machine_facts,
    progress_bar,
    train_device,
)

__all__ = ["build_suite_parser", "run_suite"]

logger = logging.getLogger(__name__)


def build_suite_parser() -> argparse.ArgumentParser:
    from foundationpose.evaluate.scenarios import SEED_STREAMS
    from foundationpose.synthetic.objects import SPLITS, SUITE
    from foundationpose.synthetic.scenarios import DEFAULT_FRAMES, MIN_FRAMES, SCENARIOS

    p = argparse.ArgumentParser(
        prog="python -m foundationpose.evaluate suite",
        description="The object suite: textured real-object shapes whose near-symmetry only a detail or a print "
        "breaks. Trains every object's weights first (or reuses them from --weights-cache), then reports per object, per "
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
    p.add_argument("--train-jobs", type=int, default=1, metavar="N",
                   help="objects trained at once, each in its own process sharing the device; the minutes stay "
                   "wall-clock minutes per object (default: 1)")
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
    estimator_options(p)
    for action in p._actions:  # --weights here: one folder for every object instead of training each
        if action.dest == "weights":
            action.help = ("evaluate these weights (official layout) on every object instead of training "
                           "(default: train each object)")
    return p


def run_suite(args: argparse.Namespace, argv: list[str]) -> int:
    from foundationpose.demo.metrics import model_points
    from foundationpose.evaluate.report import suite_tables
    from foundationpose.evaluate.suite import (
        DEFINITIONS,
        SUITE_FILE,
        SuiteEvaluation,
        SuiteTraining,
        evaluate_object,
        summarise,
        train_objects,
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
    if args.train_jobs < 1:
        raise InputError("--train-jobs", "a number of objects >= 1", str(args.train_jobs))
    if args.train_only and args.weights is not None:
        raise InputError("--train-only", "no --weights: it trains each object's own", str(args.weights))
    check_start(args, [args.precision or "auto"])
    wanted = {"clean", *(args.scenario or SCENARIOS)}
    evaluation = SuiteEvaluation(views=args.views, view_seed=args.seed, frames=args.frames, hw=tuple(args.size),
                                 scenarios=tuple(n for n in SCENARIOS if n in wanted), scenario_seed=args.scenario_seed)
    training = SuiteTraining(minutes=args.minutes, steps=args.steps, seed=args.train_seed, batch=args.batch,
                             crop_size=args.crop_size, frame_hw=tuple(args.frame_size), scorer_sets=args.scorer_sets,
                             set_size=args.set_size, device=train_device(args.device), renderer=args.renderer or "auto")
    cache = args.weights_cache or args.out / "weights"
    catalogue = write_objects(args.out / "objects", [o.name for o in objects], seed=args.object_seed)
    report: dict[str, Any] = {
        "command": "python -m foundationpose.evaluate suite " + " ".join(argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_facts(), "definitions": DEFINITIONS,
        "settings": {"object_seed": args.object_seed, "weights": None if args.weights is None else str(args.weights),
                     "training": None if args.weights is not None else dataclass_fields(training),
                     "evaluation": dataclass_fields(evaluation), "hypotheses": args.hypotheses,
                     "register_iterations": args.register_iterations, "track_iterations": args.track_iterations},
        "objects": {}, "splits": {}}
    start = time.perf_counter()
    # every object's weights first: a run stopped while training leaves no evaluation half done, and the same
    # command with the same --weights-cache reuses the finished weights and resumes the interrupted run
    if args.weights is None:
        meshes = {o.name: args.out / "objects" / catalogue["objects"][o.name]["file"] for o in objects}
        trained = train_objects(meshes, cache, training, jobs=args.train_jobs)
    else:
        trained = {o.name: (args.weights, {"dir": str(args.weights), "reused": True}, 0.0) for o in objects}
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
        estimator = create_estimator(argparse.Namespace(**(vars(args) | {"weights": weights})))
        mesh_file = args.out / "objects" / facts["file"]
        detected = detect_symmetries(estimator.load_object(mesh_file).mesh)
        obj = estimator.load_object(mesh_file, symmetries=real_symmetries(detected))
        distractor = load_object(make_procedural_mesh("textured_asym", shape="tee"), device=estimator.device)
        bar = progress_bar(evaluation.views + evaluation.frames * len(evaluation.scenarios), args, suite_object.name)
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
