"""Command line of the FP8 tools (a thin shell over :mod:`foundationpose.quant.commands`).

``python -m foundationpose.quant calibrate --weights DIR --mesh FILE`` (also reachable as
``python -m foundationpose.train calibrate ...``) writes ``fp8_scales.json`` beside both checkpoints and prints a
JSON summary; ``python -m foundationpose.quant deltas --weights DIR --mesh FILE`` prints the per-layer output
deltas of both networks, float32 vs FP8-emulated, on held-out synthetic views. Errors print as ``Type: message``
on stderr with exit status 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from foundationpose.errors import PoseError

__all__ = ["build_parser", "main"]


def _common(p: argparse.ArgumentParser) -> None:
    from foundationpose.quant.calibrate import CalibrationConfig

    d = CalibrationConfig()
    p.add_argument("--weights", type=Path, required=True, metavar="DIR", help="weights root in the official layout")
    p.add_argument("--mesh", type=Path, required=True, metavar="FILE",
                   help="mesh of the object the weights were trained for (metres; OBJ/PLY/GLB)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: auto")
    p.add_argument("--renderer", choices=("auto", "cpu", "nvdiffrast", "triton"), default="auto", help="default: auto")
    p.add_argument("--seed", type=int, default=d.seed, help=f"synthetic data seed (default: {d.seed}; the streams are "
                   "disjoint from training's and evaluate's)")
    p.add_argument("--crop-size", type=int, default=d.crop_size,
                   help=f"network crop side; {d.crop_size} for real weights, less only for smoke tests (default: {d.crop_size})")
    p.add_argument("--frame-size", type=int, nargs=2, default=d.frame_hw, metavar=("H", "W"),
                   help=f"synthetic observation size in pixels (default: {d.frame_hw[0]} {d.frame_hw[1]})")
    p.add_argument("--refiner-batches", type=int, default=d.refiner_batches,
                   help=f"refiner calibration batches (default: {d.refiner_batches})")
    p.add_argument("--refiner-batch", type=int, default=d.refiner_batch,
                   help=f"hypotheses per refiner batch (default: {d.refiner_batch})")
    p.add_argument("--hypotheses-per-scene", type=int, default=d.hypotheses_per_scene,
                   help=f"refiner hypotheses around each observation (default: {d.hypotheses_per_scene})")
    p.add_argument("--scorer-batches", type=int, default=d.scorer_batches,
                   help=f"scorer calibration batches (default: {d.scorer_batches})")
    p.add_argument("--scorer-sets", type=int, default=d.scorer_sets, help=f"sets per scorer batch (default: {d.scorer_sets})")
    p.add_argument("--set-size", type=int, default=d.set_size, help=f"hypotheses per scorer set (default: {d.set_size})")
    p.add_argument("--sensitivity-batches", type=int, default=d.sensitivity_batches,
                   help=f"batches per network of the sensitivity study (default: {d.sensitivity_batches})")
    p.add_argument("--heldout-batches", type=int, default=d.heldout_batches,
                   help=f"held-out batches per network for the reported deltas (default: {d.heldout_batches})")


def build_parser(prog: str = "python -m foundationpose.quant") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="FP8 (E4M3) calibration and accuracy deltas of RefineNet and "
                                "ScoreNetMultiPair, on synthetic views of the object the weights were trained for.")
    sub = p.add_subparsers(dest="command", required=True)
    cal = sub.add_parser("calibrate", help="write fp8_scales.json beside both checkpoints (activation scales, "
                         "sensitivity study, the layers kept 16-bit); prints a JSON summary")
    _common(cal)
    cal.add_argument("--margin", type=float, default=1.0,
                     help="activation range headroom: scale = amax * margin / 448 (default: 1.0)")
    dl = sub.add_parser("deltas", help="per-layer output deltas, float32 vs FP8-emulated, on held-out views (JSON)")
    _common(dl)
    return p


def _config(args: argparse.Namespace):
    from foundationpose.quant.calibrate import CalibrationConfig

    return CalibrationConfig(
        refiner_batches=args.refiner_batches, refiner_batch=args.refiner_batch,
        hypotheses_per_scene=args.hypotheses_per_scene, scorer_batches=args.scorer_batches,
        scorer_sets=args.scorer_sets, set_size=args.set_size, sensitivity_batches=args.sensitivity_batches,
        heldout_batches=args.heldout_batches, seed=args.seed, crop_size=args.crop_size,
        frame_hw=tuple(args.frame_size), margin=getattr(args, "margin", 1.0))


def main(argv: list[str] | None = None, prog: str = "python -m foundationpose.quant") -> int:
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        from foundationpose.quant.commands import calibrate_weights, deltas_report

        config = _config(args)
        run = calibrate_weights if args.command == "calibrate" else deltas_report
        result = run(args.weights, args.mesh, device=args.device, renderer=args.renderer, config=config)
    except (PoseError, ValueError, RuntimeError) as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=1, default=str))
    return 0
