#!/usr/bin/env bash
# The service edge at GPU speed (issue 11), on the lent H200: full config, 640x480 frames, loopback.
# Wheels (from the repository root, before the device call; carry [".whl"]):
#   ../shared/tools/device-wheels.sh websockets==15.0.1 py-spy==0.4.3 uvloop==0.21.0 httptools==0.6.4
# Run: bash tools/h200/edge.sh        (about 4 minutes; results in $OUT)
#
# One server (python -m server, CUDA, 252 hypotheses, 5/2 iterations, random weights), then:
#   1 http_png_1     HTTP /track, one client, PNG frames                   -> p50/p90/p99
#   2 http_raw_1     HTTP /track, one client, raw frames; py-spy samples the server for 10 s
#   3 stream_1       WS /track/stream, one session                         -> p50 per frame
#   4 client_demo    python -m server.client stream on the bundled sequence (poses + percentiles)
#   5 stream_64      64 streaming sessions (8 processes) + 4 register-only clients offering 8/s
#                    -> tracks/s, p99, registers/s answered alongside
#   6 http_raw_64    64 raw-HTTP sessions (8 processes) + the same register-only clients
# $OUT: edge_summary.json (every run's loadtest JSON: per-endpoint percentiles, refusals, server phase and
# stage breakdown), pyspy_raw.txt (collapsed stacks), pyspy_top.txt (top functions), server_log.txt.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD TORCH_EXTENSIONS_DIR=/tmp/torch_ext || exit 1;
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONIOENCODING=utf-8 LANG=C.UTF-8 MAX_JOBS=16 PATH=/tmp/site/bin:$PATH
OUT=${OUT:-/tmp/edge_out}; mkdir -p "$OUT"
PORT=8765 URL=http://127.0.0.1:8765
# Overrides for a CPU dry run of this script (defaults = the H200 run):
DEVICE=${EDGE_DEVICE:-cuda} SERVER_ARGS=${EDGE_SERVER_ARGS:-} MANY=${EDGE_MANY:-64} PROCS=${EDGE_PROCS:-8}
S=${EDGE_SECONDS:-1}  # duration multiplier
WORK=$(mktemp -d); mkdir -p "$WORK/objects"
log() { echo "=== $(date +%T) $*" >&2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2

log "start the server"
python3 -m server --objects "$WORK/objects" --host 127.0.0.1 --port $PORT --device $DEVICE --max-image 640x480 \
  --track-capacity 512 --log-level WARNING $SERVER_ARGS > "$WORK/server.log" 2>&1 &
SERVER=$!
trap 'kill -INT $SERVER 2>/dev/null; sleep 3; kill -9 $SERVER 2>/dev/null; tail -c 60000 "$WORK/server.log" > "$OUT/server_log.txt"' EXIT
ready() { python3 -c 'import sys, urllib.request
try: print(urllib.request.urlopen(sys.argv[1] + "/readyz", timeout=2).read().decode())
except Exception: sys.exit(1)' $URL; }
for _ in $(seq 1 200); do
  ready >&2 && break
  kill -0 $SERVER 2>/dev/null || { log "server died"; tail -30 "$WORK/server.log" >&2; exit 1; }
  sleep 1
done

run() {  # run NAME ARGS...: one loadtest, its JSON appended to the summary
  local name=$1; shift
  log "$name: $*"
  timeout 120 python3 tools/loadtest.py --url $URL --image 640x480 --max-requests 1000000 "$@" 2>/dev/null \
    | python3 -c 'import json,sys; r=json.load(sys.stdin); r["run"]=sys.argv[1]; print(json.dumps(r))' "$name" \
    | tee -a "$WORK/runs.jsonl" | python3 -c 'import json,sys
r=json.loads(sys.stdin.read()); e=r["endpoints"]
print(json.dumps({"run": r["run"], "tracks_per_s": r["tracks_per_s"], "registers_per_s": r["registers_per_s"],
  "active_per_s": {k: v.get("active_per_s") for k, v in e.items()},
  "refusals": r["refusals"], **{k: {q: v[q] for q in ("count","p50_ms","p90_ms","p99_ms")} for k, v in e.items()},
  "phases": r["server_phases_ms"]}))' >&2
}

run http_png_1 --clients 1 --mode http-png --duration-s $((8 * S)) --tracks-per-register 100000

log "http_raw_1 with py-spy for 10 s"
( sleep 3; timeout 30 py-spy record --pid $SERVER --duration 10 --rate 250 --threads --nonblocking --format raw \
    -o "$OUT/pyspy_raw.txt" > "$WORK/pyspy.log" 2>&1 || echo "py-spy failed: $(tail -3 "$WORK/pyspy.log")" >&2 ) &
SPY=$!
run http_raw_1 --clients 1 --mode http-raw --duration-s $((15 * S)) --tracks-per-register 100000
wait $SPY
python3 - "$OUT/pyspy_raw.txt" > "$OUT/pyspy_top.txt" <<'EOF'
import collections, sys
self_n, total_n, threads, n = collections.Counter(), collections.Counter(), collections.Counter(), 0
try:
    lines = open(sys.argv[1], encoding="utf-8").read().splitlines()
except OSError as exc:
    sys.exit(f"no py-spy output: {exc}")
for line in lines:
    stack, _, count = line.rpartition(" ")
    if not stack or not count.isdigit():
        continue
    k = int(count); n += k
    frames = stack.split(";")
    threads[frames[0]] += k
    self_n[frames[-1]] += k
    for f in set(frames[1:]):
        total_n[f] += k
print(f"{n} samples (250 Hz, 10 s, all active threads)\n\nby thread:")
for t, k in threads.most_common(20): print(f"{100*k/n:6.1f}%  {t}")
print("\ntop 40 by self time:")
for f, k in self_n.most_common(40): print(f"{100*k/n:6.1f}%  {f}")
print("\ntop 40 by total time (inclusive):")
for f, k in total_n.most_common(40): print(f"{100*k/n:6.1f}%  {f}")
EOF
head -30 "$OUT/pyspy_top.txt" >&2

run stream_1 --clients 1 --mode stream --duration-s $((8 * S)) --tracks-per-register 100000

log "client_demo: python -m server.client stream (bundled sequence)"
timeout $((60 * S)) python3 -m server.client stream --url ws://127.0.0.1:$PORT --quiet > "$WORK/client.json" 2>&1
tail -2 "$WORK/client.json" >&2

run stream_64 --clients $MANY --processes $PROCS --registers-alongside 4 --register-rate 8 --mode stream --duration-s $((15 * S)) --tracks-per-register 100000
run http_raw_64 --clients $MANY --processes $PROCS --registers-alongside 4 --register-rate 8 --mode http-raw --duration-s $((15 * S)) --tracks-per-register 100000

python3 - "$WORK/runs.jsonl" "$WORK/client.json" > "$OUT/edge_summary.json" <<'EOF'
import json, sys
runs = [json.loads(l) for l in open(sys.argv[1], encoding="utf-8") if l.strip()]
client = open(sys.argv[2], encoding="utf-8").read().strip().splitlines()
out = {"runs": {r.pop("run"): r for r in runs}}
try:
    out["client_demo"] = json.loads(client[-1])
except (IndexError, ValueError):
    out["client_demo"] = {"error": "\n".join(client[-5:])}
print(json.dumps(out, indent=1))
EOF
log done
