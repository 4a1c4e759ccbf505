#!/usr/bin/env bash
# Issue 10: how far the host alone bounds the 64-session in-process track, in one call (~4 min):
#   1 the CUDA tests of both captured runners (register and track: replay == eager, service lanes, streams);
#   2 tools/track_host_ceiling.py (the graphed lane with its step reduced to one copy: what the host can feed) per
#     variant (VARIANTS): base (the defaults: requests stage their images, driver launches), nodriver (PyTorch
#     launches), nostage (the lane stacks whole batches), stepbatcher (the lane's step in the batcher's thread), each
#     also with a 0.5 ms switch interval (suffix _switch) and/or the sessions as coroutines of one event loop instead
#     of a thread each (suffix _async; _asyncpool: their submits in a pool of 4 threads), e.g. stepbatcher_async;
#   3 py-spy of one ceiling run (PROFILE_ARGS, default none: the defaults): --gil (only the GIL holder is sampled: samples / (rate x elapsed) is the
#     GIL's busy fraction) and --idle (every thread, waiting or not: where each thread's wall time goes).
#   bash tools/h200/ceiling.sh         SESSIONS=64 FRAMES=150 IMAGE=640x480 (defaults); SKIP_TESTS=1 / SKIP_PROFILE=1 leave out 1 / 3
# Wheels: ../shared/tools/device-wheels.sh py-spy==0.4.3 (carry [".whl"]).
# $OUT: pytest.txt, ceiling.json ({variant: the tool's JSON}), gil_top.txt, idle_top.txt (worker threads only).
set -uo pipefail
OUT=${OUT:-/tmp/ceiling_out}; mkdir -p "$OUT"
# CPU dry run of this script: CEILING_DRY=1 (no wheels or tests, --device cpu, 160x120, 8 sessions)
if [ -z "${CEILING_DRY:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  DEVICE=cuda
else
  DEVICE=cpu IMAGE=160x120 SESSIONS=8 FRAMES=20 SKIP_TESTS=1
fi
export PYTHONPATH=/tmp/site:$PWD TORCH_EXTENSIONS_DIR=/tmp/torch_ext PATH=/tmp/site/bin:$PATH
export PYTHONUNBUFFERED=1 PYTHONIOENCODING=utf-8 LANG=C.UTF-8 MAX_JOBS=16
SESSIONS=${SESSIONS:-64}; FRAMES=${FRAMES:-150}; IMAGE=${IMAGE:-640x480}
log() { echo "=== $(date +%T) $*"; }
if [ -z "${SKIP_TESTS:-}" ]; then
  log "CUDA tests of the captured runners"
  timeout 300 python3 -m pytest -q -rs tests/foundationpose/test_track_launch.py \
    tests/foundationpose/test_register_graph.py tests/foundationpose/test_track_graph.py > "$OUT/pytest.txt" 2>&1
  echo "pytest rc=$?"; tail -3 "$OUT/pytest.txt"
fi
CEIL="python3 tools/track_host_ceiling.py --device $DEVICE --image $IMAGE --sessions $SESSIONS --frames $FRAMES"
echo "{}" > "$OUT/ceiling.json"
run_variant() {  # run_variant NAME ARGS...
  local name=$1; shift
  log "ceiling $name: $*"
  timeout 120 $CEIL "$@" > /tmp/ceil_$name.json 2> /tmp/ceil_$name.log; echo "rc=$?"
  python3 - "$OUT/ceiling.json" "$name" /tmp/ceil_$name.json <<'PY'
import json, sys
path, name, src = sys.argv[1:]
data = json.load(open(path))
try:
    text = open(src).read()
    data[name] = json.loads(text[text.index("{"):text.rindex("}") + 1])
except (ValueError, OSError) as exc:
    data[name] = {"error": repr(exc)}
json.dump(data, open(path, "w"), indent=1)
r = data[name]
print(name, {k: r.get(k) for k in ("frames_per_s", "latency_p50_ms", "latency_p99_ms", "mean_batch", "stage_wall_p50_ms")})
PY
}
VARIANTS=${VARIANTS:-"base nodriver nostage base_switch nodriver_switch nostage_switch"}
for v in $VARIANTS; do
  args=()
  case "${v%%_*}" in
    base) ;;
    nodriver) args+=(--no-driver-launch) ;;
    nostage) args+=(--no-stage-in-caller) ;;
    stepbatcher) args+=(--step-in-batcher) ;;
    nosib) args+=(--no-step-in-batcher) ;;
    *) echo "unknown variant $v" >&2; continue ;;
  esac
  case "$v" in *_switch*) args+=(--switch-interval-ms 0.5) ;; esac
  case "$v" in *_asyncpool*) args+=(--session-model asyncio-pool) ;; *_async*) args+=(--session-model asyncio) ;; esac
  run_variant "$v" "${args[@]}"
done
PROFILE_ARGS=${PROFILE_ARGS:-""}
[ -n "${SKIP_PROFILE:-}" ] && exit 0  # SKIP_PROFILE=1: the ceiling variants only
log "py-spy --gil of the ceiling with $PROFILE_ARGS"
timeout 150 py-spy record --gil --threads --rate 250 --format raw -o /tmp/gil.txt -- $CEIL $PROFILE_ARGS > /tmp/ceil_gil.json 2>/dev/null
echo "rc=$? $(grep -E '"(frames_per_s|elapsed_s)"' /tmp/ceil_gil.json | tr -d '\n')" | tee "$OUT/gil_top.txt"
python3 tools/pyspy_top.py /tmp/gil.txt --rate 250 --workers-only --top 50 >> "$OUT/gil_top.txt"; head -25 "$OUT/gil_top.txt"
log "py-spy --idle of the ceiling with $PROFILE_ARGS"
timeout 150 py-spy record --idle --threads --rate 250 --format raw -o /tmp/idle.txt -- $CEIL $PROFILE_ARGS > /tmp/ceil_idle.json 2>/dev/null
echo "rc=$? $(grep -E '"(frames_per_s|elapsed_s)"' /tmp/ceil_idle.json | tr -d '\n')" | tee "$OUT/idle_top.txt"
python3 tools/pyspy_top.py /tmp/idle.txt --rate 250 --workers-only --top 60 >> "$OUT/idle_top.txt"; head -25 "$OUT/idle_top.txt"
