#!/usr/bin/env bash
# Issue 10: where the host time of the 64-session in-process track goes (the figure is host-bound: GPU busy ~46%).
# Two runs of the bench (every speed option, 64 sessions x FRAMES frames, graphs on), one call (~3.5 min):
#   1 py-spy --gil --threads: only samples of the thread holding the GIL. samples / (rate x seconds) is the GIL's busy
#     fraction; by thread and by function, what holds it.
#   2 py-spy --threads (every active thread, GIL or not): which threads are saturated.
# Both summaries keep the worker threads only (sessions, batcher, lane stages, finish: their stacks start in
# threading), leaving out the main thread's start-up and compile.
# Wheels: ../shared/tools/device-wheels.sh py-spy==0.4.3 ... (carry [".whl"]).
# $OUT: gil_top.txt, active_top.txt, bench_gil.json, bench_active.json (the runs' figures; the sampler slows them).
set -uo pipefail
OUT=${OUT:-/tmp/prof64_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_EXTENSIONS_DIR=/tmp/torch_ext PATH=/tmp/site/bin:$PATH
export PYTHONUNBUFFERED=1 PYTHONIOENCODING=utf-8 LANG=C.UTF-8 MAX_JOBS=16
FRAMES=${FRAMES:-150}
BENCH="python3 -m foundationpose.bench --renderer triton --graphs on --fast --fold-bn --pad-input --compile-track \
  --sessions 64 --track-frames $FRAMES --runs 3 --warmup 1 --register-frames 2"
summary() { python3 tools/pyspy_top.py "$1" --rate "$2" --workers-only --top 50; }  # worker threads only
echo "=== $(date +%T) bench under py-spy --gil"
timeout 200 py-spy record --gil --threads --rate 200 --format raw -o /tmp/gil.txt -- $BENCH \
  --out "$OUT/bench_gil.json" > /dev/null 2> /tmp/bench_gil.log; echo "rc=$?"
summary /tmp/gil.txt 200 > "$OUT/gil_top.txt"; head -40 "$OUT/gil_top.txt"
echo "=== $(date +%T) bench under py-spy (active threads)"
timeout 200 py-spy record --threads --rate 200 --format raw -o /tmp/active.txt -- $BENCH \
  --out "$OUT/bench_active.json" > /dev/null 2> /tmp/bench_active.log; echo "rc=$?"
summary /tmp/active.txt 200 > "$OUT/active_top.txt"; head -40 "$OUT/active_top.txt"
python3 - "$OUT" <<'PY'
import json, pathlib, sys
for name in ("bench_gil.json", "bench_active.json"):
    p = pathlib.Path(sys.argv[1]) / name
    if p.exists():
        r = json.loads(p.read_text())
        print(name, json.dumps(r["track_modes"]["graphs_on"]["track_sessions"][-1]))
PY
