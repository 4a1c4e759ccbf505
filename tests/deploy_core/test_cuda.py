"""deploy_core.cuda: one code path for CPU (None streams/events, no-op waits) and CUDA."""

from __future__ import annotations

import contextlib

import pytest
import torch

import deploy_core.cuda as dc_cuda
from deploy_core.cuda import (
    as_device,
    current_stream,
    is_cuda,
    new_stream,
    record_event,
    stream_context,
    stream_handle,
    synchronize_event,
    wait_event,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")


def test_public_names() -> None:
    assert dc_cuda.__all__ == sorted(dc_cuda.__all__)
    assert all(callable(getattr(dc_cuda, n)) for n in dc_cuda.__all__)


def test_is_cuda_and_as_device() -> None:
    assert is_cuda("cuda") and is_cuda(torch.device("cuda", 1)) and not is_cuda("cpu")
    assert as_device("cpu") == torch.device("cpu")


def test_cpu_path_is_all_none_and_no_ops() -> None:
    assert new_stream("cpu") is None and new_stream(torch.device("cpu"), priority=-1) is None
    assert current_stream("cpu") is None
    ctx = stream_context(None)
    assert isinstance(ctx, contextlib.nullcontext)
    with ctx:
        pass
    event = record_event(None)
    assert event is None
    wait_event(None, event)       # no-op
    synchronize_event(event)      # no-op
    with pytest.raises(ValueError, match=r"^stream_handle needs a CUDA device, got cpu$"):
        stream_handle(None, "cpu")


@needs_cuda
def test_cuda_stream_event_handoff() -> None:
    producer, consumer = new_stream("cuda"), new_stream("cuda", priority=-1)
    assert isinstance(producer, torch.cuda.Stream) and isinstance(consumer, torch.cuda.Stream)
    assert stream_handle(producer, "cuda") == producer.cuda_stream
    with stream_context(producer):
        x = torch.ones(1 << 20, device="cuda")
        for _ in range(10):
            x.mul_(2.0)
    ready = record_event(producer)
    assert isinstance(ready, torch.cuda.Event)
    wait_event(consumer, ready)
    with stream_context(consumer):
        total = x.sum()
    done = record_event(consumer)
    synchronize_event(done)
    assert float(total) == float(1 << 20) * 1024.0
