"""Export the refiner and the scorer to ONNX with the community engine interface (NHWC inputs, named outputs).

The interface is the one of spec 6.1.

::

    python -m engines.export --weights WEIGHTS_ROOT --out DIR [--opset 17] [--check]

writes ``DIR/refiner.onnx`` (inputs ``render_input``, ``transf_input`` (N,160,160,6) float32
NHWC; outputs ``trans``, ``rot`` (N,3)) and ``DIR/scorer.onnx`` (same inputs; output
``scores`` (N,1), the N inputs forming one cross-attention set). The batch axis ``N`` is
dynamic. ``--check`` validates each file with ``onnx.checker`` and compares ONNX Runtime (CPU)
against PyTorch at batch 1 and 4. Without ``--weights`` random weights are used (loud warning).
"""

from __future__ import annotations

import argparse
import inspect
import logging
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from deploy_core.errors import DeployError, EngineError
from foundationpose.errors import PoseError
from foundationpose.models import (
    INPUT_NAMES,
    REFINER_OUTPUT_NAMES,
    SCORER_OUTPUT_NAMES,
    RefinerHWC,
    ScorerHWC,
)
from foundationpose.models.blocks import C_IN, CROP_SIZE
from foundationpose.weights import ensure_weights, is_random_weights, load_refiner, load_scorer

__all__ = ["ONNX_FILES", "DEFAULT_OPSET", "export_onnx", "check_onnx", "make_hwc_modules", "main"]

logger = logging.getLogger(__name__)

ONNX_FILES = {"refiner": "refiner.onnx", "scorer": "scorer.onnx"}
DEFAULT_OPSET = 17
TRACE_BATCH = 2  # trace with N > 1 so that no batch-1 special case is baked into the graph
# Parity criterion: max |ort - torch| <= PARITY_RTOL * max(1, max |torch|). Both run fp32 on the
# CPU; measured ~1e-6 on random weights (summation order only), so 1e-4 leaves a wide margin.
PARITY_RTOL = 1e-4


def make_hwc_modules(weights_root: str | os.PathLike[str]) -> dict[str, nn.Module]:
    """The NHWC adapters around both networks, loaded on the CPU in eval mode."""
    return {
        "refiner": RefinerHWC(load_refiner(weights_root)).eval(),
        "scorer": ScorerHWC(load_scorer(weights_root)).eval(),
    }


def _output_names(name: str) -> tuple[str, ...]:
    return REFINER_OUTPUT_NAMES if name == "refiner" else SCORER_OUTPUT_NAMES


@contextmanager
def _mha_fast_path_off() -> Iterator[None]:
    """nn.TransformerEncoderLayer's fused eval kernel has no ONNX symbolic: trace the plain ops.

    Flips a process-wide torch flag for the duration of the export and restores it.
    """
    previous = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(previous)


def _example_inputs(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two (batch, 160, 160, 6) float32 NHWC crops: RGB in [0, 1], XYZ in [-1, 1]."""
    g = torch.Generator().manual_seed(seed)
    crops = torch.rand(2, batch, CROP_SIZE, CROP_SIZE, C_IN, generator=g)
    crops[..., 3:] = crops[..., 3:] * 2.0 - 1.0
    return crops[0], crops[1]


def _export_one(module: nn.Module, name: str, path: Path, opset: int, random_weights: bool) -> None:
    import onnx

    outputs = _output_names(name)
    dynamic_axes = {tensor: {0: "N"} for tensor in (*INPUT_NAMES, *outputs)}
    kwargs = {}
    if "dynamo" in inspect.signature(torch.onnx.export).parameters:
        kwargs["dynamo"] = False  # the TorchScript exporter: no onnxscript needed, dynamic_axes honoured
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        with torch.no_grad(), _mha_fast_path_off(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # legacy-exporter deprecation and tracer notes
            torch.onnx.export(
                module,
                _example_inputs(TRACE_BATCH, seed=0),
                str(tmp),
                input_names=list(INPUT_NAMES),
                output_names=list(outputs),
                dynamic_axes=dynamic_axes,
                opset_version=opset,
                do_constant_folding=True,
                **kwargs,
            )
        model = onnx.load(str(tmp))
        model.doc_string = f"FoundationPose {name}, NHWC engine interface (render_input, transf_input)"
        for key, value in (
            ("foundationpose.network", name),
            ("foundationpose.random_weights", "true" if random_weights else "false"),
        ):
            entry = model.metadata_props.add()
            entry.key, entry.value = key, value
        onnx.save(model, str(tmp))
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, path)
    except Exception as exc:
        raise EngineError(
            f"ONNX export of the {name} failed: {exc}", backend="onnx", engine_path=str(path)
        ) from exc
    finally:
        tmp.unlink(missing_ok=True)


def export_onnx(
    weights_root: str | os.PathLike[str], out_dir: str | os.PathLike[str], opset: int = DEFAULT_OPSET
) -> dict[str, Path]:
    """Export both networks; returns ``{"refiner": out_dir/refiner.onnx, "scorer": out_dir/scorer.onnx}``.

    weights_root: anything ``load_refiner``/``load_scorer`` accept for both (a weights root).
    Raises WeightsError (weights) or EngineError (export).
    """
    out = Path(out_dir).expanduser()
    random_weights = is_random_weights(weights_root) if Path(weights_root).is_dir() else False
    paths: dict[str, Path] = {}
    for name, module in make_hwc_modules(weights_root).items():
        path = out / ONNX_FILES[name]
        start = time.perf_counter()
        _export_one(module, name, path, opset, random_weights)
        logger.info(
            "exported %s to %s (%.1f MB, %.1f s)",
            name,
            path,
            path.stat().st_size / 1e6,
            time.perf_counter() - start,
        )
        paths[name] = path
    return paths


def check_onnx(
    path: str | os.PathLike[str], module: nn.Module, batches: Sequence[int] = (1, 4)
) -> dict[int, float]:
    """Validate an exported file and compare ONNX Runtime (CPU) with ``module`` (PyTorch, fp32).

    Returns ``{batch: max abs difference over all outputs}``. Raises EngineError when the
    checker fails, an output has the wrong name/shape, or a difference exceeds
    ``PARITY_RTOL * max(1, max |torch output|)``.
    """
    import onnx
    import onnxruntime as ort

    path = Path(path)
    try:
        onnx.checker.check_model(str(path))  # by path: works for files over 2 GB as well
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise EngineError(
            f"{path} is not a valid ONNX model: {exc}", backend="onnxruntime", engine_path=str(path)
        ) from exc
    input_names = tuple(i.name for i in session.get_inputs())
    output_names = tuple(o.name for o in session.get_outputs())
    if input_names != INPUT_NAMES:
        raise EngineError(
            f"{path}: inputs {input_names}, expected {INPUT_NAMES}",
            backend="onnxruntime",
            engine_path=str(path),
        )
    diffs: dict[int, float] = {}
    for batch in batches:
        a, b = _example_inputs(batch, seed=1000 + batch)
        with torch.no_grad():
            reference = module(a, b)
        reference = reference if isinstance(reference, tuple) else (reference,)
        got = session.run(None, {INPUT_NAMES[0]: a.numpy(), INPUT_NAMES[1]: b.numpy()})
        worst = 0.0
        for name, ref, out in zip(output_names, reference, got, strict=True):
            if tuple(out.shape) != tuple(ref.shape):
                raise EngineError(
                    f"{path}: output {name} has shape {out.shape} at batch {batch}, "
                    f"PyTorch gives {tuple(ref.shape)}",
                    backend="onnxruntime",
                    engine_path=str(path),
                )
            diff = float((torch.from_numpy(out) - ref).abs().max())
            bound = PARITY_RTOL * max(1.0, float(ref.abs().max()))
            if not diff <= bound:  # also catches NaN
                raise EngineError(
                    f"{path}: output {name} differs from PyTorch by {diff:.3g} at batch {batch} "
                    f"(allowed {bound:.3g})",
                    backend="onnxruntime",
                    engine_path=str(path),
                )
            worst = max(worst, diff)
        diffs[batch] = worst
    return diffs


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m engines.export", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--weights",
        type=Path,
        default=None,
        help="weights root holding <run>/model_best.pth for both runs (default: deterministic "
        "random weights, cached; poses are meaningless with them)",
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="output directory for refiner.onnx, scorer.onnx"
    )
    parser.add_argument(
        "--opset", type=int, default=DEFAULT_OPSET, help=f"ONNX opset (default {DEFAULT_OPSET})"
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="run onnx.checker and compare ONNX Runtime with PyTorch at batch 1 and 4",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 ok, 1 failure)."""
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        root, is_random = ensure_weights(args.weights)
        if is_random:
            logger.warning("exporting RANDOM weights: engines built from these files give meaningless poses")
        start = time.perf_counter()
        paths = export_onnx(root, args.out, opset=args.opset)
        logger.info("export done in %.1f s", time.perf_counter() - start)
        if args.check:
            modules = make_hwc_modules(root)
            for name, path in paths.items():
                diffs = check_onnx(path, modules[name])
                logger.info(
                    "check %s: onnx.checker ok; ORT vs PyTorch max abs diff %s",
                    name,
                    ", ".join(f"batch {b}: {d:.3g}" for b, d in diffs.items()),
                )
    except (PoseError, DeployError) as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
