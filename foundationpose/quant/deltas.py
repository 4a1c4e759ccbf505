"""Accuracy of FP8, measured: per-layer output deltas, and fp16-vs-fp8 evaluation reports side by side.

* :func:`layer_deltas` runs the float32 inference copy and its FP8 copy on the same inputs and reports, for every
  layer and block, how far the FP8 network's activation has drifted from the float32 one (relative RMS): where
  the error enters and how it grows through the network, plus the network outputs' delta
  (:func:`foundationpose.quant.calibrate.output_delta`).
* :func:`compare_precisions` takes ``foundationpose.evaluate`` reports of the same data at several precisions and
  states the differences that decide whether FP8 pays: register success rate (points), mean ADD-S and ADD
  (millimetres), track drift, each checked against the limits of the FP8 work (<= 1 mm of mean ADD-S, <= 1 point
  of register success).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from foundationpose.models.blocks import ConvBNReLU, ResBlock, SelfAttention
from foundationpose.models.unrolled import EncoderLayer
from foundationpose.quant.calibrate import (
    PairBatch,
    collect_outputs,
    exact_float32,
    output_delta,
    run_network,
)
from foundationpose.quant.modules import Fp8Module

__all__ = ["ACCURACY_LIMITS", "compare_precisions", "layer_deltas"]

# The FP8 work's accuracy limits against the 16-bit baseline (the figures).
ACCURACY_LIMITS = {"adds_mean_mm": 1.0, "register_success_points": 1.0}

_TRACKED = (nn.Conv2d, nn.Linear, Fp8Module, nn.LayerNorm, ConvBNReLU, ResBlock, SelfAttention, EncoderLayer)


def _tracked_names(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if name and isinstance(module, _TRACKED)]


class _Recorder:
    """Forward hooks keyed by (layer name, call index within one forward): shared modules may run twice."""

    def __init__(self, model: nn.Module, names: Sequence[str], on_output: Callable[[tuple[str, int], Tensor], None]):
        self.calls: dict[str, int] = {}
        self.handles = [model.get_submodule(name).register_forward_hook(self._hook(name)) for name in names]
        self.on_output = on_output

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            if isinstance(output, Tensor):
                index = self.calls.get(name, 0)
                self.calls[name] = index + 1
                self.on_output((name, index), output.detach())
        return hook

    def new_forward(self) -> None:
        self.calls.clear()

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


@torch.no_grad()
def layer_deltas(network: str, reference: nn.Module, quantised: nn.Module, batches: Sequence[PairBatch]) -> dict[str, Any]:
    """Per-layer drift of ``quantised`` from ``reference`` (same architecture and layer names) on ``batches``.

    Returns ``{"layers": [{"name", "type", "fp8", "rel_rms", "max_abs"}...], "outputs": output_delta(...)}``;
    ``rel_rms`` = RMS(quantised - reference) / RMS(reference) of the layer's output over all batches, in forward
    order. Activations of one batch are held on the device at a time: keep batches small. TF32 is off inside.
    """
    with exact_float32():
        return _layer_deltas(network, reference, quantised, batches)


def _layer_deltas(network: str, reference: nn.Module, quantised: nn.Module, batches: Sequence[PairBatch]) -> dict[str, Any]:
    names = _tracked_names(reference)
    fp8_names = {name for name, m in quantised.named_modules() if isinstance(m, Fp8Module)}
    types = {name: type(quantised.get_submodule(name)).__name__ for name in names}
    stored: dict[tuple[str, int], Tensor] = {}
    sums: dict[tuple[str, int], list[float]] = {}  # [sum sq diff, sum sq ref, max abs diff]

    def keep(key: tuple[str, int], out: Tensor) -> None:
        stored[key] = out.float().clone()  # clone: an in-place ReLU would change it afterwards

    def compare(key: tuple[str, int], out: Tensor) -> None:
        ref = stored.pop(key, None)
        if ref is None or ref.shape != out.shape:
            return
        diff = out.float() - ref
        acc = sums.setdefault(key, [0.0, 0.0, 0.0])
        acc[0] += float(diff.square().sum())
        acc[1] += float(ref.square().sum())
        acc[2] = max(acc[2], float(diff.abs().max()))

    ref_rec, q_rec = _Recorder(reference, names, keep), _Recorder(quantised, names, compare)
    try:
        for batch in batches:
            ref_rec.new_forward()
            q_rec.new_forward()
            run_network(reference, batch)
            run_network(quantised, batch)
            stored.clear()
    finally:
        ref_rec.close()
        q_rec.close()
    rows = []
    for (name, index), (sq_diff, sq_ref, max_abs) in sums.items():  # insertion order = forward order
        rows.append({"name": name if index == 0 else f"{name}#{index}", "type": types[name], "fp8": name in fp8_names,
                     "rel_rms": (sq_diff / sq_ref) ** 0.5 if sq_ref > 0 else None, "max_abs": max_abs})
    outputs = output_delta(network, collect_outputs(reference, batches), collect_outputs(quantised, batches))
    return {"layers": rows, "outputs": outputs, "samples": int(sum(b.a.shape[0] for b in batches))}


def _get(report: Mapping[str, Any], *path: str) -> float | None:
    node: Any = report
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    return float(node) if isinstance(node, (int, float)) else None


def compare_precisions(reports: Mapping[str, Mapping[str, Any]], baseline: str = "fp16") -> dict[str, Any]:
    """Differences of ``foundationpose.evaluate`` reports (one per precision, same data) from ``baseline``'s.

    reports: precision -> the evaluate JSON (``views`` and / or ``sequence`` sections, as ``python -m
    foundationpose.evaluate`` prints them). Returns, per other precision: ``register_success_points`` (views'
    register success rate difference x 100), ``adds_mean_mm`` / ``add_mean_mm`` (views and sequence mean
    differences, millimetres), ``sequence_drift_mm`` (difference of the sequence's last-minus-first ADD), and
    ``within_limits`` against :data:`ACCURACY_LIMITS` (None when a needed figure is absent). Positive = worse.
    """
    if baseline not in reports:
        raise ValueError(f"compare_precisions: no report for the baseline {baseline!r}; got {sorted(reports)}")
    base = reports[baseline]
    out: dict[str, Any] = {"baseline": baseline, "limits": dict(ACCURACY_LIMITS), "precisions": {}}
    for precision, report in reports.items():
        if precision == baseline:
            continue
        row: dict[str, Any] = {}

        def diff(*path: str, scale: float = 1.0, sign: float = 1.0, _r: Mapping[str, Any] = report) -> float | None:
            a, b = _get(_r, *path), _get(base, *path)
            return None if a is None or b is None else sign * (a - b) * scale

        row["register_success_points"] = diff("views", "register_success_rate", scale=100.0, sign=-1.0)
        row["views_adds_mean_mm"] = diff("views", "adds_m", "mean", scale=1000.0)
        row["views_add_mean_mm"] = diff("views", "add_m", "mean", scale=1000.0)
        row["sequence_adds_mean_mm"] = diff("sequence", "adds_m", "mean", scale=1000.0)
        row["sequence_add_mean_mm"] = diff("sequence", "add_m", "mean", scale=1000.0)
        row["sequence_success_points"] = diff("sequence", "success_rate", scale=100.0, sign=-1.0)
        row["sequence_drift_mm"] = diff("sequence", "drift", "add_last_minus_first_m", scale=1000.0)
        adds = [v for v in (row["views_adds_mean_mm"], row["sequence_adds_mean_mm"]) if v is not None]
        checks = []
        if adds:
            checks.append(max(adds) <= ACCURACY_LIMITS["adds_mean_mm"])
        if row["register_success_points"] is not None:
            checks.append(row["register_success_points"] <= ACCURACY_LIMITS["register_success_points"])
        row["within_limits"] = all(checks) if checks else None
        out["precisions"][precision] = row
    return out
