#!/usr/bin/env bash
# Issue 10, same-call A/B of the host-side track options (host timings vary up to 2x between machines, so only
# same-call comparisons count): the end-to-end bench with every speed option, once per variant below, 1 and 64
# sessions, graphs on. Each row of bench JSON `track_modes.graphs_on.track_sessions` has frames/s, p50/p90/p99,
# GPU-busy fraction, inline_fraction, batches and mean_batch; `peak_gpu_mem_gib` has the register memory.
#   bash tools/h200/track_ab.sh                      (~1.6 min per variant; default 4 variants)
#   VARIANTS="base mb64" bash tools/h200/track_ab.sh
#   TIMEOUT=300 VARIANTS=autotune bash tools/h200/track_ab.sh    (per-variant limit, default 150 s; autotuning compiles longer)
# Variants: base (defaults: a track into an idle lane runs inline, max batch 32, the fused network-input kernel,
# every padded batch size captured before the sessions), noinline (--no-track-inline: the
# lone track through the batcher and both stage threads, as before), mb64 / mb16 (--track-max-batch 64 / 16: one batch
# of 64, or four of 16 that alternate, so the host work of one overlaps the GPU work of another), nostage (--no-stage-in-caller: the
# lane stacks whole batches, as before each request pinned its own images by default), nodriver (--no-driver-launch:
# the staged batches go to the GPU by PyTorch calls, not the driver calls that keep the GIL), stepbatcher
# (--step-in-batcher: the lane's step runs in the batcher's thread, one hand-off fewer per batch; the default since
# session 9), nosib (--no-step-in-batcher: a stage thread of its own, as before), locked
# (--page-locked-frames: the sessions' frames in page-locked memory, no staging copy per request), locked_switch (with
# a 0.5 ms switch interval), locked_sib_switch (and the step in the batcher's thread), locked_sib_switch_fl2 (and 2
# track batches in flight instead of 3: fewer, larger batches), torchin (--network-input-impl torch: the eager network-input ops
# instead of the fused kernel; tools/h200/fuse.sh checks their bit equality on the GPU), cudnn (--cudnn-benchmark: cuDNN times its algorithms
# per shape, e.g. for the first 7x7 conv that runs an sm80 fallback kernel in the register; register p50 is the figure),
# switch (--switch-interval-ms 0.5: the GIL changes hands 10x as often as Python's 5 ms default, for 64 session threads),
# cstep (--compile-track-step: the captured step's pose update and crop windows compiled, fewer graph nodes),
# autotune (--compile-mode max-autotune-no-cudagraphs: inductor autotunes the register refiner's and scorer's convs
# and matmuls; register p50 and start-up are the figures), fl6 (--track-batches-in-flight 6 instead of 3),
# regoff (--register-graphs off: registers iteration by iteration, as before the captured register; against base
# the register p50, throughput and peak memory),
# stage_rowloop (the staged default with the lane copying the per-frame images in with one copy_ per row,
# track_graph._copy_rows_reference, instead of one foreach copy: against `stage`, the GIL retakes it saves; with
# --no-stage-in-caller the lane stacks whole batches and neither copy runs).
# $OUT: <variant>.json + <variant>.log per variant, summary.json (the figures side by side).
set -uo pipefail
OUT=${OUT:-/tmp/track_ab_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONIOENCODING=utf-8 LANG=C.UTF-8 MAX_JOBS=16
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_EXTENSIONS_DIR=/tmp/torch_ext PATH=/tmp/site/bin:$PATH
VARIANTS=${VARIANTS:-"base noinline mb64 nostage"}
COMMON="--renderer triton --graphs on --fast --fold-bn --pad-input --compile-track --sessions 1,64 --track-frames 30 --runs 10"
log() { echo "=== $(date +%T) $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for v in $VARIANTS; do
  bench=(python3 -m foundationpose.bench)
  case "$v" in
    base) extra="" ;;
    noinline) extra="--no-track-inline" ;;
    mb64) extra="--track-max-batch 64" ;;
    mb16) extra="--track-max-batch 16" ;;
    nostage) extra="--no-stage-in-caller" ;;
    nodriver) extra="--no-driver-launch" ;;
    stepbatcher) extra="--step-in-batcher" ;;
    nosib) extra="--no-step-in-batcher" ;;
    locked) extra="--page-locked-frames" ;;
    locked_switch) extra="--page-locked-frames --switch-interval-ms 0.5" ;;
    locked_sib_switch) extra="--page-locked-frames --step-in-batcher --switch-interval-ms 0.5" ;;
    locked_sib_switch_fl2) extra="--page-locked-frames --step-in-batcher --switch-interval-ms 0.5 --track-batches-in-flight 2" ;;
    torchin) extra="--network-input-impl torch" ;;
    cudnn) extra="--cudnn-benchmark" ;;
    switch) extra="--switch-interval-ms 0.5" ;;
    cstep) extra="--compile-track-step" ;;
    autotune) extra="--compile-mode max-autotune-no-cudagraphs" ;;
    fl6) extra="--track-batches-in-flight 6" ;;
    regoff) extra="--register-graphs off" ;;
    stage_rowloop) extra="--no-driver-launch"; bench=(python3 -c 'import sys, foundationpose.track_graph as t; t._copy_rows = t._copy_rows_reference
from foundationpose.bench.e2e import main; sys.exit(main(sys.argv[1:]))') ;;
    *) echo "unknown variant $v" >&2; continue ;;
  esac
  log "variant $v: $extra"
  timeout ${TIMEOUT:-150} "${bench[@]}" $COMMON $extra --out "$OUT/$v.json" > /dev/null 2> "$OUT/$v.log"
  echo "rc=$?"
done
python3 - "$OUT" $VARIANTS <<'PY'
import json, pathlib, sys
out, variants = pathlib.Path(sys.argv[1]), sys.argv[2:]
summary = {}
for v in variants:
    p = out / f"{v}.json"
    if not p.exists():
        summary[v] = None
        continue
    r = json.loads(p.read_text())
    m = r["track_modes"]["graphs_on"]
    summary[v] = {"track_sync_p50_ms": m["track_sync"]["p50_ms"], "track_pipelined_single_p50_ms": m["track_pipelined_single"]["p50_ms"],
                  "sessions": m["track_sessions"], "step_by_batch": m.get("track_step_by_batch"),
                  "register_sync_p50_ms": r["register_sync"]["p50_ms"],
                  "register_pipelined_single_p50_ms": r["register_pipelined_single"]["p50_ms"],
                  "register_throughput_fps": r["register_throughput_fps"], "peak_gpu_mem_gib": r["peak_gpu_mem_gib"],
                  "startup_s": r["startup_s"], "register_path": r["settings"].get("register_path"), "register_step": r.get("register_step"),
                  "agreement": r.get("pipelined_vs_sync")}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps(summary, indent=1))
PY
