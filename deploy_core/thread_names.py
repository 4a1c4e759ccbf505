"""The calling thread's name, as the operating system shows it (``top -H``, ``/proc/<pid>/task/<tid>/comm``,
``tools/proc_cpu.py``): Python's thread names stay inside the interpreter, so without this every thread of the
server reads ``python3`` there. Linux only; elsewhere (or when libc refuses) nothing happens."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading

__all__ = ["NATIVE_NAME_MAX", "name_native_thread"]

NATIVE_NAME_MAX = 15  # Linux keeps 16 bytes, the terminating NUL included
_PR_SET_NAME = 15  # prctl(2)


def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    return getattr(libc, "prctl", None)


_PRCTL = _prctl()


def name_native_thread(name: str | None = None) -> bool:
    """Give the calling thread ``name`` (default: its Python name), cut to 15 bytes, as its OS name; True if set."""
    if _PRCTL is None:
        return False
    raw = (name if name is not None else threading.current_thread().name).encode("utf-8", "replace")
    return _PRCTL(_PR_SET_NAME, ctypes.c_char_p(raw[:NATIVE_NAME_MAX]), 0, 0, 0) == 0
