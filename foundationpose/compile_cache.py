"""A portable ``torch.compile`` cache in one file, so that a fresh machine starts about as fast as a warm one.

Compiling the networks is most of a cold start-up (docs/benchmarks.md, "Start-up"). PyTorch can serialise everything those compilations produced
(inductor's FX graphs and Triton kernels, AOTAutograd graphs, autotuning results, dynamic-shape decisions:
``torch.compiler.save_cache_artifacts``) and load it back in another process before compiling
(``load_cache_artifacts``), which then finds every graph in the cache. The file only helps the same torch and
Triton versions and the same GPU model (PyTorch checks; anything else is compiled as usual).

The file is unpickled when loaded: load only a file this service wrote (like ``trust_weights_file``).
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CacheLoad", "compile_cache_file", "load_compile_cache", "save_compile_cache"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CacheLoad:
    """What :func:`load_compile_cache` found: ``loaded`` (artifacts were installed), ``artifacts`` (how many, by
    kind) and ``reason`` when nothing was loaded."""

    path: str
    loaded: bool
    artifacts: dict[str, int]
    reason: str | None = None


def compile_cache_file(folder: Path | str, device: object) -> Path:
    """The artifact file for this torch version and ``device``'s GPU model inside ``folder`` (one file per pair:
    PyTorch refuses artifacts of another version or GPU, so machines that share a folder keep their own)."""
    import torch

    gpu = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "cpu"  # type: ignore[arg-type]
    name = re.sub(r"[^A-Za-z0-9.+-]+", "_", f"torch-{torch.__version__}-{gpu}")
    return Path(folder) / f"{name}.bin"


def load_compile_cache(path: Path | str) -> CacheLoad:
    """Install the artifacts of ``path`` before anything compiles. A missing, empty or unreadable file is not an
    error (start-up compiles as without it; the reason is logged and returned)."""
    import torch

    path = Path(path)
    if not path.is_file():
        return CacheLoad(str(path), False, {}, "no file yet")
    data = path.read_bytes()
    if not data:
        return CacheLoad(str(path), False, {}, "empty file")
    try:
        info = torch.compiler.load_cache_artifacts(data)
    except Exception as exc:  # noqa: BLE001 - a bad cache must never stop a start-up
        log.warning("compile cache %s not loaded (%s: %s); compiling from scratch", path, type(exc).__name__, exc)
        return CacheLoad(str(path), False, {}, f"{type(exc).__name__}: {exc}")
    if info is None:  # torch logged why (e.g. a corrupted file)
        log.warning("compile cache %s could not be read; compiling from scratch", path)
        return CacheLoad(str(path), False, {}, "unreadable")
    counts = {kind: len(keys) for kind, keys in info.artifacts.items()}
    log.info("compile cache %s loaded: %s", path, counts)
    return CacheLoad(str(path), True, counts)


def save_compile_cache(path: Path | str) -> int:
    """Write every compilation artifact of this process to ``path`` (atomically: a temporary file renamed over it);
    returns the bytes written (0 when nothing was compiled: no file is written)."""
    import torch

    artifacts = torch.compiler.save_cache_artifacts()
    if artifacts is None:
        return 0
    data, info = artifacts
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    log.info("compile cache %s saved: %d bytes, %s", path, len(data),
             {kind: len(keys) for kind, keys in info.artifacts.items()})
    return len(data)
