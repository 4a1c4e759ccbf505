"""The backend-independent inference interface: tensor specs, call validation, and the abstract core."""

from __future__ import annotations

import abc
import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from deploy_core.cuda import as_device
from deploy_core.errors import CapacityError, ClosedError

if TYPE_CHECKING:
    from torch.cuda import Stream

__all__ = ["BaseInferCore", "TensorSpec"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One named network input or output.

    shape: ``(-1, d1, d2, ...)``: the leading dim is the dynamic batch ``N``; every other dim is fixed (>= 1).
    dtype: the element type callers pass (inputs) or receive (outputs).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        shape = tuple(int(d) for d in self.shape)
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"TensorSpec.name must be a non-empty str, got {self.name!r}")
        if not shape or shape[0] != -1 or any(d < 1 for d in shape[1:]):
            raise ValueError(
                f"TensorSpec {self.name!r}: shape must be (-1, d1, ...) with the batch dim -1 and fixed dims >= 1, "
                f"got {self.shape!r}"
            )
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"TensorSpec {self.name!r}: dtype must be a torch.dtype, got {self.dtype!r}")
        object.__setattr__(self, "shape", shape)

    def with_batch(self, n: int) -> tuple[int, ...]:
        """The concrete shape for batch ``n``: ``(n, d1, d2, ...)``."""
        return (n, *self.shape[1:])

    def shape_str(self) -> str:
        """The shape with the batch dim written as N, e.g. ``(N, 160, 160, 6)``."""
        return "(" + ", ".join("N" if d == -1 else str(d) for d in self.shape) + ")"

    def __str__(self) -> str:
        return f"{self.name} {self.shape_str()} {str(self.dtype).removeprefix('torch.')}"


class BaseInferCore(abc.ABC):
    """A network behind one call: named batched tensors in, named batched tensors out.

    Contract of :meth:`infer` (identical for every backend):

    * ``inputs``: every input name exactly once; each tensor has shape ``(N, *spec.shape[1:])``, the spec's
      dtype, and lives on ``self.device``. ``N`` is the same for all inputs, ``1 <= N <= max_batch``.
    * ``outputs``: ``None`` (new tensors are returned) or every output name, each a tensor of shape
      ``(N, *spec.shape[1:])`` and the spec's dtype on ``self.device`` - typically a view of a pool buffer.
      Results are written into those tensors (their storage is never replaced) and the same tensors returned.
    * ``stream``: CUDA stream to enqueue on (``None`` = the current stream); ignored on CPU. The call does not
      synchronise the host unless the backend's docstring says so; results are valid once ``stream`` gets
      there. The caller makes ``stream`` wait for the inputs to be ready (``wait_event``) beforehand.

    Errors: ``ValueError`` (unknown/missing names, wrong shape/dtype/device, inconsistent batch),
    ``CapacityError`` (``N > max_batch``), ``ClosedError`` after :meth:`close`, ``EngineError`` when the
    backend itself fails.
    """

    def __init__(
        self,
        *,
        name: str,
        inputs: Iterable[TensorSpec],
        outputs: Iterable[TensorSpec],
        max_batch: int,
        device: str | torch.device,
    ) -> None:
        self._name = name
        self._inputs = tuple(inputs)
        self._outputs = tuple(outputs)
        if not self._inputs or not self._outputs:
            raise ValueError(f"{name}: needs at least one input and one output spec")
        names = [s.name for s in self._inputs + self._outputs]
        if len(set(names)) != len(names):
            raise ValueError(f"{name}: tensor names must be unique across inputs and outputs, got {names}")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"{name}: max_batch must be an int >= 1, got {max_batch!r}")
        self._max_batch = max_batch
        self._device = as_device(device)
        self._closed = False
        self._close_lock = threading.Lock()

    # -- description -------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._name

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        return self._inputs

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return self._outputs

    @property
    def max_batch(self) -> int:
        return self._max_batch

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        ins = ", ".join(str(s) for s in self._inputs)
        outs = ", ".join(str(s) for s in self._outputs)
        return f"<{type(self).__name__} {self._name!r} {self._device} N<={self._max_batch} [{ins}] -> [{outs}]>"

    # -- the call ----------------------------------------------------------------------------------------
    def infer(
        self,
        inputs: Mapping[str, torch.Tensor],
        outputs: Mapping[str, torch.Tensor] | None = None,
        stream: Stream | None = None,
    ) -> dict[str, torch.Tensor]:
        """Run the network on a batch; see the class docstring for the full contract.

        Returns ``{output name: tensor (N, ...)}`` - the caller's ``outputs`` tensors when given.
        """
        if self._closed:
            raise ClosedError(f"{self._name}: inference core is closed")
        n = self.check_inputs(inputs)
        if outputs is not None:
            self.check_outputs(outputs, n)
        return self._infer(inputs, outputs, n, stream)

    @abc.abstractmethod
    def _infer(
        self,
        inputs: Mapping[str, torch.Tensor],
        outputs: Mapping[str, torch.Tensor] | None,
        n: int,
        stream: Stream | None,
    ) -> dict[str, torch.Tensor]:
        """Backend hook: inputs/outputs are already validated, ``n`` is the batch size."""

    def check_inputs(self, inputs: Mapping[str, torch.Tensor]) -> int:
        """Validate ``inputs`` against the specs (host metadata only: never syncs); return the batch ``N``."""
        self._check_names("input", inputs, self._inputs)
        n: int | None = None
        first = ""
        for spec in self._inputs:
            t = inputs[spec.name]
            self._check_tensor("input", spec, t)
            if n is None:
                n, first = int(t.shape[0]), spec.name
            elif t.shape[0] != n:
                raise ValueError(
                    f"{self._name}: inconsistent batch: input {first!r} has N={n}, input {spec.name!r} has "
                    f"N={t.shape[0]}"
                )
        assert n is not None
        if n < 1:
            raise ValueError(f"{self._name}: batch N must be >= 1, got {n}")
        if n > self._max_batch:
            raise CapacityError(
                f"{self._name}: batch N={n} exceeds max_batch={self._max_batch}; split the batch or raise max_batch"
            )
        return n

    def check_outputs(self, outputs: Mapping[str, torch.Tensor], n: int) -> None:
        """Validate caller-provided output buffers for batch ``n``."""
        self._check_names("output", outputs, self._outputs)
        for spec in self._outputs:
            t = outputs[spec.name]
            self._check_tensor("output", spec, t)
            if t.shape[0] != n:
                raise ValueError(
                    f"{self._name}: output {spec.name!r}: expected shape {spec.with_batch(n)} to match the inputs' "
                    f"batch; got {tuple(t.shape)}"
                )

    def _check_names(self, kind: str, given: Mapping[str, torch.Tensor], specs: tuple[TensorSpec, ...]) -> None:
        expected = {s.name for s in specs}
        names = set(given)
        if names != expected:
            missing, unknown = sorted(expected - names), sorted(names - expected)
            raise ValueError(
                f"{self._name}: {kind} names must be {sorted(expected)}; missing {missing}, unknown {unknown}"
            )

    def _check_tensor(self, kind: str, spec: TensorSpec, t: Any) -> None:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{self._name}: {kind} {spec.name!r}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != len(spec.shape) or tuple(t.shape[1:]) != spec.shape[1:]:
            raise ValueError(
                f"{self._name}: {kind} {spec.name!r}: expected shape {spec.shape_str()}; got {tuple(t.shape)}"
            )
        if t.dtype != spec.dtype:
            raise ValueError(f"{self._name}: {kind} {spec.name!r}: expected dtype {spec.dtype}; got {t.dtype}")
        if t.device != self._device:
            raise ValueError(f"{self._name}: {kind} {spec.name!r}: expected device {self._device}; got {t.device}")

    # -- lifecycle ---------------------------------------------------------------------------------------
    def warmup(self, batch_sizes: Iterable[int] = (1,)) -> None:
        """Run the network once per batch size on zero inputs (allocator, kernel selection, lazy init).
        Backends extend this (CUDA-graph capture, compilation). Synchronises the device at the end."""
        for n in batch_sizes:
            zeros = {s.name: torch.zeros(s.with_batch(n), dtype=s.dtype, device=self._device) for s in self._inputs}
            self.infer(zeros)
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def close(self) -> None:
        """Release backend resources; idempotent. Later ``infer`` calls raise ``ClosedError``."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._close()

    def _close(self) -> None:
        """Backend hook for :meth:`close` (called once); backends release their resources here."""
        logger.debug("%s closed", self._name)

    def __enter__(self) -> BaseInferCore:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
