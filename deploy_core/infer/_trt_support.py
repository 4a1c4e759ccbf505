"""TensorRT at one seam: the lazy import with its version check, and the logger that keeps error messages.

Used by the inference core (:mod:`deploy_core.infer._trt_core`) and the plan builder (``engines.build``), so
both say the same thing when TensorRT is missing and both turn TensorRT's logged errors into our messages.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from deploy_core.errors import BackendUnavailableError

__all__ = ["MIN_TENSORRT_MAJOR", "has_tensorrt", "import_tensorrt", "make_trt_logger"]

logger = logging.getLogger("deploy_core.infer.tensorrt")

MIN_TENSORRT_MAJOR = 10  # name-based I/O and execute_async_v3


def import_tensorrt() -> Any:
    """The ``tensorrt`` module. Raises :class:`BackendUnavailableError` (an ``ImportError``) when it is missing
    or older than TensorRT 10."""
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise BackendUnavailableError(
            f"TensorRT is not installed: pip install tensorrt (NVIDIA's wheel, >= {MIN_TENSORRT_MAJOR}, "
            "CUDA machines only), or use the torch / onnxruntime backend",
            backend="tensorrt",
        ) from exc
    version = str(getattr(trt, "__version__", "0"))
    if int(version.split(".")[0]) < MIN_TENSORRT_MAJOR:
        raise BackendUnavailableError(
            f"TensorRT >= {MIN_TENSORRT_MAJOR} is required; found {version}", backend="tensorrt"
        )
    return trt


def has_tensorrt() -> bool:
    """True when TensorRT >= 10 can be imported."""
    try:
        import_tensorrt()
    except ImportError:
        return False
    return True


def make_trt_logger(trt: Any) -> Any:
    """An ``ILogger`` that forwards to Python logging and keeps each thread's error messages.

    TensorRT calls ``log`` synchronously on the thread that made the failing API call, so a thread-local list
    holds exactly the errors of the current call: ``take()`` returns and clears them.
    """
    severity = trt.ILogger.Severity
    errors = (severity.INTERNAL_ERROR, severity.ERROR)

    class _CapturingLogger(trt.ILogger):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self._local = threading.local()

        def _messages(self) -> list[str]:
            msgs = getattr(self._local, "errors", None)
            if msgs is None:
                msgs = self._local.errors = []
            return msgs

        def log(self, sev: Any, msg: str) -> None:
            if sev in errors:
                self._messages().append(str(msg))
                logger.error("TensorRT: %s", msg)
            elif sev == severity.WARNING:
                logger.warning("TensorRT: %s", msg)
            elif sev == severity.INFO:
                logger.debug("TensorRT: %s", msg)

        def take(self) -> list[str]:
            msgs = self._messages()
            out = list(msgs)
            msgs.clear()
            return out

    return _CapturingLogger()
