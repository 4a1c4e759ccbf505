"""FP8 (E4M3) inference for RefineNet and ScoreNetMultiPair: calibration, quantised layers, accuracy deltas.

Modules, one job each: ``fp8`` (the format and its quantise / dequantise rules), ``modules`` (the FP8 layers;
CPU emulation and CUDA dispatch), ``_kernels`` (``torch._scaled_mm`` and cuDNN FP8 convolutions),
``_reference`` (float64 twins for the tests), ``scales`` (the versioned scales file beside the weights),
``quantize`` (the FP8 inference copy of a network), ``calibrate`` (scales, sensitivity study, decisions),
``deltas`` (per-layer deltas, precision comparison of evaluation reports), ``commands`` and ``cli``
(``python -m foundationpose.quant`` / ``python -m foundationpose.train calibrate``).

Typical use, in the network loader (both networks; WeightsError when scales are missing or stale)::

    refiner_net, scorer_net = load_fp8_networks(root, refiner_net, scorer_net)  # kernels on CUDA, emulated on CPU
    core_precision = fp8_core_precision(device)                                  # the 16-bit layers around them
"""

from foundationpose.quant.calibrate import CalibrationConfig
from foundationpose.quant.commands import calibrate_weights, deltas_report
from foundationpose.quant.deltas import ACCURACY_LIMITS, compare_precisions, layer_deltas
from foundationpose.quant.fp8 import E4M3_MAX, FP8_DTYPE, dequantize, quantize_e4m3, weight_scales
from foundationpose.quant.modules import Fp8Conv2d, Fp8Linear
from foundationpose.quant.quantize import (
    fp8_backend_for,
    fp8_core_precision,
    inference_copy,
    load_fp8_networks,
    quantize_for_inference,
)
from foundationpose.quant.scales import (
    SCALES_FILE,
    Fp8Scales,
    LayerScale,
    eligible_layers,
    load_scales,
    read_scales,
    scales_path,
    write_scales,
)

__all__ = [
    "ACCURACY_LIMITS",
    "CalibrationConfig",
    "E4M3_MAX",
    "FP8_DTYPE",
    "Fp8Conv2d",
    "Fp8Linear",
    "Fp8Scales",
    "LayerScale",
    "SCALES_FILE",
    "calibrate_weights",
    "compare_precisions",
    "deltas_report",
    "dequantize",
    "eligible_layers",
    "fp8_backend_for",
    "fp8_core_precision",
    "inference_copy",
    "layer_deltas",
    "load_fp8_networks",
    "load_scales",
    "quantize_e4m3",
    "quantize_for_inference",
    "read_scales",
    "scales_path",
    "weight_scales",
    "write_scales",
]
