"""Inference through ONNX Runtime, with inputs and outputs bound in place to the caller's tensors."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from deploy_core.errors import BackendUnavailableError, ClosedError, EngineError
from deploy_core.infer._base import BaseInferCore, TensorSpec

if TYPE_CHECKING:
    from torch.cuda import Stream

__all__ = ["OnnxRuntimeInferCore", "has_onnxruntime"]

logger = logging.getLogger(__name__)

# ONNX Runtime type strings (NodeArg.type) -> torch dtype, and torch -> numpy for IO binding.
_ORT_TO_TORCH = {
    "tensor(float)": torch.float32,
    "tensor(float16)": torch.float16,
    "tensor(double)": torch.float64,
    "tensor(int64)": torch.int64,
    "tensor(int32)": torch.int32,
    "tensor(int8)": torch.int8,
    "tensor(uint8)": torch.uint8,
    "tensor(bool)": torch.bool,
}
_TORCH_TO_NUMPY = {
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.float64: np.float64,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
}


def _import_onnxruntime() -> Any:
    try:
        import onnxruntime
    except ImportError as exc:
        raise BackendUnavailableError(
            "onnxruntime is not installed: pip install onnxruntime (or onnxruntime-gpu)", backend="onnxruntime"
        ) from exc
    return onnxruntime


def has_onnxruntime() -> bool:
    """True when ``import onnxruntime`` works."""
    try:
        _import_onnxruntime()
    except ImportError:
        return False
    return True


class OnnxRuntimeInferCore(BaseInferCore):
    """Run an ONNX model (batch dim dynamic, all other dims fixed) through ONNX Runtime.

    onnx_path: the model; tensor names, dtypes and shapes are read from it.
    max_batch: the largest batch callers may send (the model itself accepts any N).
    device:    "cpu" (CPUExecutionProvider) or a CUDA device (CUDAExecutionProvider, which must be available:
               onnxruntime-gpu). Tensors are bound by pointer (IO binding) on both, so ORT reads the caller's
               inputs and writes straight into the caller's output buffers (e.g. pool views) without copies.
    providers: explicit ORT providers list, overriding the default for ``device``.
    intra_op_threads: ORT intra-op thread count (0 = ORT default).

    CUDA: ORT runs on its own stream, so ``infer`` first synchronises the caller's ``stream`` (host wait) and
    returns after ORT has finished (ORT synchronises its providers at the end of a run). This backend is the
    portable fallback, not the fast path. Calls are serialised by a lock (one IO binding per core).
    All ORT failures (loading, running) are raised as ``EngineError`` with ``backend="onnxruntime"``.
    """

    def __init__(
        self,
        onnx_path: str | Path,
        max_batch: int,
        device: str | torch.device = "cpu",
        providers: Sequence[Any] | None = None,
        *,
        intra_op_threads: int = 0,
        name: str | None = None,
    ) -> None:
        ort = _import_onnxruntime()
        self._path = Path(onnx_path)
        dev = torch.device(device)
        if providers is None:
            if dev.type == "cuda":
                if "CUDAExecutionProvider" not in ort.get_available_providers():
                    raise EngineError(
                        f"onnxruntime has no CUDAExecutionProvider (available: {ort.get_available_providers()}); "
                        "install onnxruntime-gpu or use device='cpu'",
                        backend="onnxruntime",
                        engine_path=str(self._path),
                    )
                providers = [("CUDAExecutionProvider", {"device_id": dev.index or 0}), "CPUExecutionProvider"]
            else:
                providers = ["CPUExecutionProvider"]
        options = ort.SessionOptions()
        options.intra_op_num_threads = int(intra_op_threads)
        try:
            session = ort.InferenceSession(str(self._path), sess_options=options, providers=list(providers))
        except Exception as exc:  # ORT raises its own pybind exception types: convert at this seam
            raise EngineError(
                f"onnxruntime could not load {self._path}: {exc}", backend="onnxruntime", engine_path=str(self._path)
            ) from exc
        self._session = session
        super().__init__(
            name=name or f"onnxruntime:{self._path.name}",
            inputs=[self._spec_of(a) for a in session.get_inputs()],
            outputs=[self._spec_of(a) for a in session.get_outputs()],
            max_batch=max_batch,
            device=dev,
        )
        self._device_type = "cuda" if self.device.type == "cuda" else "cpu"
        self._device_id = self.device.index or 0
        self._binding = session.io_binding()
        self._lock = threading.Lock()

    @property
    def providers(self) -> list[str]:
        """Execution providers of the session, in priority order (empty after close)."""
        return list(self._session.get_providers()) if self._session is not None else []

    def _spec_of(self, arg: Any) -> TensorSpec:
        """TensorSpec from an ORT NodeArg; only the leading (batch) dim may be symbolic."""
        dtype = _ORT_TO_TORCH.get(arg.type)
        if dtype is None:
            raise EngineError(f"{self._path}: tensor {arg.name!r} has unsupported type {arg.type}",
                              backend="onnxruntime", engine_path=str(self._path))
        shape = list(arg.shape)
        if not shape or isinstance(shape[0], int) or any(not isinstance(d, int) or d < 1 for d in shape[1:]):
            raise EngineError(
                f"{self._path}: tensor {arg.name!r} has shape {shape}; expected a dynamic batch dim followed by fixed "
                "dims (export with dynamic_axes/dynamic_shapes on dim 0 only)",
                backend="onnxruntime",
                engine_path=str(self._path),
            )
        return TensorSpec(arg.name, (-1, *shape[1:]), dtype)

    def _bind(self, kind: str, spec: TensorSpec, t: torch.Tensor) -> None:
        bind = self._binding.bind_input if kind == "input" else self._binding.bind_output
        bind(spec.name, self._device_type, self._device_id, _TORCH_TO_NUMPY[spec.dtype], tuple(t.shape), t.data_ptr())

    def _infer(
        self,
        inputs: Mapping[str, torch.Tensor],
        outputs: Mapping[str, torch.Tensor] | None,
        n: int,
        stream: Stream | None,
    ) -> dict[str, torch.Tensor]:
        if outputs is not None:
            for spec in self.outputs:
                if not outputs[spec.name].is_contiguous():
                    raise ValueError(f"{self.name}: output {spec.name!r} must be contiguous (it is bound by pointer)")
        with self._lock:
            if self._session is None:
                raise ClosedError(f"{self.name}: inference core is closed")
            if self._device_type == "cuda":
                (stream if stream is not None else torch.cuda.current_stream(self.device)).synchronize()
            # Keep the (possibly copied) contiguous inputs alive until the run returns.
            xs = {s.name: inputs[s.name].contiguous() for s in self.inputs}
            outs = dict(outputs) if outputs is not None else {
                s.name: torch.empty(s.with_batch(n), dtype=s.dtype, device=self.device) for s in self.outputs
            }
            self._binding.clear_binding_inputs()
            self._binding.clear_binding_outputs()
            for spec in self.inputs:
                self._bind("input", spec, xs[spec.name])
            for spec in self.outputs:
                self._bind("output", spec, outs[spec.name])
            try:
                self._session.run_with_iobinding(self._binding)
            except Exception as exc:
                raise EngineError(
                    f"{self.name}: onnxruntime run failed at N={n}: {exc}",
                    backend="onnxruntime",
                    engine_path=str(self._path),
                ) from exc
            finally:
                self._binding.clear_binding_inputs()
                self._binding.clear_binding_outputs()
        return outs

    def _close(self) -> None:
        with self._lock:
            self._binding = None
            self._session = None
