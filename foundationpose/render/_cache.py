"""A small memo of constant tensors (matrices that only depend on sizes, K or the device).

Bounded by refusing new keys once full (computed per call from then on) rather than by eviction: an entry is
never freed, so a cached CUDA tensor can be read on any stream without ``record_stream``. When an entry is
created on a CUDA device the current stream is synchronised once, which makes the value visible to every
stream; later look-ups never synchronise. (Create entries before CUDA graph capture, e.g. in a warm-up call.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["ConstantCache", "host_key"]


class ConstantCache:
    """Thread-safe ``key -> constant`` memo holding at most ``max_entries`` keys (no eviction)."""

    def __init__(self, max_entries: int = 64) -> None:
        self._max_entries = max_entries
        self._entries: dict[Hashable, Any] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable, factory: Callable[[], Any], device: torch.device) -> Any:
        """The value cached under ``key``, else ``factory()`` (cached while there is room). ``device``: where
        ``factory`` puts its tensors."""
        value = self._entries.get(key)
        if value is not None:
            return value
        value = factory()
        if len(self._entries) >= self._max_entries:
            return value
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # once per key: ready for every stream
        with self._lock:
            return self._entries.setdefault(key, value)

    def __len__(self) -> int:
        return len(self._entries)


def host_key(x: np.ndarray | Tensor) -> tuple | None:
    """A hashable key of ``x``'s values when they live on the host (no device sync), else None."""
    if isinstance(x, Tensor):
        if x.device.type != "cpu":
            return None
        x = x.detach().numpy()
    arr = np.ascontiguousarray(x)
    return (arr.dtype.str, arr.shape, arr.tobytes())
