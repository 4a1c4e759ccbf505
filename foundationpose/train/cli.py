"""Command line of ``python -m foundationpose.train``: parse the options into a TrainConfig and run it."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from foundationpose.errors import PoseError
from foundationpose.train.config import TrainConfig
from foundationpose.train.refiner_targets import LOSS_KINDS, PerturbConfig, RefinerLossConfig
from foundationpose.train.scorer_ranking import RankingConfig

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m foundationpose.train",
        description="Train RefineNet and ScoreNetMultiPair for ONE object on synthetic data rendered on the fly; "
        "writes the official weights layout (DIR/<run>/model_best.pth + config.yml) for --weights DIR.",
    )
    p.add_argument("--mesh", type=Path, required=True, metavar="FILE", help="object mesh in metres (OBJ/PLY/GLB)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR",
                   help="output folder: weights, train_state.pt (a rerun with the same DIR resumes), logs, loss curve")
    p.add_argument("--minutes", type=float, default=7.0, help="training budget in minutes of wall clock, summed over "
                   "resumed runs (default: 7)")
    p.add_argument("--steps", type=int, default=None, help="optimiser-step budget (both networks); when given the "
                   "learning-rate schedule follows the steps and a run is deterministic for a seed (default: none)")
    p.add_argument("--init", type=Path, default=None, metavar="DIR",
                   help="fine-tune from weights in the official layout (default: random init from --seed)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: auto (cuda when available)")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                   help="autocast precision (default: auto = bf16 on cuda, fp32 on cpu)")
    p.add_argument("--seed", type=int, default=0, help="random init and data stream seed (default: 0)")
    p.add_argument("--batch", type=int, default=128,
                   help="refiner hypotheses per step (default: 128; on the H200 128 beat 64 in the same 7 minutes)")
    p.add_argument("--hypotheses-per-scene", type=int, default=None, metavar="N",
                   help="refiner hypotheses perturbed around each synthetic observation; a larger N renders fewer scenes "
                   "per step (default: the largest of 4, 2, 1 that divides --batch)")
    p.add_argument("--scorer-sets", type=int, default=4, help="observations per scorer step (default: 4)")
    p.add_argument("--set-size", type=int, default=16, help="hypotheses per scorer set (default: 16)")
    p.add_argument("--scorer-fraction", type=float, default=0.35, help="share of steps that train the scorer (default: 0.35)")
    p.add_argument("--lr", type=float, default=4e-4, help="peak AdamW learning rate of the refiner (default: 4e-4)")
    p.add_argument("--scorer-lr", type=float, default=1.5e-4,
                   help="peak AdamW learning rate of the scorer (default: 1.5e-4; 4e-4 made it collapse on the H200)")
    p.add_argument("--refiner-loss", choices=LOSS_KINDS, default=RefinerLossConfig().kind,
                   help="per-component refiner loss; l1 pulls small (track-scale) errors as hard as large ones "
                   f"(default: {RefinerLossConfig().kind})")
    p.add_argument("--frame-size", type=int, nargs=2, default=(256, 320), metavar=("H", "W"),
                   help="synthetic observation size in pixels (default: 256 320)")
    p.add_argument("--crop-size", type=int, default=160, help="network crop side; 160 for usable weights, less only "
                   "for smoke tests (default: 160)")
    p.add_argument("--log-every", type=int, default=25, help="steps per JSON log line (default: 25)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def _hypotheses_per_scene(args: argparse.Namespace) -> int:
    if args.hypotheses_per_scene is not None:
        return args.hypotheses_per_scene  # TrainConfig names a batch that is not a multiple of it
    return next(n for n in (4, 2, 1) if args.batch % n == 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = TrainConfig(
            mesh=args.mesh, out_dir=args.out, minutes=args.minutes, steps=args.steps, init=args.init,
            device=args.device, precision=args.precision, seed=args.seed, refiner_batch=args.batch,
            hypotheses_per_scene=_hypotheses_per_scene(args), scorer_sets=args.scorer_sets,
            scorer_fraction=args.scorer_fraction, lr=args.lr, scorer_lr=args.scorer_lr, frame_hw=tuple(args.frame_size), crop_size=args.crop_size,
            log_every=args.log_every, progress=not args.no_progress, ranking=RankingConfig(set_size=args.set_size),
            perturb=PerturbConfig(), loss=RefinerLossConfig(kind=args.refiner_loss),
        )
        from foundationpose.train.loop import Trainer

        summary = Trainer(config).run()
    except (PoseError, ValueError) as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted (resume with the same --out)", file=sys.stderr)
        return 130
    print(json.dumps(summary, default=str))
    return 0
