"""How register and track run on a machine: every speed choice in one frozen value, the fastest measured by default.

:class:`RuntimeConfig` is the one public configuration of *how* the estimator runs (the algorithm's numbers live in
:class:`foundationpose.estimator.EstimatorConfig`). Its defaults are what a user gets without flags:

* on CUDA with the torch backend, the networks' fast path: half-precision weights (not autocast), channels-last
  memory, batch norms folded into their convolutions, the first convolution padded to 8 input channels, and
  ``torch.compile`` (inductor) of the register networks and of the track refiner; every change of value is
  rounding only (tests hold each against the plain networks; ``docs/benchmarks.md`` has the figures);
* the Triton rasteriser when its start-up self-check passes (else nvdiffrast, else the CPU rasteriser, said once
  in the log), so that whole register and track steps are captured as CUDA graphs;
* a ``torch.compile`` artifact cache in :data:`DEFAULT_COMPILE_CACHE`, so that the second start-up is warm.

On the CPU none of that applies: float32 networks, the CPU rasteriser, the same steps run eagerly (the reference).
Opt-outs say what they turn off: ``capture=False`` (no CUDA graphs: every step runs eagerly), ``compile=False``
(no ``torch.compile``: faster start-up, slower steps), ``compile_cache=None`` (no artifact file).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import torch

__all__ = ["BACKENDS", "DEFAULT_COMPILE_CACHE", "PRECISIONS", "RENDERERS", "RuntimeConfig", "resolve_device"]

BACKENDS = ("torch", "onnxruntime", "tensorrt")
PRECISIONS = ("auto", "fp32", "fp16", "bf16")
RENDERERS = ("auto", "cpu", "nvdiffrast", "triton")

# Where compiled kernels are kept between start-ups (foundationpose.compile_cache); one file per torch version and
# GPU model is written beside it (PyTorch refuses artifacts of another version or GPU).
DEFAULT_COMPILE_CACHE = Path.home() / ".cache" / "foundationpose" / "compile"

REGISTER_BATCH = 252  # the register's hypotheses (spec §2.1): the networks' largest batch


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeConfig:
    """How the estimator runs; see the module docstring for what the defaults mean on each device.

    device: ``auto`` (CUDA when available), ``cpu``, ``cuda`` or ``cuda:N``.
    weights: weights root in the official layout (``<root>/<run>/model_best.pth``); None = deterministic random
        weights (poses are then meaningless; every entry point says so).
    backend: ``torch`` | ``onnxruntime`` | ``tensorrt`` (the latter two need ``engine_files`` at load).
    precision: ``fp32`` | ``fp16`` | ``bf16``; ``auto`` = fp16 on CUDA, fp32 on the CPU.
    renderer: ``auto`` | ``cpu`` | ``nvdiffrast`` | ``triton`` (see :func:`foundationpose.render.make_renderer`).
    capture: CUDA graphs of whole register and track steps (and of the networks where a step cannot be captured).
    compile: ``torch.compile`` the networks on CUDA with the torch backend.
    compile_cache: the folder of the compile artifact files (None: none is read or written).
    engine_dir: where ONNX files / TensorRT plans live (onnxruntime and tensorrt backends).
    trust_weights_file: allow checkpoints that need full unpickling (runs code from the file).
    max_batch: the networks' capacity; 252 = the register's hypotheses.
    """

    device: str = "auto"
    weights: Path | None = None
    backend: str = "torch"
    precision: str = "auto"
    renderer: str = "auto"
    capture: bool = True
    compile: bool = True
    compile_cache: Path | None = DEFAULT_COMPILE_CACHE
    engine_dir: Path | None = None
    trust_weights_file: bool = False
    max_batch: int = REGISTER_BATCH

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {self.precision!r}")
        if self.renderer not in RENDERERS:
            raise ValueError(f"renderer must be one of {', '.join(RENDERERS)}; got {self.renderer!r}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1; got {self.max_batch}")
        for name in ("weights", "compile_cache", "engine_dir"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Path):
                object.__setattr__(self, name, Path(value))
        resolve_device(self.device, check_available=False)  # a malformed device string fails here, not at load

    def resolved_device(self) -> torch.device:
        """The device this config runs on (raises ValueError when CUDA is asked for but missing)."""
        return resolve_device(self.device)

    def resolved_precision(self, device: torch.device) -> str:
        """``precision``, with ``auto`` made concrete for ``device`` (fp16 on CUDA, fp32 elsewhere). Raises
        ValueError for fp16 on the CPU (its kernels are slow or missing there)."""
        if self.precision == "fp16" and device.type != "cuda":
            raise ValueError(f"precision fp16 needs a CUDA device; on {device} use auto, fp32 or bf16")
        if self.precision != "auto":
            return self.precision
        return "fp16" if device.type == "cuda" else "fp32"

    def fast_networks(self, device: torch.device) -> bool:
        """Whether the networks take the fast path (CUDA, the torch backend, a 16-bit precision)."""
        return device.type == "cuda" and self.backend == "torch" and self.resolved_precision(device) != "fp32"

    def compiles(self, device: torch.device) -> bool:
        """Whether the networks are compiled (``compile``, on CUDA with the torch backend)."""
        return self.compile and device.type == "cuda" and self.backend == "torch"

    def describe(self, device: torch.device) -> dict[str, object]:
        """Every field (paths as strings) plus what they resolve to on ``device``: a record for logs and JSON."""
        record: dict[str, object] = {
            f.name: (str(v) if isinstance(v := getattr(self, f.name), Path) else v) for f in fields(self)
        }
        record.update(device=str(device), precision=self.resolved_precision(device),
                      fast_networks=self.fast_networks(device), compiled=self.compiles(device))
        return record


def resolve_device(device: str | torch.device = "auto", *, check_available: bool = True) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; anything else parsed by ``torch.device``.

    Raises ValueError for a malformed name, or (``check_available``) for CUDA on a machine without it.
    """
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {device!r}") from exc
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {device!r}")
    if check_available and parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {parsed} requested but CUDA is not available on this machine")
    return parsed
