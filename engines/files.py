"""Where the engine files for a set of weights live, producing them on first use.

``onnxruntime`` needs ``refiner.onnx`` / ``scorer.onnx``; ``tensorrt`` needs plans built from
them. Both are derived from the weights and cached in a directory keyed by the weights'
content hash, so changing the checkpoints never reuses stale engines. A user who already
has ONNX files (e.g. community exports with the same interface) points ``engine_dir`` at a
folder holding them and they are used as they are.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from engines.plan_cache import file_sha256, get_or_build, locked

__all__ = ["default_engine_root", "engine_files", "onnx_files"]

log = logging.getLogger(__name__)

NETWORKS = ("refiner", "scorer")


def default_engine_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "foundationpose-deploy" / "engines"


def _weights_key(weights_root: Path) -> str:
    from foundationpose.weights import REFINER_RUN, SCORER_RUN

    digests = [file_sha256(weights_root / run / "model_best.pth")[:16] for run in (REFINER_RUN, SCORER_RUN)]
    return "-".join(digests)


def onnx_files(weights_root: Path, engine_dir: Path | None = None) -> dict[str, Path]:
    """``{"refiner": path, "scorer": path}``: given ONNX files, or ones exported from the weights."""
    if engine_dir is not None and all((Path(engine_dir) / f"{n}.onnx").is_file() for n in NETWORKS):
        return {n: Path(engine_dir) / f"{n}.onnx" for n in NETWORKS}
    out_dir = Path(engine_dir) if engine_dir is not None else default_engine_root() / _weights_key(Path(weights_root))
    marker = out_dir / "onnx.done"

    def export() -> bytes:
        from engines.export import export_onnx

        log.info("exporting ONNX files for %s into %s", weights_root, out_dir)
        export_onnx(Path(weights_root), out_dir)
        return b"ok\n"

    get_or_build(marker, export)
    return {n: out_dir / f"{n}.onnx" for n in NETWORKS}


def engine_files(
    *,
    weights_root: Path,
    engine_dir: Path | None,
    backend: str,
    precision: str,
    max_batch: int,
    device: torch.device,
) -> dict[str, Path]:
    """The files ``backend`` loads for both networks (ONNX for onnxruntime, plans for tensorrt)."""
    onnx = onnx_files(weights_root, engine_dir)
    if backend == "onnxruntime":
        return onnx
    if backend != "tensorrt":
        raise ValueError(f"no engine files for backend {backend!r}")
    from engines.build import BuildConfig, build_plan

    config = BuildConfig(precision=precision, max_batch=max_batch, track_max_batch=min(64, max_batch))
    plans: dict[str, Path] = {}
    with locked(onnx["refiner"].parent / "plans.lock"):
        for name, path in onnx.items():
            plans[name], _ = build_plan(path, path.parent, config)
    return plans
