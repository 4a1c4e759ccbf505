#!/usr/bin/env bash
# Same-call A/B of the one-client edge latency: the server of an older tree (build/old, e.g.
# `git archive <commit> | tar -x -C build/old`; carry ["build/old", ".whl"]) against this tree's, each measured with
# this tree's tools/loadtest.py (raw multipart /track and WS /track/stream, one client, 8 s each).
# $OUT: ab.json (per tree and run: p50/p90/p99 and the server's phases). ~3 minutes.
set -uo pipefail
OUT=${OUT:-/tmp/edge_ab}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONIOENCODING=utf-8 LANG=C.UTF-8 TORCH_EXTENSIONS_DIR=/tmp/torch_ext
ROOT=$PWD; PORT=8765; URL=http://127.0.0.1:$PORT
echo "[]" > "$OUT/ab.json"
for tree in build/old .; do
  objs=$(mktemp -d)
  (cd "$ROOT/$tree" && PYTHONPATH=/tmp/site:$ROOT/$tree exec python3 -m server --objects "$objs" --host 127.0.0.1 --port $PORT \
     --device cuda --max-image 640x480 --track-capacity 512 --log-level WARNING --renderer triton) > /tmp/server_$$.log 2>&1 &
  SERVER=$!
  for _ in $(seq 1 200); do
    python3 -c 'import sys,urllib.request; urllib.request.urlopen(sys.argv[1]+"/readyz",timeout=2)' $URL 2>/dev/null && break
    kill -0 $SERVER 2>/dev/null || { echo "server of $tree died"; tail -20 /tmp/server_$$.log; break; }
    sleep 1
  done
  for mode in http-raw stream; do
    echo "=== $(date +%T) $tree $mode"
    PYTHONPATH=/tmp/site:$ROOT timeout 60 python3 tools/loadtest.py --url $URL --image 640x480 --clients 1 --mode $mode \
      --duration-s 8 --tracks-per-register 100000 --max-requests 1000000 2>/dev/null > /tmp/run.json
    python3 - "$OUT/ab.json" "$tree" "$mode" <<'PY'
import json, sys
path, tree, mode = sys.argv[1:]
r = json.load(open("/tmp/run.json")); e = r["endpoints"]; t = e.get("track") or e.get("stream_frame") or {}
row = {"tree": tree, "mode": mode, **{k: t.get(k) for k in ("ok", "p50_ms", "p90_ms", "p99_ms")},
       "phases": r.get("server_phases_ms"), "outside": r.get("stream_outside_phases_ms")}
rows = json.load(open(path)); rows.append(row); json.dump(rows, open(path, "w"), indent=1); print(json.dumps(row))
PY
  done
  kill -INT $SERVER; sleep 3; kill -9 $SERVER 2>/dev/null
done
