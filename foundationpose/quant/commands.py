"""The library side of the FP8 commands: calibrate a weights root, report per-layer deltas.

Both draw synthetic views of the object with the training code (:class:`foundationpose.train.batches.SampleSource`,
the same scenes, crops and renderer as training) from seed streams of their own, so the data is the object's and
disjoint from what the weights were trained on and from ``foundationpose.evaluate``'s views.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

from foundationpose.quant.calibrate import (
    CALIBRATION_SEED_OFFSET,
    DELTAS_SEED_OFFSET,
    CalibrationConfig,
    calibrate_network,
    make_batches,
)
from foundationpose.quant.scales import load_scales, write_scales

__all__ = ["calibrate_weights", "deltas_report"]

NETWORKS = ("refiner", "scorer")


def _setup(root: Path, mesh: Path, device: str, renderer: str, config: CalibrationConfig) -> dict[str, Any]:
    from foundationpose.mesh import load_object
    from foundationpose.render import RenderConfig, make_renderer
    from foundationpose.runtime import resolve_device
    from foundationpose.weights import ensure_weights, load_refiner, load_scorer

    dev = resolve_device(device)
    root, is_random = ensure_weights(root)
    nets = {"refiner": load_refiner(root, device=dev), "scorer": load_scorer(root, device=dev)}
    obj = load_object(mesh, device=dev)
    render = make_renderer(renderer, dev, RenderConfig(crop_size_px=config.crop_size, cache_intrinsics=False))
    return {"device": dev, "root": root, "random": is_random, "nets": nets, "obj": obj, "renderer": render}


def _source(setup: dict[str, Any], config: CalibrationConfig, seed_offset: int) -> Any:
    from foundationpose.train.batches import SampleSource
    from foundationpose.train.scorer_ranking import RankingConfig

    seed = config.seed + seed_offset
    return SampleSource(setup["obj"], setup["renderer"], frame_hw=config.frame_hw, crop_size=config.crop_size,
                        gen=torch.Generator().manual_seed(seed),
                        device_gen=torch.Generator(device=setup["device"]).manual_seed(seed + 1),
                        ranking=RankingConfig(set_size=config.set_size))


def calibrate_weights(root: str | os.PathLike[str], mesh: str | os.PathLike[str], *, device: str = "auto",
                      renderer: str = "auto", config: CalibrationConfig | None = None) -> dict[str, Any]:
    """Calibrate both networks of a weights root on ``mesh``'s synthetic views; write ``fp8_scales.json`` beside
    each checkpoint. Returns a JSON-able summary (files, FP8 layers, held-out deltas, the layers kept 16-bit)."""
    config = config or CalibrationConfig()
    setup = _setup(Path(root), Path(mesh), device, renderer, config)
    provenance = {"mesh": str(mesh), "object": setup["obj"].name, "diameter_m": setup["obj"].diameter,
                  "device": str(setup["device"]), "random_weights": setup["random"]}
    cal_source = _source(setup, config, CALIBRATION_SEED_OFFSET)
    held_source = _source(setup, config, DELTAS_SEED_OFFSET)
    summary: dict[str, Any] = {"weights": str(setup["root"]), "networks": {}}
    for network in NETWORKS:
        n_cal = config.refiner_batches if network == "refiner" else config.scorer_batches
        calibration = make_batches(network, cal_source, n_cal, config)
        heldout = make_batches(network, held_source, config.heldout_batches, config)
        scales = calibrate_network(setup["nets"][network], network, calibration, heldout, config, provenance)
        path = write_scales(setup["root"], scales)
        summary["networks"][network] = {
            "scales": str(path),
            "fp8_layers": [layer.name for layer in scales.fp8_layers],
            "kept_16bit": {layer.name: layer.reason for layer in scales.layers if not layer.fp8},
            "deltas": scales.deltas,
        }
    summary["config"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(config).items()}
    return summary


def deltas_report(root: str | os.PathLike[str], mesh: str | os.PathLike[str], *, device: str = "auto",
                  renderer: str = "auto", config: CalibrationConfig | None = None,
                  batches: int | None = None) -> dict[str, Any]:
    """Per-layer output deltas of both networks, float32 vs FP8-emulated with the root's calibrated scales, on
    held-out synthetic views (``batches`` per network, default ``config.heldout_batches``)."""
    config = config or CalibrationConfig()
    from foundationpose.quant.deltas import layer_deltas
    from foundationpose.quant.quantize import inference_copy, quantize_for_inference

    setup = _setup(Path(root), Path(mesh), device, renderer, config)
    held_source = _source(setup, config, DELTAS_SEED_OFFSET)
    report: dict[str, Any] = {"weights": str(setup["root"]), "random_weights": setup["random"],
                              "object": setup["obj"].name, "networks": {}}
    for network in NETWORKS:
        net = setup["nets"][network]
        scales = load_scales(setup["root"], network, net)
        reference = inference_copy(net).float()
        quantised = quantize_for_inference(net, scales, backend="emulate")
        heldout = make_batches(network, held_source, batches or config.heldout_batches, config)
        report["networks"][network] = layer_deltas(network, reference, quantised, heldout)
        report["networks"][network]["fp8_layers"] = len(scales.fp8_layers)
    return report
