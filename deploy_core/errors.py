"""Exceptions raised by deploy_core.

::

    DeployError
    ├─ ClosedError           the queue/pipeline/pool was closed by us
    ├─ BrokenPipelineError   a stage thread died; every pending future failed
    ├─ BusyError             no room within the caller's timeout (server: 503/429)
    ├─ DeadlineError         the package's deadline passed before it completed (also a TimeoutError)
    ├─ EmptyError            nothing to take within the caller's timeout (queue get)
    ├─ CapacityError         a request above a pool buffer's (or engine's) max shape
    ├─ LeaseError            a lease used after release, or released twice
    └─ EngineError           an inference backend failed (.backend, .engine_path)
       └─ BackendUnavailableError  its library is missing or too old (also an ImportError)
"""

from __future__ import annotations

__all__ = [
    "DeployError",
    "ClosedError",
    "BrokenPipelineError",
    "BusyError",
    "DeadlineError",
    "EmptyError",
    "CapacityError",
    "LeaseError",
    "EngineError",
    "BackendUnavailableError",
]


class DeployError(Exception):
    """Base class of every error raised by deploy_core."""


class ClosedError(DeployError):
    """The object (queue, pipeline, pool) was closed; the operation cannot proceed."""


class BrokenPipelineError(DeployError):
    """A stage loop died unexpectedly; the pipeline refuses new work."""


class BusyError(DeployError):
    """The pipeline or pool is full and the caller's timeout expired (backpressure)."""


class DeadlineError(DeployError, TimeoutError):
    """The caller's deadline passed before the work completed; it was dropped at a stage boundary
    (nothing kept computing for it) and its pool slot returned."""


class EmptyError(DeployError):
    """Nothing arrived within the caller's timeout (``BlockQueue.get_nowait`` / ``get(timeout=...)``)."""


class CapacityError(DeployError, ValueError):
    """A request exceeds a preallocated capacity (pool buffer max shape, engine max batch)."""


class LeaseError(DeployError):
    """A pool lease was misused (released twice, used after release)."""


class EngineError(DeployError):
    """An inference backend failed; carries the backend name and engine path when known."""

    def __init__(self, message: str, *, backend: str = "", engine_path: str | None = None) -> None:
        super().__init__(message)
        self.backend = backend
        self.engine_path = engine_path


class BackendUnavailableError(EngineError, ImportError):
    """An optional backend library (tensorrt, onnxruntime) cannot be imported, or is too old.

    Also an ``ImportError``, so ``except ImportError`` around an optional import keeps working; the message is
    one sentence with the install command.
    """
