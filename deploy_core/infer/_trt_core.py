"""Inference through a serialised TensorRT (>= 10) engine, bound by name to the caller's device buffers.

Written against the TensorRT 10 Python API (name-based I/O, ``execute_async_v3``); TensorRT is imported
lazily, only when a core is built. Every call that can fail is checked, and failures become ``EngineError``
carrying the errors TensorRT logged on the calling thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from deploy_core.cuda import as_device, record_event, wait_event
from deploy_core.errors import CapacityError, ClosedError, EngineError
from deploy_core.infer._base import BaseInferCore, TensorSpec
from deploy_core.infer._trt_support import has_tensorrt, import_tensorrt, make_trt_logger

if TYPE_CHECKING:
    from torch.cuda import Stream

__all__ = ["TensorRTInferCore", "has_tensorrt"]

logger = logging.getLogger(__name__)

# TensorRT DataType member name -> torch dtype (looked up by name: members differ between versions).
_TRT_TO_TORCH = {
    "FLOAT": torch.float32,
    "HALF": torch.float16,
    "BF16": torch.bfloat16,
    "INT8": torch.int8,
    "INT32": torch.int32,
    "INT64": torch.int64,
    "UINT8": torch.uint8,
    "BOOL": torch.bool,
}


class _Shared:
    """What every core on one plan shares. Slot order is release order: engine, then runtime, then logger."""

    __slots__ = ("engine", "runtime", "logger", "trt", "path")

    def __init__(self, trt: Any, trt_logger: Any, runtime: Any, engine: Any, path: Path) -> None:
        self.engine, self.runtime, self.logger, self.trt, self.path = engine, runtime, trt_logger, trt, path


def _torch_dtype(shared: _Shared, name: str) -> torch.dtype:
    dt = shared.engine.get_tensor_dtype(name)
    for member, dtype in _TRT_TO_TORCH.items():
        if dt == getattr(shared.trt.DataType, member, object()):
            return dtype
    raise EngineError(f"{shared.path}: tensor {name!r} has unsupported TensorRT dtype {dt}",
                      backend="tensorrt", engine_path=str(shared.path))


def _read_io(shared: _Shared, profile: int) -> tuple[list[TensorSpec], list[TensorSpec], int, int]:
    """Input/output specs (engine order) and the (min, max) batch of ``profile`` over all inputs."""
    trt, engine = shared.trt, shared.engine
    inputs: list[TensorSpec] = []
    outputs: list[TensorSpec] = []
    min_b, max_b = 1, None
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        shape = tuple(int(d) for d in engine.get_tensor_shape(name))
        if not shape or any(d < 1 for d in shape[1:]) or engine.get_tensor_location(name) != trt.TensorLocation.DEVICE:
            raise EngineError(
                f"{shared.path}: tensor {name!r} has shape {shape}; only device tensors whose leading (batch) dim "
                "alone is dynamic are supported",
                backend="tensorrt",
                engine_path=str(shared.path),
            )
        spec = TensorSpec(name, (-1, *shape[1:]), _torch_dtype(shared, name))
        if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
            if shape[0] == -1:
                lo, _opt, hi = engine.get_tensor_profile_shape(name, profile)
                b_lo, b_hi = int(lo[0]), int(hi[0])
            else:
                b_lo = b_hi = shape[0]
            min_b = max(min_b, b_lo)
            max_b = b_hi if max_b is None else min(max_b, b_hi)
            inputs.append(spec)
        else:
            outputs.append(spec)
    if max_b is None or max_b < min_b:
        raise EngineError(f"{shared.path}: no usable batch range in profile {profile}",
                          backend="tensorrt", engine_path=str(shared.path))
    return inputs, outputs, min_b, max_b


class TensorRTInferCore(BaseInferCore):
    """Run a TensorRT plan (see :class:`BaseInferCore` for the ``infer`` contract).

    plan_path:     serialised engine. Plans are tied to the TensorRT version and GPU that built them.
    max_batch:     largest batch callers may send; ``None`` = the profile's max; above it -> ``CapacityError``.
    device:        CUDA device the engine runs on.
    profile_index: optimisation profile this core's execution context uses (e.g. 0 = track at batch 1,
                   1 = register micro-batches). Tensor names, dtypes and the batch range come from the engine.

    One execution context per core, created here (never lazily per thread). A context must not run two
    batches at once (its activation memory is shared), so calls are serialised by a lock on the host and, on
    the GPU, each call's stream waits for the previous call's work (callers on different streams, e.g. the
    register lane's refine stages); for concurrency create one core per stream or worker thread with
    :meth:`fork`, which shares the deserialised engine (weights are not duplicated).

    ``infer`` enqueues on ``stream`` (current stream when ``None``) and never synchronises the host. Inputs
    and outputs are bound by address, so outputs must be contiguous; inputs are made contiguous if needed.
    """

    def __init__(
        self,
        plan_path: str | Path,
        max_batch: int | None = None,
        device: str | torch.device = "cuda",
        profile_index: int = 0,
        *,
        name: str | None = None,
    ) -> None:
        dev = as_device(device)
        if dev.type != "cuda":
            raise ValueError(f"TensorRT needs a CUDA device, got {dev}")
        trt = import_tensorrt()
        path = Path(plan_path)
        try:
            plan = path.read_bytes()
        except OSError as exc:
            raise EngineError(f"cannot read TensorRT plan {path}: {exc}", backend="tensorrt", engine_path=str(path)) from exc
        trt_logger = make_trt_logger(trt)
        with torch.cuda.device(dev):
            runtime = trt.Runtime(trt_logger)
            trt_logger.take()
            engine = runtime.deserialize_cuda_engine(plan)
        if engine is None:
            msg = "; ".join(trt_logger.take()) or "no message logged"
            raise EngineError(
                f"TensorRT could not deserialise {path}: {msg} (was it built by this TensorRT version on this GPU?)",
                backend="tensorrt",
                engine_path=str(path),
            )
        self._attach(_Shared(trt, trt_logger, runtime, engine, path), dev, max_batch, profile_index,
                     name or f"tensorrt:{path.name}")

    def _attach(self, shared: _Shared, device: torch.device, max_batch: int | None, profile_index: int,
                name: str) -> None:
        n_profiles = int(shared.engine.num_optimization_profiles)
        if not 0 <= profile_index < n_profiles:
            raise ValueError(f"{name}: profile_index {profile_index} out of range; the engine has {n_profiles}")
        inputs, outputs, min_b, max_b = _read_io(shared, profile_index)
        if max_batch is None:
            max_batch = max_b
        elif max_batch > max_b:
            raise CapacityError(f"{name}: max_batch={max_batch} exceeds profile {profile_index}'s max batch {max_b}")
        super().__init__(name=name, inputs=inputs, outputs=outputs, max_batch=max_batch, device=device)
        self._shared: _Shared | None = shared
        self._profile_index = profile_index
        self._min_batch = min_b
        self._lock = threading.Lock()
        self._done: torch.cuda.Event | None = None  # after the last call's engine work (on its stream)
        with torch.cuda.device(device):
            shared.logger.take()
            context = shared.engine.create_execution_context()
            if context is None:
                self._fail(shared, "create_execution_context() returned None")
            stream = torch.cuda.current_stream(device)
            if not context.set_optimization_profile_async(profile_index, stream.cuda_stream):
                self._fail(shared, f"set_optimization_profile_async({profile_index}) failed")
            stream.synchronize()  # construction-time only
        self._context: Any = context

    @property
    def engine_path(self) -> Path | None:
        return self._shared.path if self._shared is not None else None

    @property
    def profile_index(self) -> int:
        return self._profile_index

    @property
    def min_batch(self) -> int:
        return self._min_batch

    def fork(self, name: str | None = None) -> TensorRTInferCore:
        """Another core on the same engine with its own execution context (one per stream or thread)."""
        shared = self._shared
        if shared is None:
            raise ClosedError(f"{self.name}: inference core is closed")
        other = TensorRTInferCore.__new__(TensorRTInferCore)
        other._attach(shared, self.device, self.max_batch, self._profile_index, name or self.name)
        return other

    def _fail(self, shared: _Shared, what: str) -> NoReturn:
        errors = "; ".join(shared.logger.take()) or "no error logged"
        raise EngineError(f"{self.name}: TensorRT {what}: {errors}", backend="tensorrt", engine_path=str(shared.path))

    def _infer(
        self,
        inputs: Mapping[str, torch.Tensor],
        outputs: Mapping[str, torch.Tensor] | None,
        n: int,
        stream: Stream | None,
    ) -> dict[str, torch.Tensor]:
        if n < self._min_batch:
            raise ValueError(f"{self.name}: batch N={n} is below profile {self._profile_index}'s min batch {self._min_batch}")
        if outputs is not None:
            for spec in self.outputs:
                if not outputs[spec.name].is_contiguous():
                    raise ValueError(f"{self.name}: output {spec.name!r} must be contiguous (it is bound by address)")
        with self._lock:
            ctx, shared = self._context, self._shared
            if ctx is None or shared is None:
                raise ClosedError(f"{self.name}: inference core is closed")
            shared.logger.take()
            s = stream if stream is not None else torch.cuda.current_stream(self.device)
            with torch.cuda.stream(s):  # temporaries belong to `s`, so their reuse is ordered after the engine
                xs = {spec.name: inputs[spec.name].contiguous() for spec in self.inputs}
                outs = dict(outputs) if outputs is not None else {
                    spec.name: torch.empty(spec.with_batch(n), dtype=spec.dtype, device=self.device)
                    for spec in self.outputs
                }
            for spec in self.inputs:
                x = xs[spec.name]
                if not ctx.set_input_shape(spec.name, tuple(x.shape)):
                    self._fail(shared, f"set_input_shape({spec.name!r}, {tuple(x.shape)}) failed")
                if not ctx.set_tensor_address(spec.name, x.data_ptr()):
                    self._fail(shared, f"set_tensor_address({spec.name!r}) failed")
            for spec in self.outputs:
                got = tuple(int(d) for d in ctx.get_tensor_shape(spec.name))
                if got != spec.with_batch(n):
                    self._fail(shared, f"output {spec.name!r} would have shape {got}, expected {spec.with_batch(n)}")
                if not ctx.set_tensor_address(spec.name, outs[spec.name].data_ptr()):
                    self._fail(shared, f"set_tensor_address({spec.name!r}) failed")
            # The host lock orders the enqueues only: a call on another stream would run on the GPU while the
            # previous one still uses the context's activation memory (garbage outputs). Chain them GPU-side.
            wait_event(s, self._done)
            if not ctx.execute_async_v3(s.cuda_stream):
                self._fail(shared, f"execute_async_v3 failed at N={n}")
            self._done = record_event(s)
            late = shared.logger.take()
            if late:
                raise EngineError(f"{self.name}: TensorRT reported errors at N={n}: {'; '.join(late)}",
                                  backend="tensorrt", engine_path=str(shared.path))
        return outs

    def _close(self) -> None:
        with self._lock:
            self._context = None  # the context goes before the engine it came from
            self._shared = None
