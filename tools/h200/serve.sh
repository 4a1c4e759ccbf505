#!/usr/bin/env bash
# Ray Serve figures on the lent one-GPU H200 (issue 14): 1 pose replica vs 2 sharing the GPU, and the Serve hop.
# Prepare here:   bash tools/h200/serve_wheels.sh          (fills .whl/: ~54 MiB with the repacked ray wheel; ~59 MiB with the tree)
# Run there:      device tool, carry [".whl"], command:  bash tools/h200/serve.sh
# Results: $OUT/serve_bench.json (the JSON of tools/serve_bench.py), $OUT/serve_bench.log (its stderr).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_EXTENSIONS_DIR=/tmp/torch_ext
export PYTHONUNBUFFERED=1 PYTHONIOENCODING=utf-8 LANG=C.UTF-8 MAX_JOBS=16
OUT=${OUT:-/tmp/serve_out}; mkdir -p "$OUT"
echo "=== $(date +%T) $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader)"
python3 -c "import ray, ray.serve, fastapi, starlette; print('ray', ray.__version__, 'fastapi', fastapi.__version__, 'starlette', starlette.__version__)" || exit 1
# 64 sessions x 20 frames, 32 registers 8 at a time, a lone session's 100 tracks; full algorithm (252 hypotheses, 5 + 2 iterations)
timeout 270 python3 tools/serve_bench.py --device cuda --sessions 64 --frames 20 --registers 32 --register-concurrency 8 \
  --lone-tracks 100 --lone-registers 5 --out "$OUT/serve_bench.json" 2> "$OUT/serve_bench.log" > /dev/null
rc=$?
echo "=== $(date +%T) serve_bench exit $rc"
tail -25 "$OUT/serve_bench.log"
[ -f "$OUT/serve_bench.json" ] && python3 - "$OUT/serve_bench.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
sp = r.get("single_process", {})
print("single-process lone track p50 ms:", sp.get("track", {}).get("p50_ms"), " register p50 ms:", sp.get("register", {}).get("p50_ms"))
for name, s in r.get("serve", {}).items():
    print(name, "lone track p50", s["lone"]["track"].get("p50_ms"), "hop", s.get("serve_hop_ms"),
          "| 64 sessions frames/s", s["sessions"].get("frames_per_s"), "| registers/s", s["registers"].get("registers_per_s"),
          "| register p50", s["registers"]["register"].get("p50_ms"))
print("2 vs 1 replica:", r.get("two_vs_one_replica"))
PY
exit $rc
