"""Stream and event helpers that give CPU and CUDA one code path.

On CPU there are no streams: :func:`new_stream` returns ``None``, :func:`record_event` returns ``None`` and
every wait on ``None`` does nothing. On CUDA the same calls enqueue GPU-side ordering without ever
synchronising the host (the only host wait is :func:`synchronize_event`, called where results are read).

Convention used by every helper here: a ``stream`` of ``None`` means "no stream of ours" - the CPU path, or
on CUDA the caller's current stream where a CUDA call needs one (documented per function).

Typical hand-off between two stages (the style guide, "GPU streams and events")::

    with stream_context(producer_stream):
        render(out)                                  # enqueued on producer_stream
    ready = record_event(producer_stream)            # None on CPU
    wait_event(consumer_stream, ready)               # GPU-side wait, no host sync
    with stream_context(consumer_stream):
        infer(out)
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # torch.cuda classes exist in CPU builds too, but keep the annotations cheap
    from torch.cuda import Event, Stream

__all__ = [
    "as_device",
    "current_stream",
    "is_cuda",
    "new_stream",
    "record_event",
    "stream_context",
    "stream_handle",
    "synchronize_event",
    "wait_event",
]


def as_device(device: str | torch.device) -> torch.device:
    """Normalise ``device`` to a ``torch.device``; a bare ``"cuda"`` gets the current CUDA index when CUDA exists."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def is_cuda(device: str | torch.device) -> bool:
    """True when ``device`` names a CUDA device (whether or not CUDA is usable here)."""
    return torch.device(device).type == "cuda"


def new_stream(device: str | torch.device, priority: int = 0) -> Stream | None:
    """A new CUDA stream on ``device`` (lower ``priority`` number = higher priority), or ``None`` on CPU."""
    if not is_cuda(device):
        return None
    return torch.cuda.Stream(device=as_device(device), priority=priority)


def current_stream(device: str | torch.device) -> Stream | None:
    """The caller's current CUDA stream on ``device``, or ``None`` on CPU."""
    if not is_cuda(device):
        return None
    return torch.cuda.current_stream(as_device(device))


def stream_handle(stream: Stream | None, device: str | torch.device) -> int:
    """The raw ``cudaStream_t`` of ``stream`` (or of the current stream when ``None``) as an int, for
    libraries that take a handle (TensorRT). Only valid for CUDA devices."""
    if not is_cuda(device):
        raise ValueError(f"stream_handle needs a CUDA device, got {device}")
    if stream is None:
        stream = torch.cuda.current_stream(as_device(device))
    return int(stream.cuda_stream)


def stream_context(stream: Stream | None) -> contextlib.AbstractContextManager[object]:
    """``torch.cuda.stream(stream)`` for a CUDA stream; a no-op context for ``None`` (CPU)."""
    if stream is None:
        return contextlib.nullcontext()
    return torch.cuda.stream(stream)


def record_event(stream: Stream | None) -> Event | None:
    """Record a new event on ``stream`` (after the work enqueued so far) and return it; ``None`` for ``None``.

    Recording is a host-side enqueue: it never waits for the GPU.
    """
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def wait_event(stream: Stream | None, event: Event | None) -> None:
    """Make ``stream`` wait (GPU-side) for ``event``; no host synchronisation.

    ``event is None`` (CPU, or nothing to wait for) is a no-op. ``stream is None`` with a real event makes the
    caller's current stream (on the current CUDA device) wait, so a forgotten stream never loses the ordering.
    """
    if event is None:
        return
    if stream is None:
        stream = torch.cuda.current_stream()
    stream.wait_event(event)


def synchronize_event(event: Event | None) -> None:
    """Block the host until ``event`` has completed; no-op for ``None``. Use only where results are read."""
    if event is not None:
        event.synchronize()

