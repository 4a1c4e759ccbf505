#!/usr/bin/env bash
# One call for the closing figures of issues 10 and 11: tools/h200/edge.sh (the service edge, ~4 min; server
# args from $EDGE_SERVER_ARGS, default "--renderer triton --fast"), then the
# end-to-end bench with every opt-in speed option (--fast --fold-bn --pad-input --compile-track, triton renderer,
# captured track steps, 1 and 64 sessions) with its torch.profiler tables (~1.5 min).
# Wheels: ../shared/tools/device-wheels.sh py-spy==0.4.3 websockets==15.0.1 uvloop==0.21.0 httptools==0.6.4 \
#   fastapi-offline==1.7.7 imagecodecs==2026.3.6 orjson==3.10.18   (carry [".whl"])
# $OUT (8 files): edge_table.json, edge_summary.json, bench_decode.json, pyspy_top.txt, extra.tgz (pyspy_raw.txt,
#   client_track.json, server_log.txt), bench.json, bench.log, profile.txt.
set -uo pipefail
OUT=${OUT:-/tmp/final_out}; mkdir -p "$OUT"; export OUT
EDGE_SERVER_ARGS="${EDGE_SERVER_ARGS:---renderer triton --fast}" bash tools/h200/edge.sh
echo "edge rc=$?"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD TORCH_EXTENSIONS_DIR=/tmp/torch_ext PYTHONUNBUFFERED=1
echo "=== $(date +%T) bench, every speed option"
timeout 200 python3 -m foundationpose.bench --renderer triton --graphs on --fast --fold-bn --pad-input --compile-track \
  --sessions 1,64 --track-frames 30 --runs 10 --profile "$OUT/profile.txt" --out "$OUT/bench.json" > /dev/null 2> "$OUT/bench.log"
echo "bench rc=$?"
(cd "$OUT" && tar czf extra.tgz $(ls pyspy_raw.txt client_track.json server_log.txt 2>/dev/null) && rm -f pyspy_raw.txt client_track.json server_log.txt)
python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for name in ("edge_table.json",):
    p = out / name
    print(p.read_text()[:5000] if p.exists() else f"no {name}")
p = out / "bench.json"
if p.exists():
    r = json.loads(p.read_text()); m = r["track_modes"]["graphs_on"]
    print(json.dumps({"startup_s": r["startup_s"], "register_sync": r["register_sync"], "register_breakdown": r["register_sync_breakdown_ms"],
                      "register_pipelined_single": r["register_pipelined_single"], "register_throughput_fps": r["register_throughput_fps"],
                      "peak_gpu_mem_gib": r["peak_gpu_mem_gib"], "track_sync": m["track_sync"], "track_step": m["track_sync_stage_ms"],
                      "track_pipelined_single": m["track_pipelined_single"], "sessions": m["track_sessions"],
                      "step_by_batch": m.get("track_step_by_batch")}, indent=1))
PY
ls -la "$OUT"
