"""Command line of ``python -m foundationpose.evaluate``.

Registers the first frame of a recorded sequence with ground truth and tracks the rest (default: the bundled
sequence), then registers ``--views`` held-out synthetic views of the same object, and prints one JSON object
(also written to ``OUT/eval.json``)::

    {"weights": ..., "random_weights": false, "object": {...},
     "sequence": {"frames", "add_m": {mean, median, max}, "adds_m", "rot_deg", "trans_m", "success_rate",
                  "worst_add_diameters", "drift": {...}, "register": {first frame}, "per_frame": [...]},
     "views": {"frames", "register_success_rate", "add_m", ..., "candidates": {"oracle_success_rate",
               "chosen_success_rate", "refiner_misses", "scorer_misses", "best_rank_median", ...},
               "per_view": [...]}, "wall_s": ...}

``views.candidates`` tells a refiner failure (no refined hypothesis within 0.1 diameter: ``oracle_success_rate``
is low) from a scorer failure (one was, the scorer ranked it below the pick: ``scorer_misses``, ``best_rank``).

Overlays (oriented box + axes at the estimated pose): ``OUT/sequence/<id>.png`` for every frame and
``OUT/views/view_<i>.png`` for the first ``--overlays`` views. Errors of this package are printed as
``TypeName: message`` with exit status 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from deploy_core.errors import DeployError
from foundationpose.demo.dataset import BUNDLED_SEQUENCE_DIR
from foundationpose.errors import InputError, PoseError

__all__ = ["build_parser", "main"]

DEFAULT_DATA_DIR = BUNDLED_SEQUENCE_DIR
EVAL_FILE = "eval.json"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m foundationpose.evaluate",
        description="Accuracy of weights: register + track a recorded sequence with ground truth, and register "
        "held-out synthetic views; prints JSON (ADD, ADD-S, rotation / translation errors, success rate, drift).",
    )
    p.add_argument("--weights", type=Path, default=None, metavar="DIR",
                   help="weights root in the official layout (default: random weights, which fail on purpose)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR, metavar="SEQ",
                   help="sequence folder with annotated_poses/ (default: the bundled sequence)")
    p.add_argument("--mesh", type=Path, default=None, metavar="FILE", help="object mesh (default: the sequence's)")
    p.add_argument("--views", type=int, default=100, metavar="N", help="held-out synthetic views (default: 100; 0 = none)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic views (default: 0; the stream is "
                   "disjoint from training's for every seed)")
    p.add_argument("--out", type=Path, default=Path("eval_out"), metavar="DIR", help="output folder (default: ./eval_out)")
    p.add_argument("--overlays", type=int, default=8, metavar="N", help="synthetic views written as overlays (default: 8)")
    p.add_argument("--no-sequence", action="store_true", help="skip the recorded sequence")
    p.add_argument("--max-frames", type=int, default=None, metavar="N", help="only the first N frames (default: all)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: auto")
    p.add_argument("--precision", choices=("auto", "fp32", "fp16", "bf16"), default="auto",
                   help="network precision (default: auto = fp16 on cuda, fp32 on cpu)")
    p.add_argument("--renderer", choices=("auto", "cpu", "nvdiffrast", "triton"), default="auto", help="default: auto")
    p.add_argument("--hypotheses", type=int, default=252, help="register hypotheses (default: 252)")
    p.add_argument("--register-iterations", type=int, default=5, help="default: 5")
    p.add_argument("--track-iterations", type=int, default=2, help="default: 2")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        from tqdm import tqdm

        from foundationpose.demo.dataset import RecordedSequence
        from foundationpose.estimator import EstimatorConfig, PoseEstimator
        from foundationpose.evaluate.runs import evaluate_sequence, evaluate_views
        from foundationpose.train.scenes import DEMO_K

        if args.views < 0:
            raise InputError("--views", "a number of views >= 0", str(args.views))
        seq = None if args.no_sequence else RecordedSequence(args.data, max_frames=args.max_frames)
        mesh = args.mesh or (seq.mesh_path if seq is not None else None)
        if mesh is None:
            raise InputError("--mesh", "a mesh file (or a sequence with a mesh/ folder)", "none")
        args.out.mkdir(parents=True, exist_ok=True)
        estimator = PoseEstimator.create(
            device=args.device, weights=args.weights, precision=args.precision, renderer=args.renderer,
            config=EstimatorConfig(num_hypotheses=args.hypotheses, register_iterations=args.register_iterations,
                                   track_iterations=args.track_iterations),
        )
        obj = estimator.load_object(mesh)
        start = time.perf_counter()
        total = (len(seq) if seq is not None else 0) + args.views
        bar = tqdm(total=total, file=sys.stderr, disable=args.no_progress, unit="frame", desc="evaluate")
        result = {"weights": None if args.weights is None else str(args.weights),
                  "random_weights": bool(estimator.networks.random_weights), "device": str(estimator.device),
                  "precision": estimator.networks.precision,
                  "object": {"name": obj.name, "mesh": str(mesh), "diameter_m": obj.diameter},
                  "settings": {"hypotheses": args.hypotheses, "register_iterations": args.register_iterations,
                               "track_iterations": args.track_iterations, "views": args.views, "seed": args.seed}}
        try:
            if seq is not None:
                result["sequence"] = evaluate_sequence(estimator, obj, seq, args.out / "sequence", progress=bar)
                result["sequence"]["data"] = str(args.data)
            if args.views:
                K = seq.K if seq is not None else DEMO_K
                hw = seq.image_hw if seq is not None else (480, 640)
                result["views"] = evaluate_views(estimator, obj, args.views, args.seed, args.out / "views", K=K, hw=hw,
                                                 overlays=args.overlays, progress=bar)
        finally:
            bar.close()
        result["wall_s"] = time.perf_counter() - start
        text = json.dumps(result, indent=2)
        (args.out / EVAL_FILE).write_text(text + "\n", encoding="utf-8")
        print(text)
        return 0
    except (PoseError, DeployError, ValueError) as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
