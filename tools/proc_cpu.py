"""Where the machine's CPU goes during a load window: CPU time of a process tree and of other processes, per process
and per thread, as JSON. Tells a GIL- or loop-bound server (one thread near 100%) from a saturated machine (every
core busy) before reading a profile. Linux only (reads ``/proc``).

    python tools/proc_cpu.py --pid SERVER_PID --also loadtest --duration-s 6 > cpu.json

Reads ``/proc`` twice, ``--duration-s`` apart: a process's ``cpu`` is its CPU seconds per wall second in the window
(1.0 = one core busy). ``--pid`` and its descendants are listed one by one, with their busiest threads (thread id,
CPU, ``comm`` name); ``--also PATTERN`` adds the processes whose command line contains PATTERN (the load generator)
and their descendants, summed. ``machine_busy`` is the share of all cores' time that was not idle.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["sample_window"]

_TICKS = os.sysconf("SC_CLK_TCK")


def _stat_fields(path: Path) -> list[str] | None:
    """The fields of a /proc stat file after the ``(comm)`` field (which may hold spaces), or None if gone."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()


def _cpu_s(fields: list[str]) -> float:
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime (fields 14, 15 of stat(5))


def comm_of(path: Path) -> str:
    """A /proc ``comm`` file's name (a thread's or process's), or ``?`` if gone."""
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return "?"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _parents() -> dict[int, int]:
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(entry / "stat")
            if fields is not None:
                out[int(entry.name)] = int(fields[1])
    return out


def _tree(root: int, parents: dict[int, int]) -> list[int]:
    tree, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, ppid in parents.items() if ppid in frontier]
        tree += frontier
    return tree


def cpu_times(pid: int) -> tuple[float, dict[int, float]] | None:
    """(the process's CPU seconds, {thread id: its CPU seconds}) so far, or None if the process is gone."""
    fields = _stat_fields(Path(f"/proc/{pid}/stat"))
    if fields is None:
        return None
    threads = {}
    try:
        tids = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:
        tids = []
    for tid in tids:
        tf = _stat_fields(Path(f"/proc/{pid}/task/{tid}/stat"))
        if tf is not None:
            threads[tid] = _cpu_s(tf)
    return _cpu_s(fields), threads


def _machine_idle() -> tuple[float, float]:
    """(idle + iowait ticks, all ticks) of every core so far."""
    values = [int(v) for v in Path("/proc/stat").read_text(encoding="utf-8").split("\n", 1)[0].split()[1:]]
    return values[3] + values[4], sum(values[:8])


def sample_window(root_pid: int, also: list[str], duration_s: float, top_threads: int = 8) -> dict[str, Any]:
    """CPU per process of ``root_pid``'s tree (with its busiest threads) and of the ``also`` matches, over one window.
    ProcessLookupError when ``root_pid`` does not exist."""
    if not Path(f"/proc/{root_pid}").exists():
        raise ProcessLookupError(root_pid)
    parents = _parents()
    tree = _tree(root_pid, parents)
    me = os.getpid()
    matched = [pid for pid in parents if pid not in tree and pid != me and also
               and any(pattern in _cmdline(pid) for pattern in also)]
    # with their descendants: a load generator's multiprocessing children have other command lines
    others = sorted({pid for root in matched for pid in _tree(root, parents)} - set(tree) - {me})
    idle0, all0 = _machine_idle()
    t0 = time.perf_counter()
    before = {pid: cpu_times(pid) for pid in tree + others}
    time.sleep(duration_s)
    after = {pid: cpu_times(pid) for pid in tree + others}
    wall = time.perf_counter() - t0
    idle1, all1 = _machine_idle()

    def cpu_of(pid: int) -> float | None:
        a, b = before.get(pid), after.get(pid)
        return None if a is None or b is None else round((b[0] - a[0]) / wall, 3)

    processes = []
    for pid in tree:
        a, b = before.get(pid), after.get(pid)
        threads = []
        if a is not None and b is not None:
            busy = sorted(((b[1][tid] - a[1].get(tid, 0.0)) / wall, tid) for tid in b[1])[::-1][:top_threads]
            threads = [{"tid": tid, "cpu": round(c, 3), "name": comm_of(Path(f"/proc/{pid}/task/{tid}/comm"))}
                       for c, tid in busy]
        processes.append({"pid": pid, "command": _cmdline(pid)[:120], "cpu": cpu_of(pid), "threads": threads})
    also_cpu = [c for c in (cpu_of(pid) for pid in others) if c is not None]
    ticks = max(all1 - all0, 1)
    return {"window_s": round(wall, 3), "cores": os.cpu_count(), "machine_busy": round(1 - (idle1 - idle0) / ticks, 3),
            "tree_cpu": round(sum(p["cpu"] or 0.0 for p in processes), 3), "processes": processes,
            "also": {"patterns": also, "processes": len(also_cpu), "cpu": round(sum(also_cpu), 3)}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pid", type=int, required=True, help="the root process (the server); its descendants included")
    p.add_argument("--also", action="append", default=[], metavar="PATTERN",
                   help="also sum the processes whose command line contains PATTERN, with their descendants (repeatable)")
    p.add_argument("--duration-s", type=float, default=5.0, help="window length (default %(default)s)")
    p.add_argument("--top-threads", type=int, default=8, help="threads listed per process (default %(default)s)")
    args = p.parse_args(argv)
    if args.duration_s <= 0:
        p.error("--duration-s must be > 0")
    try:
        result = sample_window(args.pid, args.also, args.duration_s, args.top_threads)
    except ProcessLookupError:
        print(f"proc_cpu: no process {args.pid}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
