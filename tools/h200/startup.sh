#!/usr/bin/env bash
# Issue 10, start-up <= 45 s: the bench's start-up on a fresh machine without and with a compile cache file, one call
# (~4 min). Each run gets an empty inductor cache directory (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR): a new machine.
#   1 cold      no cache file: compiles everything, then writes /tmp/fp_compile.cache (foundationpose.compile_cache)
#   2 with_file the file from run 1 is loaded before the networks compile
# Every speed option (--fast --fold-bn --pad-input --compile-track, triton renderer, graphs on), a small measurement
# after the start-up (1 session, 5 frames, 3 runs). $OUT: cold.json, with_file.json, summary.json (startup_s of both,
# compile_cache of each, register p50 and track p50 to show the loaded kernels run as fast).
set -uo pipefail
OUT=${OUT:-/tmp/startup_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_EXTENSIONS_DIR=/tmp/torch_ext PATH=/tmp/site/bin:$PATH
export PYTHONUNBUFFERED=1 PYTHONIOENCODING=utf-8 LANG=C.UTF-8 MAX_JOBS=16
CACHE=/tmp/fp_compile.cache; rm -f "$CACHE"
for run in cold with_file; do
  echo "=== $(date +%T) $run"
  dir=$(mktemp -d)
  TORCHINDUCTOR_CACHE_DIR=$dir/inductor TRITON_CACHE_DIR=$dir/triton timeout 280 python3 -m foundationpose.bench \
    --renderer triton --graphs on --fast --fold-bn --pad-input --compile-track --sessions 1 --track-frames 5 --runs 3 \
    --warmup 1 --register-frames 2 --compile-cache "$CACHE" --out "$OUT/$run.json" > /dev/null 2> "$OUT/$run.log"
  echo "rc=$? cache file: $(stat -c %s "$CACHE" 2>/dev/null || echo none) bytes"
done
python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1]); summary = {}
for run in ("cold", "with_file"):
    p = out / f"{run}.json"
    if p.exists():
        r = json.loads(p.read_text()); m = r["track_modes"]["graphs_on"]
        summary[run] = {"startup_s": r["startup_s"], "compile_cache": r.get("compile_cache"),
                        "register_p50_ms": r["register_sync"]["p50_ms"], "track_p50_ms": m["track_sync"]["p50_ms"]}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n"); print(json.dumps(summary, indent=1))
PY
