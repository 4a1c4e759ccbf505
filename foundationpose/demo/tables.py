"""Titled text tables for the console (the demo's and the evaluation's summaries)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["format_table", "fmt"]


def fmt(value: object, digits: int = 3) -> str:
    """A cell: floats with ``digits`` significant decimals, None as an en dash, booleans as yes / no."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]], note: str | None = None) -> str:
    """``title`` underlined, then the columns aligned (text left, numbers right), then an optional note."""
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    numeric = [all(_is_number(r[i]) for r in cells) if cells else False for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True))

    out = [title, "=" * len(title), line(headers), line(["-" * w for w in widths])]
    out += [line(r) for r in cells]
    if note:
        out.append(note)
    return "\n".join(s.rstrip() for s in out)


def _is_number(text: str) -> bool:
    try:
        float(text.rstrip("%"))
    except ValueError:
        return text == "–"
    return True
