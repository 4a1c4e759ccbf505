"""The command-line options of :class:`~foundationpose.runtime.RuntimeConfig`, shared by every command that builds
an estimator (``python -m foundationpose.demo``, ``.evaluate``, ``.bench``): one definition, the same help.

Every option defaults to "not given", so a command run without flags gets ``RuntimeConfig()``, the fastest
measured configuration for the machine; the opt-outs say what they turn off.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from foundationpose.runtime import BACKENDS, PRECISIONS, RENDERERS, RuntimeConfig

__all__ = ["add_runtime_options", "runtime_from_options"]


def add_runtime_options(parser: argparse.ArgumentParser, *, precision_list: bool = False) -> None:
    """Add --weights, --device, --backend, --precision, --renderer, --eager and --no-compile.

    precision_list: --precision takes a comma list (a command that compares precisions); the caller parses it.
    """
    parser.add_argument("--weights", type=Path, default=None, metavar="DIR",
                        help="weights root in the official layout (default: deterministic random weights, seed 0: "
                        "poses are then meaningless)")
    parser.add_argument("--device", default=None, metavar="DEVICE",
                        help="auto | cpu | cuda | cuda:N (default: auto = cuda when available)")
    parser.add_argument("--backend", choices=BACKENDS, default=None, help="network backend (default: torch)")
    precision_help = "network precision: auto = fp16 on cuda, fp32 on cpu"
    if precision_list:
        parser.add_argument("--precision", default=None, metavar="P[,P...]",
                            help=f"{precision_help}; a comma list compares precisions on the same frames and views "
                            "(the first is the baseline; default: auto)")
    else:
        parser.add_argument("--precision", choices=PRECISIONS, default=None, help=f"{precision_help} (default: auto)")
    parser.add_argument("--renderer", choices=RENDERERS, default=None,
                        help="render backend (default: auto = the Triton rasteriser on cuda when its self-check "
                        "passes, else nvdiffrast, else the CPU rasteriser)")
    parser.add_argument("--eager", action="store_true",
                        help="no CUDA graphs: every register and track step runs eagerly (default: captured on cuda)")
    parser.add_argument("--no-compile", action="store_true",
                        help="no torch.compile of the networks: a faster start-up, slower steps (default: compiled "
                        "on cuda)")


def runtime_from_options(args: argparse.Namespace, *, precision: str | None = None) -> RuntimeConfig:
    """The :class:`RuntimeConfig` of the parsed options: its defaults, changed only by the options given.
    precision: overrides ``args.precision`` (one entry of a compared list). Raises ValueError for bad values, CUDA
    asked for on a machine without it, and a precision the device cannot run (the commands print it as a usage
    error)."""
    changes = {"weights": args.weights, "device": args.device, "backend": args.backend,
               "precision": precision or args.precision, "renderer": args.renderer}
    if args.eager:
        changes["capture"] = False
    if args.no_compile:
        changes["compile"] = False
    runtime = RuntimeConfig(**{k: v for k, v in changes.items() if v is not None})
    runtime.resolved_precision(runtime.resolved_device())
    return runtime
