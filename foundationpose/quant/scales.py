"""The FP8 scales file written beside each network's weights, and the rules that tie it to those weights.

One JSON file per network, ``<weights root>/<run>/fp8_scales.json`` next to ``model_best.pth`` (small: one
activation scale per layer; the per-channel weight scales are a function of the weights and are recomputed at
load). Written by ``python -m foundationpose.train calibrate`` (:mod:`foundationpose.quant.calibrate`)::

    {"format": "foundationpose-fp8-scales", "version": 1, "network": "refiner", "fp8_dtype": "float8_e4m3fn",
     "weights_sha256": "...",                       # of the checkpoint's tensors: stale scales are refused
     "calibration": {...provenance: mesh, samples, seed, thresholds...},
     "layers": {"encodeA.1.net.0": {"kind": "conv2d", "weight_shape": [128, 64, 3, 3], "input_amax": 3.1,
                                    "input_scale": 0.0069, "fp8": true, "reason": "...",
                                    "sensitivity": {...}}, ...},
     "deltas": {...network output deltas fp32 vs fp8 on held-out synthetic data...}}

Layer names are those of the network's inference copy (:func:`foundationpose.quant.quantize.inference_copy`:
batch norms folded, attention unrolled). A file lists exactly the *eligible* layers of that copy
(:func:`eligible_layers`); ``fp8`` says which of them run in FP8 (the sensitivity study's decision).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from foundationpose.errors import WeightsError
from foundationpose.models.fold import fold_batchnorm
from foundationpose.models.unrolled import unroll

__all__ = [
    "CALIBRATE_COMMAND",
    "FORMAT",
    "SCALES_FILE",
    "VERSION",
    "Fp8Scales",
    "LayerScale",
    "check_layers",
    "eligible_layers",
    "load_scales",
    "read_scales",
    "scales_path",
    "weights_fingerprint",
    "write_scales",
]

SCALES_FILE = "fp8_scales.json"
FORMAT = "foundationpose-fp8-scales"
VERSION = 1
CALIBRATE_COMMAND = "python -m foundationpose.train calibrate --weights {root} --mesh <the object's mesh>"
NETWORKS = ("refiner", "scorer")

# Layers that stay 16-bit whatever their shape, and why (prefix of the layer name -> reason).
KEEP_16BIT: Mapping[str, str] = {
    "att_cross.": "cross-attention over the hypotheses of a set: negligible FLOPs (~2.6 MFLOP per hypothesis) "
                  "and its rows are the set size, not a multiple of 16",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerScale:
    """One eligible layer: its activation scale and whether it runs in FP8."""

    name: str
    kind: str  # "conv2d" | "linear"
    weight_shape: tuple[int, ...]
    input_amax: float  # largest |input| seen on calibration data
    input_scale: float  # dequantisation scale of the input: input_amax * margin / 448
    fp8: bool
    reason: str = ""  # why it stays 16-bit (empty when fp8)
    sensitivity: Mapping[str, float] = field(default_factory=dict)  # network output delta, this layer alone in FP8

    def __post_init__(self) -> None:
        if self.kind not in ("conv2d", "linear"):
            raise ValueError(f"{self.name}: kind must be conv2d or linear; got {self.kind!r}")
        if not (math.isfinite(self.input_scale) and self.input_scale > 0):
            raise ValueError(f"{self.name}: input_scale must be a finite number > 0; got {self.input_scale}")

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "weight_shape": list(self.weight_shape), "input_amax": self.input_amax,
                "input_scale": self.input_scale, "fp8": self.fp8, "reason": self.reason,
                "sensitivity": dict(self.sensitivity)}


@dataclass(frozen=True, slots=True, kw_only=True)
class Fp8Scales:
    """The content of one scales file (see the module docstring)."""

    network: str
    weights_sha256: str
    layers: tuple[LayerScale, ...]
    calibration: Mapping[str, Any] = field(default_factory=dict)
    deltas: Mapping[str, Any] = field(default_factory=dict)
    version: int = VERSION

    def __post_init__(self) -> None:
        if self.network not in NETWORKS:
            raise ValueError(f"network must be one of {NETWORKS}; got {self.network!r}")
        names = [layer.name for layer in self.layers]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.network}: duplicate layer names in the scales")

    @property
    def fp8_layers(self) -> tuple[LayerScale, ...]:
        return tuple(layer for layer in self.layers if layer.fp8)

    def by_name(self) -> dict[str, LayerScale]:
        return {layer.name: layer for layer in self.layers}

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": self.version, "network": self.network, "fp8_dtype": "float8_e4m3fn",
                "weights_sha256": self.weights_sha256, "calibration": dict(self.calibration),
                "layers": {layer.name: layer.to_json() for layer in self.layers}, "deltas": dict(self.deltas)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], source: str = "scales") -> Fp8Scales:
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise WeightsError(f"{source}: not an FP8 scales file (format {data.get('format') if isinstance(data, Mapping) else None!r}, "
                               f"expected {FORMAT!r})")
        if data.get("version") != VERSION:
            raise WeightsError(f"{source}: scales file version {data.get('version')!r}; this code reads version "
                               f"{VERSION}: recalibrate")
        try:
            layers = tuple(
                LayerScale(name=name, kind=entry["kind"], weight_shape=tuple(int(d) for d in entry["weight_shape"]),
                           input_amax=float(entry["input_amax"]), input_scale=float(entry["input_scale"]),
                           fp8=bool(entry["fp8"]), reason=str(entry.get("reason", "")),
                           sensitivity=dict(entry.get("sensitivity") or {}))
                for name, entry in data["layers"].items())
            return cls(network=data["network"], weights_sha256=str(data["weights_sha256"]), layers=layers,
                       calibration=dict(data.get("calibration") or {}), deltas=dict(data.get("deltas") or {}))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise WeightsError(f"{source}: malformed FP8 scales file ({type(exc).__name__}: {exc})") from exc


def eligible_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The layers of an inference copy that FP8 kernels can run, in forward (registration) order.

    Conv2d (groups 1, dilation 1) and Linear whose input and output channels are multiples of 16 (the FP8 GEMM
    and convolution kernels' alignment), minus :data:`KEEP_16BIT`. The network's first convolution (6 input
    channels) and the heads' 512 -> 3 / 512 -> 1 outputs are therefore 16-bit by construction.
    """
    out: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in KEEP_16BIT):
            continue
        if isinstance(module, nn.Conv2d):
            ok = module.groups == 1 and module.dilation == (1, 1) and not isinstance(module.padding, str)
            ok = ok and module.in_channels % 16 == 0 and module.out_channels % 16 == 0
        elif isinstance(module, nn.Linear):
            ok = module.in_features % 16 == 0 and module.out_features % 16 == 0
        else:
            continue
        if ok:
            out[name] = module
    return out


def layer_kind(module: nn.Module) -> str:
    return "conv2d" if isinstance(module, nn.Conv2d) else "linear"


def weights_fingerprint(net: nn.Module) -> str:
    """sha256 of a network's state_dict (names, shapes, float32 values) as loaded from its checkpoint."""
    h = hashlib.sha256()
    for name, tensor in net.state_dict().items():
        t = tensor.detach().to("cpu")
        t = t.to(torch.float32) if t.is_floating_point() else t
        h.update(name.encode("utf-8"))
        h.update(repr((tuple(t.shape), str(t.dtype))).encode("utf-8"))
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def check_layers(scales: Fp8Scales, model: nn.Module, source: str) -> None:
    """Raise WeightsError unless ``scales`` lists exactly the eligible layers of ``model`` with their shapes.

    model: the network's inference copy (:func:`foundationpose.quant.quantize.inference_copy`).
    """
    wanted = {name: (layer_kind(m), tuple(m.weight.shape)) for name, m in eligible_layers(model).items()}
    have = {layer.name: (layer.kind, layer.weight_shape) for layer in scales.layers}
    missing = [n for n in wanted if n not in have]
    unknown = [n for n in have if n not in wanted]
    misshaped = [f"{n} (scales {have[n][0]} {list(have[n][1])}, network {wanted[n][0]} {list(wanted[n][1])})"
                 for n in wanted if n in have and have[n] != wanted[n]]
    if not (missing or unknown or misshaped):
        return
    parts = []
    for label, items in (("missing layer(s)", missing), ("unknown layer(s)", unknown), ("mis-shaped layer(s)", misshaped)):
        if items:
            shown = ", ".join(items[:5]) + (f", ... and {len(items) - 5} more" if len(items) > 5 else "")
            parts.append(f"{len(items)} {label}: {shown}")
    raise WeightsError(f"{source} does not match the {scales.network} network: " + "; ".join(parts)
                       + ". The scales belong to another architecture or checkpoint: recalibrate")


def scales_path(root: str | os.PathLike[str], network: str) -> Path:
    """``<root>/<run>/fp8_scales.json`` for a weights root in the official layout."""
    from foundationpose.weights import REFINER_RUN, SCORER_RUN

    if network not in NETWORKS:
        raise ValueError(f"network must be one of {NETWORKS}; got {network!r}")
    return Path(root).expanduser() / (REFINER_RUN if network == "refiner" else SCORER_RUN) / SCALES_FILE


def write_scales(root: str | os.PathLike[str], scales: Fp8Scales) -> Path:
    """Write ``scales`` beside its network's checkpoint (atomically: readers never see half a file)."""
    path = scales_path(root, scales.network)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(scales.to_json(), indent=1) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_scales(path: str | os.PathLike[str]) -> Fp8Scales:
    """Parse one scales file; WeightsError when it cannot be read or is not one."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise WeightsError(f"cannot read FP8 scales {path}: {exc}") from exc
    return Fp8Scales.from_json(data, source=str(path))


def inference_copy(net: nn.Module) -> nn.Module:
    """An eval-mode copy of ``net`` with batch norms folded and attention unrolled (the FP8 layers' float twin).

    Its layer names are the scales file's (:mod:`foundationpose.models.unrolled`). Same function as ``net`` within
    float rounding.
    """
    return unroll(fold_batchnorm(net), inplace=True)


def load_scales(root: str | os.PathLike[str], network: str, net: nn.Module) -> Fp8Scales:
    """The scales of ``network`` under weights ``root``, checked against the loaded ``net``.

    Raises WeightsError when the file is missing (saying which command writes it), unreadable, for another
    network, for other weights (fingerprint) or for other layers (names / shapes).
    """
    path = scales_path(root, network)
    if not path.is_file():
        raise WeightsError(
            f"precision fp8 needs calibrated FP8 scales for the {network}, and {path} does not exist. Activation "
            "scales are calibrated on synthetic views of the object the weights were trained for; write them with: "
            + CALIBRATE_COMMAND.format(root=Path(root).expanduser()))
    scales = read_scales(path)
    if scales.network != network:
        raise WeightsError(f"{path} holds scales of the {scales.network}, not of the {network}")
    fingerprint = weights_fingerprint(net)
    if scales.weights_sha256 != fingerprint:
        raise WeightsError(
            f"{path} was calibrated for other {network} weights (weights sha256 {scales.weights_sha256[:12]}..., "
            f"these are {fingerprint[:12]}...): the checkpoint changed since calibration; recalibrate: "
            + CALIBRATE_COMMAND.format(root=Path(root).expanduser()))
    check_layers(scales, inference_copy(net), str(path))
    return scales
