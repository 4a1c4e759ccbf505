#!/usr/bin/env bash
# Issue 10, second probe: the bench with the host fixes, --fast --fold-bn, with and without --compile-track (A/B in
# one call), and torch.profiler tables of 3 registers and 20 captured track steps.
# $OUT: a.json, b.json (bench), a.log, b.log, profile.txt, summary.json. Budget: ~3 minutes.
set -uo pipefail
OUT=${OUT:-/tmp/speed2_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONIOENCODING=utf-8 LANG=C.UTF-8 MAX_JOBS=16
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_EXTENSIONS_DIR=/tmp/torch_ext PATH=/tmp/site/bin:$PATH
log() { echo "=== $(date +%T) $*"; }
COMMON="--renderer triton --graphs on --fast --fold-bn --sessions 1,64 --track-frames 30 --runs 10"
log "A: --fast --fold-bn (+ profile)"
timeout 200 python3 -m foundationpose.bench $COMMON --profile "$OUT/profile.txt" --out "$OUT/a.json" > /dev/null 2> "$OUT/a.log"; echo "rc=$?"
log "B: --fast --fold-bn --compile-track"
timeout 240 python3 -m foundationpose.bench $COMMON --compile-track --out "$OUT/b.json" > /dev/null 2> "$OUT/b.log"; echo "rc=$?"
tail -c 1200 "$OUT/b.log"
python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1]); s = {}
for name in ("a", "b"):
    p = out / f"{name}.json"
    if not p.exists(): s[name] = None; continue
    r = json.loads(p.read_text()); m = r["track_modes"]["graphs_on"]
    s[name] = {"startup_s": r["startup_s"], "register_p50": r["register_sync"]["p50_ms"],
               "register_pipelined_single_p50": r["register_pipelined_single"]["p50_ms"],
               "register_breakdown": r["register_sync_breakdown_ms"], "peak_gpu_mem_gib": r["peak_gpu_mem_gib"],
               "track_sync_p50": m["track_sync"]["p50_ms"], "track_step": m["track_sync_stage_ms"],
               "track_pipelined_single_p50": m["track_pipelined_single"]["p50_ms"], "captured": m["captured"],
               "capture_failures": m["capture_failures"], "sessions": m["track_sessions"],
               "pipelined_track_stage_ms": m["pipelined_track_stage_ms"]}
(out / "summary.json").write_text(json.dumps(s, indent=1)); print(json.dumps(s, indent=1)[:6000])
PY
log "done"
