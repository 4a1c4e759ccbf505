"""A/B of refiner training recipes on the CPU: train a few hundred refiner steps at a small crop, then measure
the refined poses on one fixed held-out set of perturbed hypotheses at track scale and at register scale.

    PYTHONPATH=$PWD python3 tools/refiner_ab.py --variant base --steps 200 > /tmp/ab_base.json

Every variant sees the same held-out observations and hypotheses (seeded apart from training); variants
that keep the perturbation mixture also see the same training stream. The numbers at a 48 px crop are not
the 160 px figures; only the comparison between variants on the same set means something.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from foundationpose.demo.dataset import BUNDLED_SEQUENCE_DIR
from foundationpose.pose_update import apply_refiner_output, so3_exp_map
from foundationpose.refine import build_refiner_inputs_per_frame
from foundationpose.train.batches import nchw
from foundationpose.train.config import TrainConfig
from foundationpose.train.loop import Trainer
from foundationpose.train.refiner_targets import PerturbConfig, RefinerLossConfig, so3_log
from foundationpose.train.scorer_ranking import add_per_hypothesis

MESH = BUNDLED_SEQUENCE_DIR / "mesh" / "textured_simple.obj"

_MSE = RefinerLossConfig(kind="mse")
VARIANTS: dict[str, dict] = {  # "base" is the recipe before the L1 default (MSE); the others change one thing
    "base": {"loss": _MSE},
    "l1": {"loss": RefinerLossConfig(kind="l1")},
    "smooth_l1": {"loss": RefinerLossConfig(kind="smooth_l1")},
    "small_mix": {"loss": _MSE, "perturb": PerturbConfig(register_fraction=0.3, refine_fraction=0.35)},
    "lr1e-3": {"loss": _MSE, "lr": 1e-3},
    "no_zero_init": {"loss": _MSE, "zero_init_heads": False},
    "l1_lr1e-3": {"loss": RefinerLossConfig(kind="l1"), "lr": 1e-3},
    "l1_no_zero_init": {"loss": RefinerLossConfig(kind="l1"), "zero_init_heads": False},
}


def held_out(trainer: Trainer, n: int, scale: str, seed: int):
    """(frames, hypotheses, truth) of ``n`` fresh observations; ``scale`` track: 1-4 deg, ~1 cm; register: 0-30 deg."""
    gen = torch.Generator().manual_seed(seed)
    dev_gen = torch.Generator().manual_seed(seed + 1)
    source = trainer.source
    saved = source.gen, source.device_gen
    source.gen, source.device_gen = gen, dev_gen
    try:
        scenes, frames = source.observations(n)
    finally:
        source.gen, source.device_gen = saved
    gt = scenes.cam_from_centred.double()
    lo, hi = (1.0, 4.0) if scale == "track" else (0.0, 30.0)
    angle = torch.rand(n, generator=gen, dtype=torch.float64) * (hi - lo) + lo
    axes = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    axes = axes / axes.norm(dim=1, keepdim=True)
    t_std = 0.01 / math.sqrt(3) if scale == "track" else 0.06 * trainer.obj.diameter
    hyp = gt.clone()
    hyp[:, :3, :3] = so3_exp_map(axes * torch.deg2rad(angle)[:, None]) @ gt[:, :3, :3]
    hyp[:, :3, 3] += torch.randn(n, 3, generator=gen, dtype=torch.float64) * t_std
    return frames, hyp.float(), gt.float()


@torch.no_grad()
def refine(trainer: Trainer, frames, hyp, iterations: int) -> list[torch.Tensor]:
    net = trainer.refiner.eval()
    poses, out = hyp, []
    for _ in range(iterations):
        inputs = build_refiner_inputs_per_frame(poses, frames.rgb, frames.xyz_cam, frames.Ks, trainer.obj,
                                                trainer.renderer, crop_size=trainer.config.crop_size)
        trans, rot = net(nchw(inputs.render_input), nchw(inputs.transf_input))
        poses = apply_refiner_output(poses, trans.float(), rot.float(), trainer.obj.diameter)
        out.append(poses)
    trainer.refiner.train()
    return out


def errors(trainer: Trainer, poses, gt) -> dict[str, float]:
    d = trainer.obj.diameter
    add = add_per_hypothesis(poses, gt, trainer.points) / d
    rot = torch.rad2deg(so3_log((poses[:, :3, :3] @ gt[:, :3, :3].transpose(1, 2)).double()).norm(dim=1))
    trans_mm = (poses[:, :3, 3] - gt[:, :3, 3]).norm(dim=1) * 1000
    return {"add_d_mean": round(float(add.mean()), 4), "add_d_median": round(float(add.median()), 4),
            "success": round(float((add < 0.1).float().mean()), 3), "rot_deg_median": round(float(rot.median()), 2),
            "rot_deg_mean": round(float(rot.mean()), 2), "trans_mm_median": round(float(trans_mm.median()), 2)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variant", choices=sorted(VARIANTS), default="base")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--crop", type=int, default=48)
    p.add_argument("--views", type=int, default=48)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    opts = dict(VARIANTS[args.variant])
    cfg = TrainConfig(mesh=MESH, out_dir=Path(tempfile.mkdtemp()), steps=args.steps, crop_size=args.crop,
                      frame_hw=(112, 144), refiner_batch=args.batch, device="cpu", renderer="cpu", progress=False,
                      scorer_fraction=0.0, warmup_steps=max(1, args.steps // 10), log_every=10**9,
                      **opts)
    trainer = Trainer(cfg)
    sets = {scale: held_out(trainer, args.views, scale, 777 + i) for i, scale in enumerate(("track", "register"))}
    start = time.perf_counter()
    losses = []
    while trainer.step < args.steps:
        out = trainer.train_step()
        losses.append(float(out["refiner_loss"]))
    result = {"variant": args.variant, "steps": args.steps, "batch": args.batch, "crop": args.crop,
              "train_s": round(time.perf_counter() - start, 1),
              "loss_first10": round(float(np.mean(losses[:10])), 4), "loss_last10": round(float(np.mean(losses[-10:])), 4)}
    for scale, (frames, hyp, gt) in sets.items():
        iters = refine(trainer, frames, hyp, 2 if scale == "track" else 4)
        result[scale] = {"before": errors(trainer, hyp, gt)}
        for i, poses in enumerate(iters):
            result[scale][f"iter{i + 1}"] = errors(trainer, poses, gt)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
