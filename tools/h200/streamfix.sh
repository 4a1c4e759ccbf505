#!/usr/bin/env bash
# WS /track/stream's per-frame cost outside the server's phases on the H200 (the permessage-deflate fix).
# Wheels (from the repository root, before the device call; carry [".whl"]):
#   ../shared/tools/device-wheels.sh websockets==15.0.1 uvloop==0.21.0 httptools==0.6.4 orjson==3.10.18
# Run: bash tools/h200/streamfix.sh        (about 2-3 minutes; results in $OUT/streamfix.json)
#
# Two servers on one GPU, started together (one warm-up wait), measured one after the other, 1 client each:
#   fixed  (port 8766): python -m server as shipped: refuses permessage-deflate
#          stream, stream-deflate (a default websockets client offering it), http-raw
#   before (port 8767): the same server with uvicorn's default (deflate accepted), as before the fix
#          stream-deflate (what the old loadtest / server.client did), stream (the fixed client)
# Each line: stream_frame / track p50, p90 and stream_outside_phases_ms (round trip - server phases).
# Expect: fixed/* and before/stream outside p50 of a few ms, stream_frame p50 close to http-raw's track p50
# (~6-8 ms); before/stream-deflate outside p50 of tens of ms (the ~90 ms gap of the edge.sh run).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD TORCH_EXTENSIONS_DIR=/tmp/torch_ext || exit 1;
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONIOENCODING=utf-8 LANG=C.UTF-8 MAX_JOBS=16 PATH=/tmp/site/bin:$PATH
OUT=${OUT:-/tmp/streamfix_out}; mkdir -p "$OUT"
DEVICE=${STREAMFIX_DEVICE:-cuda} SERVER_ARGS=${STREAMFIX_SERVER_ARGS:---renderer triton} SECONDS_EACH=${STREAMFIX_SECONDS:-8}
WORK=$(mktemp -d)
log() { echo "=== $(date +%T) $*" >&2; }
ARGS="--host 127.0.0.1 --device $DEVICE --max-image 640x480 --log-level WARNING $SERVER_ARGS"
mkdir -p "$WORK/o1" "$WORK/o2"
python3 -m server --objects "$WORK/o1" --port 8766 $ARGS > "$WORK/fixed.log" 2>&1 &
FIXED=$!
# uvicorn's default WebSocket options (permessage-deflate accepted): the server before this fix
python3 -c 'import sys, server.routes_stream as r; r.UVICORN_WS_OPTIONS.clear(); from server.cli import main; sys.exit(main(sys.argv[1:]))' \
  --objects "$WORK/o2" --port 8767 $ARGS > "$WORK/before.log" 2>&1 &
BEFORE=$!
trap 'kill -INT $FIXED $BEFORE 2>/dev/null; sleep 3; kill -9 $FIXED $BEFORE 2>/dev/null; tail -c 20000 "$WORK/fixed.log" > "$OUT/server_fixed_log.txt"; tail -c 20000 "$WORK/before.log" > "$OUT/server_before_log.txt"' EXIT
ready() { python3 -c 'import sys, urllib.request
try: urllib.request.urlopen(sys.argv[1] + "/readyz", timeout=2).read()
except Exception: sys.exit(1)' "$1"; }
for port in 8766 8767; do
  for _ in $(seq 1 200); do
    ready http://127.0.0.1:$port && break
    kill -0 $FIXED 2>/dev/null && kill -0 $BEFORE 2>/dev/null || { log "a server died"; tail -30 "$WORK"/*.log >&2; exit 1; }
    sleep 1
  done
done
log "both servers ready"

run() {  # run NAME PORT MODE: one single-client loadtest, one summary line appended
  local name=$1 port=$2 mode=$3
  log "$name"
  timeout 90 python3 tools/loadtest.py --url http://127.0.0.1:$port --image 640x480 --clients 1 --mode $mode \
      --duration-s $SECONDS_EACH --max-requests 1000000 --tracks-per-register 100000 2>/dev/null \
    | python3 -c 'import json,sys; r=json.load(sys.stdin)
e={k: {q: v[q] for q in ("count", "p50_ms", "p90_ms")} for k, v in r["endpoints"].items() if k in ("stream_frame", "track")}
print(json.dumps({"run": sys.argv[1], **e, "outside_phases_ms": r["stream_outside_phases_ms"],
                  "phases": r["server_phases_ms"].get("/track/stream") or r["server_phases_ms"].get("/track")}))' "$name" \
    | tee -a "$WORK/runs.jsonl" >&2
}
run fixed/stream 8766 stream
run fixed/stream-deflate 8766 stream-deflate
run fixed/http-raw 8766 http-raw
run before/stream-deflate 8767 stream-deflate
run before/stream 8767 stream
python3 -c 'import json, sys; print(json.dumps({r.pop("run"): r for r in map(json.loads, open(sys.argv[1]))}, indent=1))' \
  "$WORK/runs.jsonl" > "$OUT/streamfix.json"
log done
