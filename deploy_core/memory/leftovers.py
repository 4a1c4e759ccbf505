"""Files and folders named after the process that made them, so that what a killed process leaves behind can be
found and removed: ``<prefix><pid>-<random><suffix>`` (the ingest workers' ring files in /dev/shm, the hub's socket
folder in the temporary directory)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["owned_prefix", "owners", "process_gone", "remove", "remove_stale"]


def owned_prefix(prefix: str) -> str:
    """``prefix`` followed by this process's pid: the start of a name :func:`owners` reads back."""
    return f"{prefix}{os.getpid()}-"


def owners(directory: Path, prefix: str, suffix: str = "") -> list[tuple[int, Path]]:
    """(pid, path) of every entry of ``directory`` named ``<prefix><pid>-...<suffix>``."""
    found = []
    for path in Path(directory).glob(f"{prefix}*{suffix}"):
        pid_text = path.name[len(prefix):].split("-", 1)[0]
        if pid_text.isdigit():
            found.append((int(pid_text), path))
    return found


def process_gone(pid: int) -> bool:
    """Whether no process has ``pid`` now (another user's live process counts as there)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def remove(path: Path) -> bool:
    """Remove a file or folder; False when it was gone already."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        return False
    return True


def remove_stale(directory: Path, prefix: str, suffix: str = "") -> int:
    """Remove the entries :func:`owners` finds whose process is gone; returns how many."""
    return sum(remove(path) for pid, path in owners(directory, prefix, suffix) if process_gone(pid))
