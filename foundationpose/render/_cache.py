"""Memos of constant tensors (matrices that only depend on sizes, K or the device), owned by their user.

There is no module-global cache: a :class:`GeometryConstants` belongs to one estimator (crop geometry, depth
filters, back-projection, translation guess) or one renderer (projection), which passes it to the functions of
``crop.py``, ``sampling/`` / ``projection.py``; those compute the constants per call when given none. Each memo is bounded by refusing new keys once full (computed per call
from then on, logged once) rather than by eviction: an entry is never freed, so a cached CUDA tensor can be
read on any stream without ``record_stream``. When an entry is created on a CUDA device the current stream is
synchronised once, which makes the value visible to every stream; later look-ups never synchronise. (Create
entries before CUDA graph capture, e.g. in a warm-up call.)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["ConstantCache", "GeometryConstants", "cached", "host_key"]

logger = logging.getLogger(__name__)

# Sizes: one entry per (image size, crop size, device) and kind, a handful per camera resolution.
DEFAULT_MAX_SHAPE_ENTRIES = 256
# Intrinsics: a few entries per camera (the estimator's: K64/K32 for the crops and the back-projection, K^-1
# for the translation guess, the Triton filters' K; the renderer's: P per image size), each a few dozen bytes:
# 4096 entries cover a server with several hundred cameras for under 1 MiB of device memory.
DEFAULT_MAX_INTRINSICS_ENTRIES = 4096


class ConstantCache:
    """Thread-safe ``key -> constant`` memo holding at most ``max_entries`` keys (no eviction).

    Once full, new keys are computed per call (on CUDA a host-to-device copy for a K) and one warning says so,
    naming the cache. ``max_entries=0`` turns the memo off: every call computes, silently (for owners whose keys
    never repeat, e.g. a training renderer that sees a new random camera per sample).
    """

    def __init__(self, max_entries: int, name: str = "constants") -> None:
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, got {max_entries}")
        self.name = name
        self._max_entries = max_entries
        self._entries: dict[Hashable, Any] = {}
        self._lock = threading.Lock()
        self._warned_full = False

    @property
    def max_entries(self) -> int:
        return self._max_entries

    def get(self, key: Hashable, factory: Callable[[], Any], device: torch.device) -> Any:
        """The value cached under ``key``, else ``factory()`` (cached while there is room). ``device``: where
        ``factory`` puts its tensors."""
        value = self._entries.get(key)
        if value is not None:
            return value
        value = factory()
        if self._max_entries == 0:  # memo off
            return value
        if len(self._entries) >= self._max_entries:
            self._warn_full()
            return value
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # once per key: ready for every stream
        with self._lock:
            return self._entries.setdefault(key, value)

    def _warn_full(self) -> None:
        with self._lock:
            if self._warned_full:
                return
            self._warned_full = True
        logger.warning(
            "constant cache %r is full (%d entries): new keys are computed per call from now on "
            "(a host-to-device copy each on CUDA); give it a larger max_entries",
            self.name,
            self._max_entries,
        )

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"<ConstantCache {self.name} {len(self._entries)}/{self._max_entries}>"


class GeometryConstants:
    """The two memos one owner (an estimator, a renderer) keeps: per size/device and per intrinsics K."""

    def __init__(
        self,
        *,
        max_shape_entries: int = DEFAULT_MAX_SHAPE_ENTRIES,
        max_intrinsics_entries: int = DEFAULT_MAX_INTRINSICS_ENTRIES,
        name: str = "geometry",
    ) -> None:
        self.shapes = ConstantCache(max_shape_entries, f"{name}.shapes")
        self.intrinsics = ConstantCache(max_intrinsics_entries, f"{name}.intrinsics")

    def __repr__(self) -> str:
        return f"<GeometryConstants shapes={len(self.shapes)} intrinsics={len(self.intrinsics)}>"


def cached(cache: ConstantCache | None, key: Hashable | None, factory: Callable[[], Any], device: torch.device) -> Any:
    """``cache.get(key, factory, device)``, or ``factory()`` when there is no cache or no key (device K)."""
    if cache is None or key is None:
        return factory()
    return cache.get(key, factory, device)


def host_key(x: np.ndarray | Tensor) -> tuple | None:
    """A hashable key of ``x``'s values when they live on the host (no device sync), else None."""
    if isinstance(x, Tensor):
        if x.device.type != "cpu":
            return None
        x = x.detach().numpy()
    arr = np.ascontiguousarray(x)
    return (arr.dtype.str, arr.shape, arr.tobytes())
