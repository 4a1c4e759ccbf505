#!/usr/bin/env bash
# Issues 10/11 on the H200, one call (< 6 minutes), from the repository root with the wheels of
# ../shared/tools/device-wheels.sh in .whl/ (carry [".whl"]):
#   1 race.json / race.log  tools/register_concurrency_probe.py: 16 registers at once through PoseService vs the
#                           sync pose, per configuration (frames in flight 1/2/4, one shared stream, the Triton
#                           network inputs) and 32 concurrent tracks through the graphed lane. Any non-finite or
#                           differing register pose is a race of the register lane (the 64-client edge answered
#                           500 PoseDivergedError for ~30% of concurrent registers of one frame).
#   2 ab.tgz                tools/h200/track_ab.sh with VARIANTS (default "base noinline"): the bench's figures
#                           with the current defaults, same call.
#   3 pyspy_gil.txt.gz      py-spy --gil (threads holding the GIL only) over a long 64-session bench run: where the
#                           host time per tracked frame goes; pyspy_top.txt the top frames (self and total) of the
#                           worker threads only (sessions, batcher, lane stages: the main thread's compile and
#                           warm-up are left out).
set -uo pipefail
OUT=${OUT:-/tmp/race_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONIOENCODING=utf-8 LANG=C.UTF-8 MAX_JOBS=16
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_EXTENSIONS_DIR=/tmp/torch_ext PATH=/tmp/site/bin:$PATH
log() { echo "=== $(date +%T) $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

log "register concurrency probe"
timeout 150 python3 tools/register_concurrency_probe.py --out "$OUT/race.json" > /dev/null 2> "$OUT/race.log"
echo "rc=$?"; grep -v "^WARNING" "$OUT/race.log" | tail -12

log "track A/B: ${VARIANTS:-base noinline}"
mkdir -p "$OUT/ab"
VARIANTS=${VARIANTS:-"base noinline"} OUT="$OUT/ab" bash tools/h200/track_ab.sh > "$OUT/ab/track_ab.txt" 2>&1
tail -5 "$OUT/ab/track_ab.txt"
(cd "$OUT" && tar czf ab.tgz ab && rm -rf ab)

log "py-spy --gil over 64 sessions x 150 frames"
timeout 150 py-spy record --gil --rate 200 --format raw -o "$OUT/pyspy_gil.txt" -- python3 -m foundationpose.bench \
  --renderer triton --graphs on --fast --fold-bn --pad-input --compile-track --sessions 64 --track-frames 150 \
  --runs 3 --warmup 1 --register-frames 2 --out "$OUT/pyspy_bench.json" > /dev/null 2> "$OUT/pyspy_bench.log"
echo "rc=$?"
python3 tools/pyspy_top.py "$OUT/pyspy_gil.txt" --rate 200 --workers-only > "$OUT/pyspy_top.txt"
head -30 "$OUT/pyspy_top.txt"; gzip -9 "$OUT/pyspy_gil.txt"
ls -la "$OUT"
