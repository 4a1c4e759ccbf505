"""Content-addressed cache of built engine files, safe across processes.

A plan is only valid for the exact ONNX graph, TensorRT version, GPU, precision and
optimisation profiles it was built with, so the cache key hashes all of them. Building
happens under an exclusive file lock (``fcntl.flock``) so that two processes never build
the same plan at once, and the result is published by an atomic rename, so a reader
never sees a half-written file.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["file_sha256", "plan_cache_key", "locked", "atomic_write_bytes", "get_or_build"]

log = logging.getLogger(__name__)


def file_sha256(path: Path, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def plan_cache_key(*, onnx_sha256: str, trt_version: str, gpu_name: str, precision: str, profiles: object) -> str:
    """Stable short key: sha256 over a canonical JSON of everything a plan depends on."""
    payload = json.dumps(
        {
            "onnx": onnx_sha256,
            "tensorrt": trt_version,
            "gpu": gpu_name,
            "precision": precision,
            "profiles": profiles,
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


@contextlib.contextmanager
def locked(lock_path: Path) -> Iterator[None]:
    """Exclusive inter-process lock held for the duration of the block."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file in the same directory, fsync, then rename over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def get_or_build(path: Path, build: Callable[[], bytes]) -> tuple[Path, bool]:
    """Return ``path``, building it with ``build()`` under a lock if it does not exist yet.

    Returns ``(path, built)`` where ``built`` says whether this call produced the file.
    A second process waiting on the lock finds the file published and does not rebuild.
    """
    if path.exists():
        return path, False
    with locked(path.with_name(path.name + ".lock")):
        if path.exists():  # another process built it while we waited
            return path, False
        log.info("building %s (this can take minutes)", path.name)
        atomic_write_bytes(path, build())
        return path, True
