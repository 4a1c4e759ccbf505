"""FP8 calibration: activation scales, a per-layer sensitivity study, and the layers that stay 16-bit.

For each network, on synthetic views of the object the weights were trained for (made by the training code:
:class:`foundationpose.train.batches.SampleSource`, so the crops are the tensors inference builds):

1. **Scales.** The float32 inference copy (batch norms folded, attention unrolled) runs the calibration batches;
   a forward pre-hook keeps the largest |input| of every eligible layer; ``input_scale = amax * margin / 448``.
2. **Sensitivity.** Each eligible layer alone is put in FP8 (emulated: exact E4M3 rounding) and the network's
   output is compared with the float32 output on the same batches. The refiner's outputs are compared as the pose
   update they produce: translation in object diameters (``0.5 |d trans|``, spec 2.7) and rotation in degrees
   (``|d (tanh(rot) * 20 deg)|``); the scorer's as the RMS change of a set's logits over the set's logit spread
   (std), plus how often the set's argmax (the register pick) changes.
3. **Decision.** A layer runs in FP8 when its own delta is within the per-layer limits; then, with all of those
   in FP8 together, the most sensitive ones go back to 16-bit until the combined delta is within the total limits.
4. **Held-out deltas.** The chosen configuration against float32 on batches drawn from another seed stream.

The limits (``CalibrationConfig``) are engineering defaults, not accuracy results: the accuracy of FP8 is what
``foundationpose.evaluate`` measures with both precisions (ADD-S, register success; see
:func:`foundationpose.quant.deltas.compare_precisions`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from foundationpose.pose_update import ROT_NORMALIZER
from foundationpose.quant.fp8 import E4M3_MAX
from foundationpose.quant.quantize import copy_with_fp8, inference_copy, swap_layer, to_fp8
from foundationpose.quant.scales import (
    Fp8Scales,
    LayerScale,
    eligible_layers,
    layer_kind,
    weights_fingerprint,
)

__all__ = [
    "CALIBRATION_SEED_OFFSET",
    "DELTAS_SEED_OFFSET",
    "CalibrationConfig",
    "PairBatch",
    "calibrate_network",
    "collect_outputs",
    "exact_float32",
    "layer_flops",
    "make_batches",
    "observe_input_amax",
    "output_delta",
    "sensitivity_study",
]

logger = logging.getLogger(__name__)

# Seed streams, disjoint from training's (seed, seed + 1) and evaluate's held-out views (seed + 1_000_003).
CALIBRATION_SEED_OFFSET = 2_000_029
DELTAS_SEED_OFFSET = 3_000_017


@dataclass(frozen=True, slots=True, kw_only=True)
class CalibrationConfig:
    """How much synthetic data calibration uses and the limits of the FP8 decision.

    Sizes: ``refiner_batches`` x ``refiner_batch`` hypotheses (``hypotheses_per_scene`` around each observation)
    and ``scorer_batches`` x ``scorer_sets`` sets of ``set_size`` hypotheses calibrate the scales; the first
    ``sensitivity_batches`` of each also drive the sensitivity study; ``heldout_batches`` more of each, from
    another seed stream, give the reported deltas.
    Limits (means over hypotheses / sets): per layer alone and for the whole network in FP8.
    """

    refiner_batches: int = 8
    refiner_batch: int = 32
    hypotheses_per_scene: int = 4
    scorer_batches: int = 8
    scorer_sets: int = 1
    set_size: int = 32
    sensitivity_batches: int = 2
    heldout_batches: int = 2
    seed: int = 0
    crop_size: int = 160  # the networks' crop; less only for smoke tests
    frame_hw: tuple[int, int] = (256, 320)  # as training's observations
    margin: float = 1.0  # activation amax multiplier (> 1 leaves headroom for larger inputs than calibration saw)
    layer_trans_diameters: float = 0.002  # refiner update translation change, one layer in FP8
    layer_rot_deg: float = 0.1  # refiner update rotation change, one layer in FP8
    layer_logit_std: float = 0.05  # scorer logit change over the set's logit std, one layer in FP8
    total_trans_diameters: float = 0.005
    total_rot_deg: float = 0.25
    total_logit_std: float = 0.15

    def __post_init__(self) -> None:
        for name in ("refiner_batches", "refiner_batch", "hypotheses_per_scene", "scorer_batches", "scorer_sets",
                     "sensitivity_batches", "heldout_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.set_size < 2:
            raise ValueError(f"set_size must be >= 2; got {self.set_size}")
        if self.refiner_batch % self.hypotheses_per_scene:
            raise ValueError(f"refiner_batch ({self.refiner_batch}) must be a multiple of hypotheses_per_scene "
                             f"({self.hypotheses_per_scene})")
        if not self.margin >= 1.0:
            raise ValueError(f"margin must be >= 1; got {self.margin}")


@dataclass(slots=True)
class PairBatch:
    """Network inputs: a (rendered), b (real) (N, 6, S, S) float32 NCHW views; ``set_size`` L for the scorer."""

    a: Tensor
    b: Tensor
    set_size: int | None = None


def run_network(model: nn.Module, batch: PairBatch) -> tuple[Tensor, ...]:
    """One forward; the refiner's (trans, rot) or the scorer's (logits (N // L, L),)."""
    if batch.set_size is None:
        return tuple(model(batch.a, batch.b))
    return (model(batch.a, batch.b, L=batch.set_size),)


def make_batches(network: str, source: Any, n: int, config: CalibrationConfig) -> list[PairBatch]:
    """``n`` batches of ``network`` inputs from a :class:`foundationpose.train.batches.SampleSource`."""
    from foundationpose.train.batches import nchw

    out = []
    for _ in range(n):
        if network == "refiner":
            pairs = source.refiner_batch(config.refiner_batch, config.hypotheses_per_scene)
            out.append(PairBatch(nchw(pairs.render_input), nchw(pairs.transf_input)))
        else:
            pairs = source.scorer_batch(config.scorer_sets)
            out.append(PairBatch(nchw(pairs.render_input), nchw(pairs.transf_input), config.set_size))
    return out


@torch.no_grad()
def observe_input_amax(model: nn.Module, layers: Sequence[str], batches: Sequence[PairBatch]) -> dict[str, float]:
    """Largest |input| of each named layer over ``batches`` (one host read per layer, at the end)."""
    amax: dict[str, Tensor] = {}

    def observer(name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, args: tuple[Tensor, ...]) -> None:
            value = args[0].detach().abs().amax().to(torch.float32)
            amax[name] = value if name not in amax else torch.maximum(amax[name], value)
        return hook

    handles = [model.get_submodule(name).register_forward_pre_hook(observer(name)) for name in layers]
    try:
        for batch in batches:
            run_network(model, batch)
    finally:
        for handle in handles:
            handle.remove()
    missing = [name for name in layers if name not in amax]
    if missing:
        raise RuntimeError(f"calibration never ran layer(s) {missing}")
    return {name: float(amax[name]) for name in layers}


@torch.no_grad()
def layer_flops(model: nn.Module, layers: Sequence[str], batch: PairBatch) -> dict[str, float]:
    """Multiply-add FLOPs (2 per MAC) of each named Conv2d / Linear per network sample, from one forward."""
    flops: dict[str, float] = {}

    def counter(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, _args: tuple[Tensor, ...], out: Tensor) -> None:
            fan_in = module.weight[0].numel()  # C_in * k * k, or in_features
            flops[name] = flops.get(name, 0.0) + 2.0 * out.numel() * fan_in
        return hook

    handles = [model.get_submodule(name).register_forward_hook(counter(name)) for name in layers]
    try:
        run_network(model, batch)
    finally:
        for handle in handles:
            handle.remove()
    n = batch.a.shape[0]
    return {name: flops.get(name, 0.0) / n for name in layers}


@torch.no_grad()
def collect_outputs(model: nn.Module, batches: Sequence[PairBatch]) -> tuple[Tensor, ...]:
    """The network outputs over all batches, concatenated along the first dimension (float32)."""
    outs = [run_network(model, batch) for batch in batches]
    return tuple(torch.cat([o[i].float() for o in outs]) for i in range(len(outs[0])))


def output_delta(network: str, reference: tuple[Tensor, ...], other: tuple[Tensor, ...]) -> dict[str, float]:
    """How far ``other`` outputs are from ``reference`` ones, in the units of the module docstring."""
    if network == "refiner":
        (t_ref, r_ref), (t, r) = reference, other
        trans = 0.5 * (t - t_ref).norm(dim=1)  # (N,) object diameters
        omega = (torch.tanh(r) - torch.tanh(r_ref)) * ROT_NORMALIZER
        rot = torch.rad2deg(omega.norm(dim=1))  # (N,) degrees
        return {"trans_diameters": float(trans.mean()), "trans_diameters_max": float(trans.max()),
                "rot_deg": float(rot.mean()), "rot_deg_max": float(rot.max())}
    (ref,), (out,) = reference, other  # (B, L)
    spread = ref.std(dim=1, keepdim=True).clamp_min(1e-12)
    rel = ((out - ref) / spread).pow(2).mean(dim=1).sqrt()  # (B,)
    return {"logit_rms_over_set_std": float(rel.mean()), "logit_rms_over_set_std_max": float(rel.max()),
            "top1_agreement": float((out.argmax(dim=1) == ref.argmax(dim=1)).float().mean())}


def delta_ratio(network: str, delta: dict[str, float], per_layer: bool, config: CalibrationConfig) -> float:
    """The delta over its limit (<= 1: within); the worst of the refiner's translation and rotation."""
    if network == "refiner":
        t_lim = config.layer_trans_diameters if per_layer else config.total_trans_diameters
        r_lim = config.layer_rot_deg if per_layer else config.total_rot_deg
        return max(delta["trans_diameters"] / t_lim, delta["rot_deg"] / r_lim)
    lim = config.layer_logit_std if per_layer else config.total_logit_std
    return delta["logit_rms_over_set_std"] / lim


@torch.no_grad()
def sensitivity_study(model: nn.Module, network: str, input_scales: dict[str, float],
                      batches: Sequence[PairBatch]) -> dict[str, dict[str, float]]:
    """Output delta of ``model`` with each named layer alone in FP8 (emulated), against ``model`` as it is."""
    reference = collect_outputs(model, batches)
    out = {}
    for name, scale in input_scales.items():
        original = swap_layer(model, name, to_fp8(model.get_submodule(name), scale, "emulate"))
        try:
            out[name] = output_delta(network, reference, collect_outputs(model, batches))
        finally:
            swap_layer(model, name, original)
    return out


@contextlib.contextmanager
def exact_float32() -> Iterator[None]:
    """TF32 off for convolutions and matmuls inside (the float32 reference must be float32 on a GPU too)."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@torch.no_grad()
def calibrate_network(net: nn.Module, network: str, calibration: Sequence[PairBatch], heldout: Sequence[PairBatch],
                      config: CalibrationConfig, provenance: dict[str, Any] | None = None) -> Fp8Scales:
    """Scales, sensitivity study and FP8 decision for one loaded network (see the module docstring)."""
    with exact_float32():
        return _calibrate_network(net, network, calibration, heldout, config, provenance)


def _calibrate_network(net: nn.Module, network: str, calibration: Sequence[PairBatch], heldout: Sequence[PairBatch],
                       config: CalibrationConfig, provenance: dict[str, Any] | None) -> Fp8Scales:
    start = time.perf_counter()
    model = inference_copy(net).float()
    layers = eligible_layers(model)
    amax = observe_input_amax(model, list(layers), calibration)
    scales = {name: max(value * config.margin, 1e-12) / E4M3_MAX for name, value in amax.items()}
    study_batches = calibration[: config.sensitivity_batches]
    sensitivity = sensitivity_study(model, network, scales, study_batches)
    ratios = {name: delta_ratio(network, sensitivity[name], True, config) for name in layers}
    reasons = {name: f"alone in FP8 its output delta is {ratios[name]:.2f}x the per-layer limit"
               for name in layers if not ratios[name] <= 1.0}
    chosen = [name for name in layers if name not in reasons]
    flops = layer_flops(model, list(layers), study_batches[0])
    reference = collect_outputs(model, study_batches)
    combined: dict[str, float] = {}
    while chosen:
        combined = output_delta(network, reference,
                                collect_outputs(copy_with_fp8(model, {n: scales[n] for n in chosen}), study_batches))
        total = delta_ratio(network, combined, False, config)
        if total <= 1.0:
            break
        # Independent errors add in quadrature: give back the layer with the most error variance per FLOP.
        worst = max(chosen, key=lambda n: ratios[n] ** 2 / max(flops[n], 1.0))
        chosen.remove(worst)
        reasons[worst] = (f"with the others in FP8 the network delta was {total:.2f}x the total limit; this layer "
                          "had the most error per FLOP left")
    quantised = copy_with_fp8(model, {n: scales[n] for n in chosen})
    held_reference = collect_outputs(model, heldout)
    deltas = {"heldout": output_delta(network, held_reference, collect_outputs(quantised, heldout)),
              "calibration": combined,
              "heldout_samples": int(sum(b.a.shape[0] for b in heldout)),
              "fp8_layers": len(chosen), "eligible_layers": len(layers),
              "fp8_gflop_per_sample": round(sum(flops[n] for n in chosen) / 1e9, 6),
              "eligible_gflop_per_sample": round(sum(flops.values()) / 1e9, 6)}
    entries = tuple(
        LayerScale(name=name, kind=layer_kind(module), weight_shape=tuple(module.weight.shape),
                   input_amax=amax[name], input_scale=scales[name], fp8=name in chosen,
                   reason=reasons.get(name, ""),
                   sensitivity={k: _finite(v) for k, v in sensitivity[name].items()}
                   | {"ratio": _finite(ratios[name]), "gflop_per_sample": round(flops[name] / 1e9, 6)})
        for name, module in layers.items())
    calibration_info = dict(provenance or {}) | {
        "config": _jsonable(dataclasses.asdict(config)),
        "samples": int(sum(b.a.shape[0] for b in calibration)),
        "seconds": round(time.perf_counter() - start, 2),
        "created_unix": int(time.time()),
    }
    logger.info("%s: %d of %d eligible layers in FP8; held-out delta %s", network, len(chosen), len(layers),
                deltas["heldout"])
    return Fp8Scales(network=network, weights_sha256=weights_fingerprint(net), layers=entries,
                     calibration=calibration_info, deltas=deltas)


def _finite(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value
