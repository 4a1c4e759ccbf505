"""Triton's optional parts, for the kernel modules: ``libdevice`` (None before Triton 3.0) and the CPU
interpreter's ``InterpretedFunction`` (an internal API; None where it is missing). Import Triton itself first: this
module assumes it is installed, as every module importing it does."""

from __future__ import annotations

try:  # libdevice dispatch module (triton >= 3.0)
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - older triton
    libdevice = None

try:  # the interpreter runs kernels on CPU tensors with NumPy (internal API, optional)
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # pragma: no cover
    InterpretedFunction = None

__all__ = ["InterpretedFunction", "libdevice"]
