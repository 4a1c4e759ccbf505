"""A CUDA stream whose kernels may use only some of the GPU's SMs (a CUDA green context).

Why: stream priorities order *waiting* blocks, but a kernel whose blocks already fill every SM holds them until
those blocks finish. A register's captured step is ~80 ms of large kernels; a track step beside it is ~400 small
ones, and each of those waits for register blocks to drain before it starts. Confining the register's kernels to
part of the GPU leaves the other SMs free for the track kernels the moment they are launched, at the price of a
slower register (its kernels get fewer SMs).

Kernels enqueued on the returned stream run in the green context's SM partition, eagerly or replayed from a CUDA
graph captured on that stream; the rest of the process keeps the whole GPU. Needs PyTorch's green-context API
(``torch.cuda.green_contexts`` with ``GreenContext.Stream``, PyTorch >= 2.11 built with CUDA >= 12.4) and a driver that supports it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from deploy_core.cuda import as_device

__all__ = ["SmPartition", "sm_partition"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SmPartition:
    """``stream``: enqueue work here to run it on the partition. ``context``: the green context (kept alive with the
    stream). ``num_sms``: SMs asked for (the driver may round up to its SM group size); ``device_sms``: the GPU's."""

    stream: torch.cuda.Stream
    context: Any
    num_sms: int
    device_sms: int


def sm_partition(device: str | torch.device, num_sms: int) -> SmPartition:
    """A stream on a green context of ``num_sms`` SMs of ``device``. Raises ValueError off CUDA or for a count
    outside 1..(the device's SMs - 1), RuntimeError where this PyTorch or driver has no green contexts."""
    dev = as_device(device)
    if dev.type != "cuda":
        raise ValueError(f"an SM partition needs a CUDA device; got {dev}")
    total = int(torch.cuda.get_device_properties(dev).multi_processor_count)
    if not 1 <= num_sms < total:
        raise ValueError(f"num_sms must be in 1..{total - 1} (the device has {total} SMs); got {num_sms}")
    try:
        from torch.cuda.green_contexts import GreenContext
    except ImportError:
        GreenContext = None  # noqa: N806
    if not hasattr(GreenContext, "Stream"):  # none before PyTorch 2.10; 2.10's have no stream of their own
        raise RuntimeError(f"SM partitions need torch.cuda.green_contexts with GreenContext.Stream (PyTorch >= 2.11); "
                           f"this is {torch.__version__}")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    try:
        context = GreenContext.create(num_sms=num_sms, device_id=index)
        stream = context.Stream()
    except RuntimeError as exc:
        raise RuntimeError(f"could not create a green context of {num_sms} SMs on {dev} (PyTorch "
                           f"{torch.__version__}, CUDA {torch.version.cuda}): {exc}") from exc
    logger.info("SM partition: %d of %d SMs on %s (stream %#x)", num_sms, total, dev, stream.cuda_stream)
    return SmPartition(stream=stream, context=context, num_sms=num_sms, device_sms=total)
