"""CUDA-graph replay of a fixed-batch forward: static input/output buffers, copy in, replay, copy out.

Used by :class:`~deploy_core.infer.TorchInferCore` for the batch sizes listed in ``cuda_graph_batches``
(e.g. batch 1 for tracking, where launches dominate: ~4x faster per notes/device.md). A graph is only
replayed for *exactly* its batch size: padding a smaller batch would change results of set-wise networks
(the scorer treats all N hypotheses as one cross-attention set).

Ordering: every graph of one core shares one memory pool and one set of static buffers per batch size, so
replays must not overlap on the GPU. Each replay makes its stream wait for the previous replay's
"done" event (GPU-side, no host sync), and a host lock serialises the enqueueing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from deploy_core.capture import capture_graph
from deploy_core.cuda import record_event, wait_event

if TYPE_CHECKING:
    from torch.cuda import Event, Stream

    from deploy_core.infer._base import TensorSpec

__all__ = ["GraphSet"]

_WARMUP_ITERS = 3  # eager runs on the side stream before capture (cuDNN/cuBLAS lazy init), as torch requires


class _Captured:
    __slots__ = ("graph", "static_in", "static_out")

    def __init__(self, graph: torch.cuda.CUDAGraph, static_in: tuple[torch.Tensor, ...],
                 static_out: tuple[torch.Tensor, ...]) -> None:
        self.graph = graph
        self.static_in = static_in
        self.static_out = static_out


class GraphSet:
    """Captured graphs of ``forward`` keyed by batch size, all on ``device``.

    forward: ``forward(*inputs) -> tuple[Tensor, ...]`` in output-spec order; must be capturable (no host
             syncs, no data-dependent shapes, autocast with ``cache_enabled=False``).
    """

    def __init__(self, forward: Callable[..., tuple[torch.Tensor, ...]], inputs: Sequence[TensorSpec],
                 outputs: Sequence[TensorSpec], device: torch.device) -> None:
        self._forward = forward
        self._inputs = tuple(inputs)
        self._outputs = tuple(outputs)
        self._device = device
        self._graphs: dict[int, _Captured] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self._lock = threading.Lock()
        self._done: Event | None = None

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def __contains__(self, n: int) -> bool:
        return n in self._graphs

    def capture(self, n: int) -> None:
        """Capture the forward at batch ``n`` (synchronises the device; call at warm-up only)."""
        if n in self._graphs:
            return
        with torch.cuda.device(self._device), torch.no_grad():
            static_in = tuple(torch.zeros(s.with_batch(n), dtype=s.dtype, device=self._device) for s in self._inputs)
            graph, out = capture_graph(lambda: self._forward(*static_in), self._device, torch.cuda.Stream(self._device),
                                       pool=self._pool, warmup_runs=_WARMUP_ITERS)
            static_out = tuple(out)
        for spec, t in zip(self._outputs, static_out, strict=True):
            assert tuple(t.shape) == spec.with_batch(n), (spec.name, tuple(t.shape))
        self._graphs[n] = _Captured(graph, static_in, static_out)

    def run(self, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor] | None, n: int,
            stream: Stream | None) -> dict[str, torch.Tensor]:
        """Copy ``inputs`` into the static buffers, replay, and copy the results into ``outputs`` (or into
        fresh tensors). Everything is enqueued on ``stream`` (the current stream when ``None``)."""
        cap = self._graphs[n]
        with self._lock:
            s = stream if stream is not None else torch.cuda.current_stream(self._device)
            wait_event(s, self._done)  # the previous replay no longer needs the shared buffers
            with torch.cuda.stream(s):
                for spec, buf in zip(self._inputs, cap.static_in, strict=True):
                    buf.copy_(inputs[spec.name])
                cap.graph.replay()  # launches on the current stream, i.e. `s`
                if outputs is not None:
                    for spec, buf in zip(self._outputs, cap.static_out, strict=True):
                        outputs[spec.name].copy_(buf)
                    result = dict(outputs)
                else:
                    result = {spec.name: buf.clone() for spec, buf in zip(self._outputs, cap.static_out, strict=True)}
            self._done = record_event(s)
        return result

    def clear(self) -> None:
        with self._lock:
            self._graphs.clear()
            self._done = None
