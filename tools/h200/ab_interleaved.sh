#!/usr/bin/env bash
# Issue 11: a same-call A/B of this tree against another (BASE, e.g. `git archive <commit> | tar -x -C out/ab_base`,
# carried), interleaved A B A B so that a host that drifts during the call (lone-client phases moved 2-4x within
# 8 minutes in session 10) weighs on both alike. Per round and tree: tools/h200/ingest.sh (VARIANTS, MODES,
# ONE_STREAM as there); after the first round, tools/hub_cost.py in each tree (the GPU process's event-loop CPU per
# ingest request, 64 sessions; the tool and the tools it imports are copied into BASE when it lacks it).
#   BASE=out/ab_base ROUNDS=2 VARIANTS=ingest8 MODES=http-binary ONE_STREAM=1 bash tools/h200/ab_interleaved.sh
# Wheels as for ingest.sh (+ orjson==3.10.18), carried as .whl; BASE gets a link to them.
# $OUT/ab.tar.gz: <tree><round>/ (ingest.sh's outputs) and hubcost_<tree>.json; $OUT/summary.txt.
set -uo pipefail
OUT=${OUT:-/tmp/ab_out}; mkdir -p "$OUT"
BASE=${BASE:-out/ab_base}; ROUNDS=${ROUNDS:-2}; HUB_SESSIONS=${HUB_SESSIONS:-64}; HUB_SECONDS=${HUB_SECONDS:-8}
HUB_ARGS=${HUB_ARGS:---reduced-step}  # poses stay put: random weights would drift sessions out of range (422s)
TREES=${TREES:-"new base"}; HUB_TREES=${HUB_TREES:-$TREES}  # where ingest.sh / hub_cost run
WORK=/tmp/ab_work; mkdir -p "$WORK"
HERE=$PWD
[ -e "$BASE/.whl" ] || ln -sfn "$HERE/.whl" "$BASE/.whl"
[ -e "$BASE/tools/hub_cost.py" ] || cp tools/hub_cost.py tools/track_host_ceiling.py tools/proc_cpu.py "$BASE/tools/"
summary() {
  python3 - "$WORK" <<'PY' | tee "$OUT/summary.txt"
import json, pathlib, sys
root = pathlib.Path(sys.argv[1])
for d in sorted(p for p in root.iterdir() if p.is_dir()):
    f = d / "ingest.json"
    if f.exists():
        for variant, runs in json.load(open(f)).items():
            for run, r in runs.items():
                ph = r.get("phases") or {}
                print(f"{d.name:6} {variant:10} {run:16} tracks/s {r['tracks_per_s']:7} regs/s {r['registers_per_s']:5} "
                      f"p50 {r['p50_ms']} p90 {r['p90_ms']} p99 {r['p99_ms']} errors {r['errors']} "
                      f"receive {ph.get('receive')} parse {ph.get('parse')} decode {ph.get('decode')}")
for f in sorted(root.glob("hubcost_*.json")):
    try:
        r = json.load(open(f))
        print(f.name, "tracks/s", r.get("tracks_per_s"), "loop us/request", r.get("loop_us_per_request"),
              "latency", r.get("latency_ms"), "others", r.get("other_threads_us_per_request"), r.get("error", ""))
    except ValueError:
        print(f.name, "unreadable")
PY
  tar -czf "$OUT/ab.tar.gz" -C "$WORK" . 2>/dev/null
}
trap summary EXIT
hub_cost() {  # hub_cost TREE NAME
  (cd "$1" && PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TORCH_EXTENSIONS_DIR=/tmp/torch_ext \
     timeout 150 python3 tools/hub_cost.py --device cuda --image 640x480 --sessions "$HUB_SESSIONS" \
     --seconds "$HUB_SECONDS" $HUB_ARGS > "$WORK/hubcost_$2.json" 2> "$WORK/hubcost_$2.err")
  tail -c 600 "$WORK/hubcost_$2.json"
}
for r in $(seq 1 "$ROUNDS"); do
  for tree in $TREES; do
    dir=$HERE; [ $tree = base ] && dir=$BASE
    echo "=== $(date +%T) round $r: $tree ($dir)"
    (cd "$dir" && OUT="$WORK/$tree$r" bash tools/h200/ingest.sh 2>&1 | grep -E "^(===|ingest|main|parity|cpu:|gpu)" )
  done
  if [ "$r" = 1 ]; then for tree in $HUB_TREES; do [ $tree = new ] && hub_cost "$HERE" new || hub_cost "$BASE" base; done; fi
done
