"""Summarise a ``py-spy record --format raw`` file (collapsed stacks, ``frame;frame;... count`` per line): the share of
samples by thread name, the top frames by self time and by total (inclusive) time.

    python tools/pyspy_top.py /tmp/spy.txt --rate 250                 # every sampled thread
    python tools/pyspy_top.py /tmp/gil.txt --rate 200 --workers-only  # threads started by threading (not main)

With ``--threads`` recordings the first frame names the thread (``thread (0x7f..): fp-step``); threads of one name are
summed (64 session threads read as one line per name). ``--rate``: the sampling rate, to turn samples into seconds.
"""

from __future__ import annotations

import argparse
import collections
import sys
from collections.abc import Iterable


def summarise(lines: Iterable[str], *, rate_hz: float, workers_only: bool, top: int = 40) -> str:
    by_thread: collections.Counter[str] = collections.Counter()
    self_c: collections.Counter[str] = collections.Counter()
    total_c: collections.Counter[str] = collections.Counter()
    n = 0
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if workers_only and not any("threading.py" in f for f in frames[:4]):
            continue
        c = int(count)
        n += c
        by_thread[frames[0].split(": ", 1)[-1]] += c
        self_c[frames[-1]] += c
        for f in set(frames[1:]):
            total_c[f] += c
    share = max(n, 1)
    out = [f"{n} samples ({n / rate_hz:.1f} s of samples at {rate_hz:g} Hz"
           f"{'; worker threads only' if workers_only else ''})", "== by thread name"]
    out += [f"{100 * c / share:6.2f}%  {c / rate_hz:7.2f} s  {t}" for t, c in by_thread.most_common(15)]
    out.append("== self")
    out += [f"{100 * c / share:6.2f}%  {f}" for f, c in self_c.most_common(top)]
    out.append("== total")
    out += [f"{100 * c / share:6.2f}%  {f}" for f, c in total_c.most_common(top)]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("raw", help="py-spy record --format raw output")
    p.add_argument("--rate", type=float, default=100.0, help="the recording's --rate (default 100)")
    p.add_argument("--workers-only", action="store_true", help="only threads started by threading")
    p.add_argument("--top", type=int, default=40, help="frames per list (default 40)")
    args = p.parse_args(argv)
    try:
        with open(args.raw, encoding="utf-8", errors="replace") as f:
            print(summarise(f, rate_hz=args.rate, workers_only=args.workers_only, top=args.top))
    except OSError as exc:
        print(f"no py-spy output: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
