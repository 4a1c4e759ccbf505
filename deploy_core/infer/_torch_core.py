"""Inference through a plain ``torch.nn.Module`` (eager, optionally compiled or CUDA-graph replayed)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import torch

from deploy_core.cuda import stream_context
from deploy_core.errors import EngineError
from deploy_core.infer._base import BaseInferCore, TensorSpec
from deploy_core.infer._cuda_graph import GraphSet

if TYPE_CHECKING:
    from torch.cuda import Stream

__all__ = ["TorchInferCore"]

logger = logging.getLogger(__name__)

Precision = Literal["fp32", "fp16", "bf16"]
_REDUCED = {"fp16": torch.float16, "bf16": torch.bfloat16}


# torch.compile modes that capture CUDA graphs themselves (graphs do not nest)
_CUDAGRAPH_COMPILE_MODES = ("reduce-overhead", "max-autotune")


class TorchInferCore(BaseInferCore):
    """Run ``module`` as an inference core (see :class:`BaseInferCore` for the ``infer`` contract).

    module:    called as ``module(*inputs)`` with the inputs in ``inputs`` spec order; returns one tensor or a
               tuple/list in ``outputs`` spec order. The core takes ownership: it is moved to ``device``, put in
               ``eval()`` mode and, with ``cast_model``/``channels_last``, converted in place.
    precision: "fp32"; "fp16" / "bf16" run under ``torch.autocast`` (fp32 islands for softmax/norms, as the
               reference implementation does), unless ``cast_model=True`` converts the weights and floating
               inputs to that dtype instead (faster, but no fp32 islands; docs/benchmarks.md, "Networks"). Outputs are
               always cast to their spec dtype (float32 in practice).
               On CPU: "bf16" is allowed (CPU autocast or cast); "fp16" raises ``ValueError`` - CPU fp16 kernels
               are slow or missing, and a silent fallback would hide a misconfiguration.
    channels_last: convert the module's 4-D weights to channels-last. Inputs are passed as given: an NHWC
               tensor permuted to NCHW inside the module is already channels-last in memory.
    cuda_graph_batches: batch sizes to capture as CUDA graphs at :meth:`warmup` (CUDA only; ignored with a
               warning on CPU). Only exact sizes replay; other sizes and calls before warm-up run eager.
    compile:   wrap the module with ``torch.compile(**compile_kwargs)`` at :meth:`warmup` (compilation happens
               there, not on the first request). With ``cuda_graph_batches`` the default mode's kernels are
               captured by this core's graphs (and by callers capturing ``capturable_forward``); the modes that
               capture graphs themselves (``reduce-overhead``, ``max-autotune``) are refused there.

    ``startup_s`` accumulates the seconds spent in :meth:`warmup` (compilation, capture, warm runs).
    Thread safety: eager calls are re-entrant (from several threads and streams at once: autocast's weight-cast
    cache, process-wide in PyTorch, is never used); graph replays are serialised by a lock.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        inputs: Iterable[TensorSpec],
        outputs: Iterable[TensorSpec],
        max_batch: int,
        device: str | torch.device,
        precision: Precision = "fp32",
        channels_last: bool = False,
        cuda_graph_batches: Iterable[int] = (),
        compile: bool = False,
        *,
        compile_kwargs: Mapping[str, Any] | None = None,
        cast_model: bool = False,
        name: str | None = None,
    ) -> None:
        super().__init__(
            name=name or f"torch:{type(module).__name__}",
            inputs=inputs,
            outputs=outputs,
            max_batch=max_batch,
            device=device,
        )
        cuda = self.device.type == "cuda"
        if precision not in ("fp32", "fp16", "bf16"):
            raise ValueError(f"{self.name}: precision must be 'fp32', 'fp16' or 'bf16', got {precision!r}")
        if precision == "fp16" and not cuda:
            raise ValueError(f"{self.name}: precision 'fp16' needs a CUDA device; on {self.device} use 'fp32' or 'bf16'")
        graph_batches = tuple(sorted({int(b) for b in cuda_graph_batches}))
        for b in graph_batches:
            if not 1 <= b <= self.max_batch:
                raise ValueError(f"{self.name}: cuda_graph_batches entry {b} is outside 1..max_batch={self.max_batch}")
        mode = (compile_kwargs or {}).get("mode")
        if graph_batches and compile and mode in _CUDAGRAPH_COMPILE_MODES:
            raise ValueError(
                f"{self.name}: compile mode {mode!r} captures CUDA graphs of its own; with cuda_graph_batches "
                "use the default mode (its kernels are captured here) or drop cuda_graph_batches"
            )
        if graph_batches and not cuda:
            logger.warning("%s: cuda_graph_batches=%s ignored on %s", self.name, graph_batches, self.device)
            graph_batches = ()
        self._precision = precision
        self._reduced = _REDUCED.get(precision)
        self._cast_model = bool(cast_model) and self._reduced is not None
        self._graph_batches = graph_batches
        self._compile = bool(compile)
        self._compile_kwargs = dict(compile_kwargs or {})
        self.startup_s = 0.0

        module = module.to(self.device).eval()
        if self._cast_model:
            module = module.to(self._reduced)
        if channels_last:
            module = module.to(memory_format=torch.channels_last)
        self._module = module
        self._call: Any = module  # replaced by the compiled module at warm-up
        self._graphs = GraphSet(self._graph_forward, self.inputs, self.outputs, self.device) if graph_batches else None

    @property
    def precision(self) -> str:
        return self._precision

    @property
    def module(self) -> torch.nn.Module:
        return self._module

    @property
    def graph_batches(self) -> tuple[int, ...]:
        """Batch sizes with a captured CUDA graph (empty before :meth:`warmup`)."""
        return self._graphs.batch_sizes if self._graphs is not None else ()

    # -- forward -----------------------------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager[object]:
        if self._reduced is None or self._cast_model:
            return contextlib.nullcontext()
        # The weight-cast cache is off for every call, eager ones too. PyTorch keeps ONE process-wide cache of
        # the reduced-precision copies of fp32 weights (only the nesting depth is per thread), so a thread in a
        # forward of this module would use the copy another thread's forward made: allocated and written on
        # that thread's CUDA stream, read on its own with nothing ordering the two (garbage weights, NaN poses
        # with concurrent register stages); and whichever thread leaves autocast first clears the cache, handing
        # the copy back to the allocator of the first stream while the other may still read it. Each weight is
        # used once per forward, so the cache saved nothing; a cast per use gives the same bits. (CUDA-graph
        # capture needs it off as well, as torch documents.)
        return torch.autocast(device_type=self.device.type, dtype=self._reduced, cache_enabled=False)

    def _forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One forward: inputs in spec order -> outputs in spec order, cast to the output spec dtypes."""
        if self._cast_model:
            xs = tuple(x.to(self._reduced) if x.is_floating_point() else x for x in xs)
        with torch.no_grad(), self._autocast():
            out = self._call(*xs)
        outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        if len(outs) != len(self.outputs):
            raise EngineError(
                f"{self.name}: module returned {len(outs)} tensor(s), the output specs name {len(self.outputs)}: "
                f"{[s.name for s in self.outputs]}",
                backend="torch",
            )
        n = xs[0].shape[0]
        result = []
        for spec, o in zip(self.outputs, outs, strict=True):
            if not isinstance(o, torch.Tensor) or tuple(o.shape) != spec.with_batch(n):
                got = tuple(o.shape) if isinstance(o, torch.Tensor) else type(o).__name__
                raise EngineError(
                    f"{self.name}: module output {spec.name!r}: expected shape {spec.with_batch(n)}; got {got}",
                    backend="torch",
                )
            result.append(o if o.dtype == spec.dtype else o.to(spec.dtype))
        return tuple(result)

    def _graph_forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # Capturable: autocast's weight-cast cache, which must be off inside CUDA-graph capture, is always off.
        return self._forward(*xs)

    def capturable_forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One eager forward that a caller may capture inside its own CUDA graph (a whole pipeline step).

        xs: inputs in input-spec order, already on the device; returns outputs in output-spec order (spec dtypes).
        The same kernels as this core's own graphs (autocast weight cache off); never replays a graph of the
        core (graphs do not nest). Runs on the current stream; no host synchronisation.
        """
        return self._graph_forward(*xs)

    def _infer(
        self,
        inputs: Mapping[str, torch.Tensor],
        outputs: Mapping[str, torch.Tensor] | None,
        n: int,
        stream: Stream | None,
    ) -> dict[str, torch.Tensor]:
        if self._graphs is not None and n in self._graphs:
            return self._graphs.run(inputs, outputs, n, stream)
        xs = [inputs[s.name] for s in self.inputs]
        with stream_context(stream):
            try:
                outs = self._forward(*xs)
            except EngineError:
                raise
            except Exception as exc:  # the one seam where module failures become our error type
                raise EngineError(f"{self.name}: module forward failed at N={n}: {exc}", backend="torch") from exc
            if outputs is None:
                return {s.name: o for s, o in zip(self.outputs, outs, strict=True)}
            for s, o in zip(self.outputs, outs, strict=True):
                outputs[s.name].copy_(o)
        return dict(outputs)

    # -- lifecycle ---------------------------------------------------------------------------------------
    def warmup(self, batch_sizes: Iterable[int] = (1,)) -> None:
        """Compile (if asked), run eagerly at each of ``batch_sizes``, then capture ``cuda_graph_batches``.
        Adds the elapsed seconds to ``startup_s``."""
        start = time.perf_counter()
        batch_sizes = tuple(batch_sizes)
        if self._compile and self._call is self._module:
            self._call = torch.compile(self._module, **self._compile_kwargs)
        super().warmup(batch_sizes)
        if self._graphs is not None:
            for b in self._graph_batches:
                self._graphs.capture(b)
        self.startup_s += time.perf_counter() - start
        logger.info("%s: warm-up done, startup %.2f s (batches %s, graphs %s)", self.name, self.startup_s,
                    batch_sizes, self.graph_batches)

    def _close(self) -> None:
        if self._graphs is not None:
            self._graphs.clear()
        self._call = self._module
