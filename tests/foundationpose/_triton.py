"""Skip marks shared by the Triton kernel tests (interpreter on CPU, compiled kernels on CUDA)."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest
import torch


def missing_triton(exc: ImportError) -> str:
    """The skip reason when a kernel module cannot be imported."""
    return f"triton is not installed ({exc}); pip install triton to run these"


def import_kernels(module: str) -> tuple[ModuleType | None, str]:
    """(the kernel module, "") or (None, the skip reason) when it cannot be imported (CPU CI without triton)."""
    try:
        return importlib.import_module(module), ""
    except ImportError as exc:
        return None, missing_triton(exc)


def triton_marks(kernels: ModuleType | None, import_error: str) -> tuple[pytest.MarkDecorator, pytest.MarkDecorator]:
    """(needs_interpreter, needs_cuda) for a kernel module (None when it did not import, with ``import_error``)."""
    needs_interpreter = pytest.mark.skipif(
        kernels is None or not kernels.interpreter_available(),
        reason=import_error or "this triton has no interpreter (triton.runtime.interpreter)",
    )
    needs_cuda = pytest.mark.skipif(
        kernels is None or not torch.cuda.is_available(), reason=import_error or "needs a CUDA device"
    )
    return needs_interpreter, needs_cuda
