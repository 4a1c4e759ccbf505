"""The training loop: alternating refiner and scorer steps, schedule, mixed precision, logs, checkpoints.

Files in ``TrainConfig.out_dir``:

* ``2023-10-28-18-33-37/`` and ``2024-01-11-20-02-45/``: ``model_best.pth`` + ``config.yml`` (the official
  layout, loadable with ``--weights DIR`` everywhere), rewritten at every checkpoint and at the end;
* ``train_state.pt``: both models, both optimisers, step counters, elapsed time, the generators' states and
  the log history (a later run with the same ``out_dir`` resumes from it);
* ``train_log.jsonl``: one JSON object per ``log_every`` steps (losses, lr, throughput, memory);
* ``loss_curve.png``; ``train_summary.json``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from foundationpose.mesh import load_object
from foundationpose.models import RefineNet, ScoreNetMultiPair, randomize_
from foundationpose.pose_update import apply_refiner_output
from foundationpose.render import RenderConfig, make_renderer
from foundationpose.runtime import resolve_device
from foundationpose.train.batches import PairBatch, SampleSource, nchw
from foundationpose.train.config import TrainConfig
from foundationpose.train.loss_plot import plot_curves
from foundationpose.train.refiner_targets import refiner_loss, refiner_targets, so3_log
from foundationpose.train.scorer_ranking import add_per_hypothesis, ranking_loss
from foundationpose.weights import load_refiner, load_scorer, write_weights

__all__ = ["STATE_FILE", "LOG_FILE", "CURVE_FILE", "SUMMARY_FILE", "Trainer", "lr_factor", "small_motion_rotation_errors"]

logger = logging.getLogger(__name__)

STATE_FILE, LOG_FILE, CURVE_FILE, SUMMARY_FILE = "train_state.pt", "train_log.jsonl", "loss_curve.png", "train_summary.json"
_HEADER = (
    "# FoundationPose {kind} trained by foundationpose.train for ONE object (see 'trained' below): object-specific\n"
    "# weights, not the general FoundationPose model. Same architecture and inputs as the official run.\n"
)


def lr_factor(step: int, progress: float, warmup_steps: int, min_fraction: float) -> float:
    """Linear warm-up over ``warmup_steps``, then a cosine from 1 to ``min_fraction`` over ``progress`` in [0, 1]."""
    warm = min(1.0, (step + 1) / max(1, warmup_steps))
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, max(0.0, progress))))
    return warm * (min_fraction + (1.0 - min_fraction) * cosine)


def _autocast(device: torch.device, precision: str):
    if precision == "fp32":
        return nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


class Trainer:
    """Trains RefineNet and ScoreNetMultiPair for one mesh; ``run()`` until the budget is spent."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = cfg = config
        self.device = resolve_device(cfg.device)
        self.precision = cfg.precision if cfg.precision != "auto" else ("bf16" if self.device.type == "cuda" else "fp32")
        if self.precision == "fp16" and self.device.type != "cuda":
            raise ValueError("precision fp16 needs a CUDA device")
        self.out_dir = Path(cfg.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.obj = load_object(cfg.mesh, device=self.device)
        # every synthetic sample has its own random camera: memoising P per K would only fill the memo
        self.renderer = make_renderer(cfg.renderer, self.device,
                                      RenderConfig(crop_size_px=cfg.crop_size, cache_intrinsics=False))
        self.refiner, self.scorer = self._init_models()
        fused = {"fused": True} if self.device.type == "cuda" else {}
        self.opt_refiner = torch.optim.AdamW(self.refiner.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, **fused)
        self.scorer_lr = cfg.scorer_lr if cfg.scorer_lr is not None else cfg.lr
        self.opt_scorer = torch.optim.AdamW(self.scorer.parameters(), lr=self.scorer_lr, weight_decay=cfg.weight_decay,
                                            **fused)
        # fp16 needs loss scaling (bf16 and fp32 do not): one scaler per optimiser, disabled otherwise
        self.scalers = {id(opt): torch.amp.GradScaler("cuda", enabled=self.precision == "fp16")
                        for opt in (self.opt_refiner, self.opt_scorer)}
        torch.manual_seed(cfg.seed)  # the global generators drive dropout; saved and restored with the state
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.device_gen = torch.Generator(device=self.device).manual_seed(cfg.seed + 1)
        self.source = SampleSource(self.obj, self.renderer, frame_hw=cfg.frame_hw, crop_size=cfg.crop_size,
                                   gen=self.gen, device_gen=self.device_gen, scene=cfg.scene, perturb=cfg.perturb,
                                   ranking=cfg.ranking)
        points = np.unique(np.asarray(self.obj.mesh_centred.vertices, dtype=np.float64), axis=0)
        self.points = torch.as_tensor(points, dtype=torch.float32, device=self.device)  # centred frame
        self.step = self.refiner_steps = self.scorer_steps = 0
        self.elapsed_s = 0.0
        self.history: list[dict[str, Any]] = []
        self._window: dict[str, list[float]] = {}
        self._samples_in_window = 0
        self._resume()

    # -- set-up ---------------------------------------------------------------------------------------------

    def _init_models(self) -> tuple[nn.Module, nn.Module]:
        cfg = self.config
        if cfg.init is not None:
            refiner, scorer = load_refiner(cfg.init), load_scorer(cfg.init)
        else:
            refiner, scorer = randomize_(RefineNet(), seed=cfg.seed), randomize_(ScoreNetMultiPair(), seed=cfg.seed + 1)
            if cfg.zero_init_heads:
                for head in (refiner.trans_head[1], refiner.rot_head[1]):  # start at "no update"
                    nn.init.zeros_(head.weight)
                    nn.init.zeros_(head.bias)
        memory_format = torch.channels_last if self.device.type == "cuda" else torch.contiguous_format
        return (refiner.to(self.device, memory_format=memory_format).train(),
                scorer.to(self.device, memory_format=memory_format).train())

    def _resume(self) -> None:
        path = self.out_dir / STATE_FILE
        if not path.is_file():
            return
        state = torch.load(path, map_location=self.device, weights_only=False)
        self.refiner.load_state_dict(state["refiner"])
        self.scorer.load_state_dict(state["scorer"])
        self.opt_refiner.load_state_dict(state["opt_refiner"])
        self.opt_scorer.load_state_dict(state["opt_scorer"])
        self.step, self.refiner_steps, self.scorer_steps = state["step"], state["refiner_steps"], state["scorer_steps"]
        self.elapsed_s = float(state["elapsed_s"])
        self.gen.set_state(state["gen"])
        self.device_gen.set_state(state["device_gen"].to(self.device_gen.get_state().device))
        self.history = list(state["history"])
        torch.set_rng_state(state["torch_rng"])
        if self.device.type == "cuda" and state.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        logger.info("resumed from %s at step %d (%.1f min trained)", path, self.step, self.elapsed_s / 60)

    def _save(self) -> None:
        state = {
            "refiner": self.refiner.state_dict(), "scorer": self.scorer.state_dict(),
            "opt_refiner": self.opt_refiner.state_dict(), "opt_scorer": self.opt_scorer.state_dict(),
            "step": self.step, "refiner_steps": self.refiner_steps, "scorer_steps": self.scorer_steps,
            "elapsed_s": self.elapsed_s, "gen": self.gen.get_state(), "device_gen": self.device_gen.get_state(),
            "history": self.history, "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
        }
        tmp = self.out_dir / (STATE_FILE + ".tmp")
        torch.save(state, tmp)
        tmp.replace(self.out_dir / STATE_FILE)
        self.export_weights()
        plot_curves(self.out_dir / CURVE_FILE, self.history, "minutes",
                    ("refiner_loss", "refiner_add_after_d", "refiner_small_rot_after_deg", "scorer_loss", "scorer_pick_miss"),
                    f"{self.obj.name}: training losses (log10)")

    def export_weights(self, root: Path | None = None) -> Path:
        """Both networks in the official layout under ``root`` (default: the run's ``out_dir``)."""
        cfg = self.config
        trained = {
            "object": self.obj.name, "mesh": str(cfg.mesh), "diameter_m": round(self.obj.diameter, 6),
            "steps": self.step, "refiner_steps": self.refiner_steps, "scorer_steps": self.scorer_steps,
            "minutes": round(self.elapsed_s / 60, 3), "seed": cfg.seed, "init": None if cfg.init is None else str(cfg.init),
            "note": "object-specific weights from synthetic data (foundationpose.train); not the general model",
        }
        return write_weights(root or self.out_dir, self.refiner, self.scorer, extra_config={"trained": trained},
                             header=_HEADER)

    # -- steps ----------------------------------------------------------------------------------------------

    def _progress(self) -> float:
        cfg = self.config
        if cfg.steps is not None:
            return self.step / cfg.steps
        return self.elapsed_s / (cfg.minutes * 60)

    def _set_lr(self, opt: torch.optim.Optimizer, net_step: int, peak: float) -> float:
        lr = peak * lr_factor(net_step, self._progress(), self.config.warmup_steps, self.config.min_lr_fraction)
        for group in opt.param_groups:
            group["lr"] = lr
        return lr

    def _optimise(self, opt: torch.optim.Optimizer, model: nn.Module, loss: Tensor) -> bool:
        """One clipped update; False (and no update) when the gradient is not finite.

        A single non-finite batch must not poison the weights for good (bf16 and fp32 have no loss scaler
        to skip it; under fp16 the scaler skips it too). Costs one host read of the gradient norm per step.
        """
        scaler = self.scalers[id(opt)]
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norm = nn.utils.clip_grad_norm_(model.parameters(), self.config.grad_clip)
        if not bool(torch.isfinite(norm)):
            opt.zero_grad(set_to_none=True)
            scaler.update()  # fp16: lowers the scale as a skipped step would; a no-op otherwise
            return False
        scaler.step(opt)
        scaler.update()
        return True

    def refiner_step(self, batch: PairBatch | None = None) -> dict[str, Tensor | float]:
        """One refiner update on ``batch`` (default: a fresh synthetic batch); returns the step's metrics."""
        cfg = self.config
        lr = self._set_lr(self.opt_refiner, self.refiner_steps, self.config.lr)
        if batch is None:
            batch = self.source.refiner_batch(cfg.refiner_batch, cfg.hypotheses_per_scene)
        trans_t, rot_t = refiner_targets(batch.hypotheses, batch.cam_from_centred_gt, self.obj.diameter)
        with _autocast(self.device, self.precision):
            trans, rot = self.refiner(nchw(batch.render_input), nchw(batch.transf_input))
        loss = refiner_loss(trans, rot, trans_t, rot_t, cfg.loss)
        applied = self._optimise(self.opt_refiner, self.refiner, loss.total)
        self.refiner_steps += 1
        with torch.no_grad():  # ADD before / after this step's predicted update, in diameters
            updated = apply_refiner_output(batch.hypotheses, trans.detach().float(), rot.detach().float(), self.obj.diameter)
            before = add_per_hypothesis(batch.hypotheses, batch.cam_from_centred_gt, self.points).mean()
            after = add_per_hypothesis(updated, batch.cam_from_centred_gt, self.points).mean()
            small_before, small_after = small_motion_rotation_errors(batch.hypotheses, updated, batch.cam_from_centred_gt)
        self._samples_in_window += batch.hypotheses.shape[0]
        return {"refiner_loss": loss.total.detach(), "refiner_trans": loss.trans.detach(), "refiner_rot": loss.rot.detach(),
                "refiner_add_before_d": before / self.obj.diameter, "refiner_add_after_d": after / self.obj.diameter,
                "refiner_small_rot_before_deg": small_before, "refiner_small_rot_after_deg": small_after,
                "refiner_lr": lr, "refiner_skipped": 0.0 if applied else 1.0}

    def scorer_step(self, batch: PairBatch | None = None) -> dict[str, Tensor | float]:
        """One scorer update on ``batch`` (default: fresh synthetic sets, set-major rows); returns the metrics."""
        cfg = self.config
        size = cfg.ranking.set_size
        lr = self._set_lr(self.opt_scorer, self.scorer_steps, self.scorer_lr)
        if batch is None:
            batch = self.source.scorer_batch(cfg.scorer_sets)
        sets = batch.hypotheses.shape[0] // size
        with _autocast(self.device, self.precision):
            logits = self.scorer(nchw(batch.render_input), nchw(batch.transf_input), L=size)  # (sets, L)
        add = add_per_hypothesis(batch.hypotheses.reshape(sets, size, 4, 4),
                                 batch.cam_from_centred_gt.reshape(sets, size, 4, 4), self.points)
        loss, hit = ranking_loss(logits, add, self.obj.diameter, cfg.ranking)
        applied = self._optimise(self.opt_scorer, self.scorer, loss)
        self.scorer_steps += 1
        self._samples_in_window += sets * size
        # what register needs: the pick within 0.1 d (every set holds such near hypotheses), not the exact closest
        pick_bad = (add.gather(1, logits.detach().argmax(dim=1, keepdim=True))[:, 0] >= 0.1 * self.obj.diameter).float()
        return {"scorer_loss": loss.detach(), "scorer_miss": 1.0 - hit.detach(), "scorer_pick_miss": pick_bad.mean(),
                "scorer_lr": lr, "scorer_skipped": 0.0 if applied else 1.0}

    def _is_scorer_step(self, step: int) -> bool:
        f = self.config.scorer_fraction
        return math.floor((step + 1) * f) > math.floor(step * f)

    def train_step(self) -> dict[str, Tensor | float]:
        """One optimiser step of the network whose turn it is (``scorer_fraction`` of the steps are the scorer's)."""
        out = self.scorer_step() if self._is_scorer_step(self.step) else self.refiner_step()
        self.step += 1
        for key, value in out.items():
            self._window.setdefault(key, []).append(value)
        return out

    # -- the run --------------------------------------------------------------------------------------------

    def _log_row(self, window_s: float) -> dict[str, Any]:
        row: dict[str, Any] = {"step": self.step, "refiner_steps": self.refiner_steps, "scorer_steps": self.scorer_steps,
                               "minutes": round(self.elapsed_s / 60, 4)}
        for key, values in self._window.items():
            row[key] = float(torch.stack([torch.as_tensor(v, dtype=torch.float32).cpu() for v in values]).mean())
        row["samples_per_s"] = round(self._samples_in_window / window_s, 1) if window_s > 0 else None
        if self.device.type == "cuda":
            row["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(self.device) / 2**30, 2)
        self._window, self._samples_in_window = {}, 0
        return row

    def done(self) -> bool:
        cfg = self.config
        return self.elapsed_s >= cfg.minutes * 60 or (cfg.steps is not None and self.step >= cfg.steps)

    def run(self, stop_after: int | None = None) -> dict[str, Any]:
        """Train until the budget is spent (or, with ``stop_after``, for at most that many steps in this call, as
        an interruption would); the state is saved either way, so a new Trainer on the same ``out_dir`` resumes."""
        cfg = self.config
        first_step = self.step
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=self.step, file=sys.stderr, disable=not cfg.progress, unit="step",
                   mininterval=1.0, desc=f"train {self.obj.name}")
        log = (self.out_dir / LOG_FILE).open("a", encoding="utf-8")
        base_s, run_start, excluded_s = self.elapsed_s, time.perf_counter(), 0.0
        last_ckpt = self.elapsed_s
        window_start = run_start
        try:
            while not self.done() and (stop_after is None or self.step - first_step < stop_after):
                self.train_step()
                if self.step % cfg.log_every == 0:
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    now = time.perf_counter()
                    self.elapsed_s = base_s + now - run_start - excluded_s
                    row = self._log_row(now - window_start)
                    window_start = now
                    self.history.append(row)
                    log.write(json.dumps(row) + "\n")
                    log.flush()
                    bar.set_postfix({k: f"{row[k]:.3g}" for k in ("refiner_loss", "refiner_add_after_d", "scorer_loss")
                                     if row.get(k) is not None})
                self.elapsed_s = base_s + time.perf_counter() - run_start - excluded_s
                bar.update(1)
                if self.elapsed_s - last_ckpt >= cfg.checkpoint_minutes * 60 and not self.done():
                    save_start = time.perf_counter()
                    self._save()
                    excluded_s += time.perf_counter() - save_start  # checkpoints do not count as training time
                    last_ckpt = self.elapsed_s
                    window_start = time.perf_counter()
            if self._window:  # the last, partial window
                row = self._log_row(time.perf_counter() - window_start)
                self.history.append(row)
                log.write(json.dumps(row) + "\n")
        finally:
            bar.close()
            log.close()
        self._save()
        summary = {"object": self.obj.name, "diameter_m": self.obj.diameter, "device": str(self.device),
                   "precision": self.precision, "steps": self.step, "refiner_steps": self.refiner_steps,
                   "scorer_steps": self.scorer_steps, "minutes": self.elapsed_s / 60,
                   "weights": str(self.out_dir), "last": self.history[-1] if self.history else None,
                   "config": _jsonable(dataclasses.asdict(cfg))}
        if self.device.type == "cuda":
            summary["peak_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        (self.out_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        return summary


def small_motion_rotation_errors(hypotheses: Tensor, updated: Tensor, cam_from_centred_gt: Tensor,
                                 below_deg: float = 5.0) -> tuple[Tensor, Tensor]:
    """Mean rotation error (degrees) before and after one update over the hypotheses that started within
    ``below_deg`` of the truth (track and late-register scale): the precision the register and track need,
    which the batch-wide ADD hides behind the large register perturbations. 0-d tensors; no host sync."""
    gt_r = cam_from_centred_gt[:, :3, :3].float().transpose(1, 2)
    before = torch.rad2deg(so3_log(hypotheses[:, :3, :3].float() @ gt_r).norm(dim=1))
    after = torch.rad2deg(so3_log(updated[:, :3, :3].float() @ gt_r).norm(dim=1))
    small = (before < below_deg).float()
    count = small.sum().clamp(min=1.0)
    return (before * small).sum() / count, (after * small).sum() / count


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value
