"""What the commands of ``python -m foundationpose.evaluate`` share: the estimator's options and its creation, the
checks made before any work, the progress bar and the machine facts a report carries."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path
from typing import Any

from foundationpose.errors import InputError
from foundationpose.runtime_options import add_runtime_options, runtime_from_options

__all__ = ["check_start", "check_weights", "create_estimator", "dataclass_fields", "estimator_options",
           "machine_facts", "progress_bar", "train_device"]


def estimator_options(p: argparse.ArgumentParser, hypotheses: int = 252, compare: bool = False) -> None:
    add_runtime_options(p, precision_list=compare)  # compare: the accuracy run compares precisions on the same data
    p.add_argument("--hypotheses", type=int, default=hypotheses, help=f"register hypotheses (default: {hypotheses})")
    p.add_argument("--register-iterations", type=int, default=5, help="default: 5")
    p.add_argument("--track-iterations", type=int, default=2, help="default: 2")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def create_estimator(args: argparse.Namespace, precision: str | None = None):
    from engines.files import engine_files  # an application: it wires the engines package in
    from foundationpose.estimator import EstimatorConfig, PoseEstimator

    try:
        runtime = runtime_from_options(args, precision=precision)
    except ValueError as exc:
        raise InputError("options", "a runtime this machine can run", str(exc)) from exc
    return PoseEstimator.create(
        runtime=runtime, engine_files=engine_files,
        config=EstimatorConfig(num_hypotheses=args.hypotheses, register_iterations=args.register_iterations,
                               track_iterations=args.track_iterations),
    )


def check_weights(weights: Path | None) -> None:
    """The --weights folder as the estimator will need it, checked before any progress output: InputError naming
    --weights when it is missing, not a folder or lacks a run's checkpoint (None: random weights, nothing to check)."""
    from foundationpose.weights import CHECKPOINT_NAME, REFINER_RUN, SCORER_RUN

    if weights is None:
        return
    root = Path(weights).expanduser()
    expected = f"a weights folder in the official layout (<root>/<run>/{CHECKPOINT_NAME})"
    fix = "Give the folder that holds both runs, or leave --weights out for random weights"
    if not root.is_dir():
        raise InputError("--weights", expected, f"'{root}' ({'a file' if root.exists() else 'no such folder'})", fix)
    missing = [f"{run}/{CHECKPOINT_NAME}" for run in (REFINER_RUN, SCORER_RUN)
               if not (root / run / CHECKPOINT_NAME).is_file()]
    if missing:
        raise InputError("--weights", expected, f"'{root}' without {' and '.join(missing)}", fix)


def check_start(args: argparse.Namespace, precisions: list[str]) -> None:
    """What the estimators' start-up would refuse, checked before the progress bar is drawn: the weights folder
    and the runtime of every precision (CUDA asked for without it, a precision the device cannot run)."""
    check_weights(args.weights)
    for precision in precisions:
        try:
            runtime_from_options(args, precision=precision)
        except ValueError as exc:
            raise InputError("options", "a runtime this machine can run", str(exc)) from exc


def progress_bar(total: int, args: argparse.Namespace, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, file=sys.stderr, disable=args.no_progress, unit="frame", desc=desc)


def machine_facts() -> dict[str, Any]:
    import torch

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def train_device(device: str | None) -> str:
    """The training device of a runtime --device: auto, cpu or cuda."""
    if device in (None, "auto", "cpu"):
        return device or "auto"
    if device.startswith("cuda"):
        return "cuda"
    raise InputError("--device", "auto, cpu, cuda or cuda:N", repr(device))


def dataclass_fields(obj: Any) -> dict[str, Any]:
    from dataclasses import fields

    return {f.name: (list(v) if isinstance(v := getattr(obj, f.name), tuple) else v) for f in fields(obj)}
