#!/usr/bin/env bash
# Issue 10 speed probe on the H200: what folding the batch norms and torch.compile buy the networks, the end-to-end
# figures with both (register p50, lone track, 64 sessions), and a py-spy profile of that run.
# From the repository root with the wheels of ../shared/tools/device-wheels.sh in .whl/ (carry [".whl"]).
# $OUT: nets.json (engines.bench variants), bench.json + bench.log (python -m foundationpose.bench, graphs on,
#       --fast --fold-bn, compile), pyspy.txt.gz (raw folded stacks of the bench process), summary.json.
# Budget: ~8 minutes.
set -uo pipefail
OUT=${OUT:-/tmp/speed_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONIOENCODING=utf-8 LANG=C.UTF-8 MAX_JOBS=16
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_EXTENSIONS_DIR=/tmp/torch_ext PATH=/tmp/site/bin:$PATH
log() { echo "=== $(date +%T) $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

log "networks: eager / fold at 252, graphs (+fold) at 1 and 64 (compile: the bench below)"
N=/tmp/nets; mkdir -p $N
B="python3 -m engines.bench --backend torch --precision fp16 --cast-model --channels-last --iters 30 --warmup 5"
$B --batch 252 --out $N/eager.json > /dev/null 2>> $N/log
$B --batch 252 --fold-bn --compare-fp32 --out $N/fold.json > /dev/null 2>> $N/log
$B --batch 1,64 --cuda-graphs --out $N/graph.json > /dev/null 2>> $N/log
$B --batch 1,64 --cuda-graphs --fold-bn --out $N/fold_graph.json > /dev/null 2>> $N/log
python3 - $N "$OUT" <<'PY'
import json, pathlib, sys
n, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
res = {}
for f in sorted(n.glob("*.json")):
    r = json.loads(f.read_text())
    res[f.stem] = {"startup_s": r["startup_s"], **{f"{row['network']}_b{row['batch']}": row["p50_ms"] for row in r["results"]},
                   **{f"{row['network']}_b{row['batch']}_diff_fp32": row.get("max_abs_diff_vs_fp32") for row in r["results"] if "max_abs_diff_vs_fp32" in row}}
(out / "nets.json").write_text(json.dumps(res, indent=1)); print(json.dumps(res, indent=1))
PY
tail -5 $N/log

log "bench: --fast --fold-bn (compile), triton renderer, graphs on, under py-spy"
timeout 330 py-spy record -r 40 --nonblocking -f raw -o /tmp/pyspy.txt -- \
  python3 -m foundationpose.bench --renderer triton --graphs on --fast --fold-bn \
  --sessions 1,64 --track-frames 30 --runs 10 --out "$OUT/bench.json" > /dev/null 2> "$OUT/bench.log"
echo "rc=$?"; tail -c 1500 "$OUT/bench.log"; gzip -c /tmp/pyspy.txt > "$OUT/pyspy.txt.gz"; ls -la "$OUT"
python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1]); p = out / "bench.json"
if not p.exists(): print("no bench.json"); sys.exit(0)
r = json.loads(p.read_text()); m = r["track_modes"]["graphs_on"]
s = {"startup_s": r["startup_s"], "register_sync": r["register_sync"], "register_breakdown": r["register_sync_breakdown_ms"],
     "register_pipelined_single": r["register_pipelined_single"], "register_throughput_fps": r["register_throughput_fps"],
     "peak_gpu_mem_gib": r["peak_gpu_mem_gib"], "track_sync": m["track_sync"], "track_sync_stage_ms": m["track_sync_stage_ms"],
     "track_pipelined_single": m["track_pipelined_single"], "track_sessions": m["track_sessions"],
     "pipelined_track_stage_ms": m["pipelined_track_stage_ms"], "pipelined_register_gpu_p50_ms": r["pipelined_register_gpu_p50_ms"]}
(out / "summary.json").write_text(json.dumps(s, indent=1)); print(json.dumps(s, indent=1)[:3000])
PY
log "done"
