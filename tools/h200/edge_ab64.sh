#!/usr/bin/env bash
# Issue 11, same-call A/B of server options under the 64-client load (host timings vary up to 2x between machines,
# so only same-call comparisons count). Per variant: a fresh `python -m server --renderer triton --fast` (the inductor
# cache of the first start makes the later ones ~20 s), then one client over WS /track/stream and /track/binary
# (6 s each), then 64 binary-HTTP clients (8 processes) + 4 register-only clients offering 8 registers/s (10 s window),
# with py-spy sampling the server (all active threads) for 6 s of that window.
#   VARIANTS="base omp1 stage stage_omp1" bash tools/h200/edge_ab64.sh        (~1.5 min per variant)
# Variants: base (defaults), omp1 (OMP_NUM_THREADS=1: torch's CPU copies on one thread), stage
# (--track-stage-in-caller), stage_omp1 (both), env:NAME=VALUE,... / args:... are not parsed: add a case below.
# Wheels: ../shared/tools/device-wheels.sh py-spy==0.4.3 websockets==15.0.1 uvloop==0.21.0 httptools==0.6.4 \
#   fastapi-offline==1.7.7 imagecodecs==2026.3.6   (carry [".whl"])
# $OUT: ab64.json (per variant and run: tracks/s, registers/s, p50/p90/p99, refusals, the server's phases),
#   pyspy_<variant>.txt (threads and top self frames).
set -uo pipefail
OUT=${OUT:-/tmp/edge_ab64}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_EXTENSIONS_DIR=/tmp/torch_ext PATH=/tmp/site/bin:$PATH
export PYTHONUNBUFFERED=1 PYTHONIOENCODING=utf-8 LANG=C.UTF-8 MAX_JOBS=16
PORT=8765; URL=http://127.0.0.1:$PORT
VARIANTS=${VARIANTS:-"base omp1 stage stage_omp1"}
SERVER_ARGS=${SERVER_ARGS:-"--renderer triton --fast"}
log() { echo "=== $(date +%T) $*"; }
echo "{}" > "$OUT/ab64.json"
record() {  # record VARIANT RUN < loadtest JSON
  python3 -c '
import json, sys
path, variant, run = sys.argv[1:]
r = json.load(sys.stdin); e = r["endpoints"]; t = e.get("track") or e.get("stream_frame") or {}
endpoint = "/track/stream" if "stream_frame" in e else "/track/binary"
row = {"tracks_per_s": r["tracks_per_s"], "registers_per_s": r["registers_per_s"],
       **{k: t.get(k) for k in ("ok", "diverged", "p50_ms", "p90_ms", "p99_ms")},
       "errors": r["errors_by_status"], "refusals": r["refusals"],
       "phases": r["server_phases_ms"].get(endpoint, {}), "outside": r.get("stream_outside_phases_ms")}
rows = json.load(open(path)); rows.setdefault(variant, {})[run] = row
json.dump(rows, open(path, "w"), indent=1); print(variant, run, json.dumps(row))' "$OUT/ab64.json" "$@"
}
for v in $VARIANTS; do
  envs=() extra=""
  case "$v" in
    base) ;;
    omp1) envs=(OMP_NUM_THREADS=1) ;;
    stage) extra="--track-stage-in-caller" ;;
    stage_omp1) envs=(OMP_NUM_THREADS=1); extra="--track-stage-in-caller" ;;
    *) echo "unknown variant $v" >&2; continue ;;
  esac
  log "variant $v: ${envs[*]} $SERVER_ARGS $extra"
  objs=$(mktemp -d)
  env "${envs[@]}" python3 -m server --objects "$objs" --host 127.0.0.1 --port $PORT --device cuda --max-image 640x480 \
    --track-capacity 512 --log-level WARNING $SERVER_ARGS $extra > "/tmp/server_$v.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 200); do
    python3 -c 'import sys,urllib.request; urllib.request.urlopen(sys.argv[1]+"/readyz",timeout=2)' $URL 2>/dev/null && break
    kill -0 $SERVER 2>/dev/null || { echo "server died"; tail -20 "/tmp/server_$v.log"; break; }
    sleep 1
  done
  log "ready"
  for mode in stream http-binary; do
    timeout 60 python3 tools/loadtest.py --url $URL --image 640x480 --clients 1 --mode $mode --duration-s 6 \
      --tracks-per-register 100000 --max-requests 1000000 2>/dev/null | record "$v" "${mode}_1"
  done
  ( for _ in $(seq 1 240); do grep -q "the window of" /tmp/lt64_$v.err 2>/dev/null && break; sleep 0.5; done; sleep 2
    timeout 20 py-spy record --pid $SERVER --duration 6 --rate 250 --threads --nonblocking --format raw \
      -o "/tmp/spy_$v.txt" > /dev/null 2>&1 ) &
  SPY=$!
  timeout 120 python3 tools/loadtest.py --url $URL --image 640x480 --clients 64 --processes 8 --registers-alongside 4 \
    --register-rate 8 --mode http-binary --on-diverge stateless --duration-s 10 --tracks-per-register 100000 \
    --max-requests 1000000 --setup-timeout-s 45 2>/tmp/lt64_$v.err | record "$v" http_binary_64
  wait $SPY
  python3 tools/pyspy_top.py "/tmp/spy_$v.txt" --rate 250 --top 25 > "$OUT/pyspy_$v.txt"
  head -22 "$OUT/pyspy_$v.txt"
  kill -INT $SERVER; sleep 3; kill -9 $SERVER 2>/dev/null; wait $SERVER 2>/dev/null
done
cat "$OUT/ab64.json"
