"""The service against the engine, measured in one call: each many-client load report of a ``gpu_run edge`` folder
(``<layout>_<mode>_<clients>[_no_registers].json``, written by ``python -m tools.loadtest``) set against the in-process
rate of ``python -m foundationpose.bench`` at the same number of sessions, run in the same call
(``bench_sessions.json``). Prints one JSON object::

    python -m tools.edge_ratio gpu_run_out/edge

Per load: the answered frames per second, its share of the in-process rate, the p99, the registers answered per
second (and offered), and whether it meets the service's goal at that load: at least ``GOAL_SHARE`` of the
in-process rate, a p99 of at most ``GOAL_P99_MS`` and, where registers were offered, at least
``GOAL_REGISTERS_PER_S`` of them answered. Host-bound rates vary up to 2x between machines, so the share is only
meaningful against a bench of the same call.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

GOAL_SHARE = 0.8  # of the in-process frames/s
GOAL_P99_MS = 40.0
GOAL_REGISTERS_PER_S = 5.0
BENCH_FILE = "bench_sessions.json"
_LOAD = re.compile(r"^(?P<layout>[a-z]+)_(?P<mode>http_binary|http_png|http_raw|stream)_(?P<clients>\d+)"
                   r"(?P<no_registers>_no_registers)?\.json$")


class RatioError(ValueError):
    """A folder without the reports a ratio needs (named in the message)."""


def in_process_rate(bench: dict[str, Any], sessions: int) -> float:
    """The bench's frames/s at ``sessions`` (its headline, the asyncio sessions' run); RatioError when absent."""
    try:
        return float(bench["headline"]["track_sessions"][str(sessions)]["frames_per_s"])
    except (KeyError, TypeError, ValueError) as exc:
        raise RatioError(f"the bench report has no rate for {sessions} sessions (headline.track_sessions."
                         f"{sessions}.frames_per_s); run python -m foundationpose.bench --sessions {sessions}") from exc


def load_row(report: dict[str, Any], in_process: float) -> dict[str, Any]:
    """One load report against the in-process rate."""
    endpoints = report.get("endpoints") or {}
    frames = endpoints.get("track") or endpoints.get("stream_frame") or {}
    rate = float(report.get("tracks_per_s") or 0.0)
    p99 = frames.get("p99_ms")
    offered = float((report.get("settings") or {}).get("registers_alongside") or 0) > 0
    registers = float(report.get("registers_per_s") or 0.0)
    share = rate / in_process if in_process > 0 else 0.0
    met = (share >= GOAL_SHARE and p99 is not None and p99 <= GOAL_P99_MS
           and (not offered or registers >= GOAL_REGISTERS_PER_S))
    return {"frames_per_s": round(rate, 1), "share_of_in_process": round(share, 3), "p99_ms": p99,
            "registers_offered": offered, "registers_per_s": round(registers, 2), "goal_met": bool(met)}


def ratios(folder: Path) -> dict[str, Any]:
    """Every many-client load of ``folder`` against its in-process bench (see the module docstring)."""
    bench_path = folder / BENCH_FILE
    try:
        bench = json.loads(bench_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RatioError(f"{bench_path}: no readable in-process bench report ({exc})") from exc
    loads: dict[str, Any] = {}
    rates: dict[int, float] = {}
    for path in sorted(folder.glob("*.json")):
        match = _LOAD.match(path.name)
        if match is None or int(match["clients"]) < 2:
            continue
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
        except ValueError:
            continue  # a load cut short: no report to compare
        clients = int(match["clients"])
        if clients not in rates:
            rates[clients] = in_process_rate(bench, clients)
        loads[path.stem] = {"clients": clients, **load_row(report, rates[clients])}
    if not loads:
        raise RatioError(f"{folder}: no many-client load report (<layout>_<mode>_<clients>.json)")
    return {"in_process_frames_per_s": {str(k): v for k, v in sorted(rates.items())},
            "goal": {"share": GOAL_SHARE, "p99_ms": GOAL_P99_MS, "registers_per_s": GOAL_REGISTERS_PER_S},
            "loads": loads}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path, help="a gpu_run edge results folder")
    args = p.parse_args(argv)
    try:
        print(json.dumps(ratios(args.folder), indent=1))
    except RatioError as exc:
        print(f"edge_ratio: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
