"""Benchmark reports: one JSON document on stdout, optionally the same text in a file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["emit_json_report"]


def emit_json_report(report: dict[str, Any], path: str | Path | None = None) -> str:
    """Print ``report`` as indented JSON (the benchmarks' contract) and, with ``path``, write it there too."""
    text = json.dumps(report, indent=2)
    print(text)
    if path:
        Path(path).write_text(text + "\n", encoding="utf-8")
    return text
