#!/usr/bin/env bash
# Train the refiner + scorer from random init for TWO objects on one H200 (in parallel), evaluate both, and
# write the figures to $OUT (7 files, no weights). One device call, about 9 minutes with the default budget.
#   bash tools/h200/train.sh [MINUTES]     training minutes per object (default 6; both run at the same time)
#   bash tools/h200/train.sh smoke         0.4 min each, 10 views: checks the whole path in ~3 minutes
# Objects: the bundled demo object (L block, foundationpose/data/demo_sequence) and the procedural "tee"
# (tools/make_demo_sequence.py --shape tee writes its mesh and a 40-frame sequence with ground truth).
# $OUT: results.json (training summaries + both evaluations), loss_L.png, loss_tee.png, 4 overlay PNGs.
set -uo pipefail
OUT=${OUT:-/tmp/h200_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONIOENCODING=utf-8 LANG=C.UTF-8 MAX_JOBS=16
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_EXTENSIONS_DIR=/tmp/torch_ext
MIN=${1:-6}; VIEWS=100
if [ "$MIN" = smoke ]; then MIN=0.4; VIEWS=10; fi
W=/tmp/fp_train; rm -rf "$W"; mkdir -p "$W"
log() { echo "=== $(date +%T) $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

log "nvdiffrast plugin build (once; both trainers load it) + the tee mesh"
python3 - <<PY || exit 1
import sys
from pathlib import Path
sys.path.insert(0, "tools")
from make_demo_sequence import _write_mesh
from foundationpose.render import make_renderer
make_renderer("nvdiffrast", "cuda")
print("tee mesh:", _write_mesh(Path("$W/tee_mesh"), "tee"))
PY
log "tee sequence (CPU, in the background)"
OMP_NUM_THREADS=4 python3 tools/make_demo_sequence.py --out "$W/seq_tee" --shape tee --frames 40 > "$W/seq_tee.log" 2>&1 &
SEQ=$!

log "training both objects in parallel, $MIN min each"
OMP_NUM_THREADS=4 python3 -m foundationpose.train --mesh foundationpose/data/demo_sequence/mesh/textured_simple.obj \
  --out "$W/w_L" --minutes "$MIN" --no-progress > "$W/train_L.log" 2>&1 &
TL=$!
OMP_NUM_THREADS=4 python3 -m foundationpose.train --mesh "$W/tee_mesh/textured_simple.obj" --seed 1 \
  --out "$W/w_tee" --minutes "$MIN" --no-progress > "$W/train_tee.log" 2>&1 &
TT=$!
while kill -0 $TL 2>/dev/null || kill -0 $TT 2>/dev/null; do
  sleep 30; log "progress"; for f in "$W"/w_*/train_log.jsonl; do [ -f "$f" ] && echo "$f: $(tail -1 "$f" | cut -c1-400)"; done
done
wait $TL; RL=$?; wait $TT; RT=$?; wait $SEQ
log "training exit codes L=$RL tee=$RT"; tail -3 "$W/train_L.log" "$W/train_tee.log" | cut -c1-600; tail -2 "$W/seq_tee.log"

log "evaluating both (register + track the sequence, $VIEWS held-out synthetic views)"
python3 -m foundationpose.evaluate --weights "$W/w_L" --out "$W/ev_L" --views $VIEWS --no-progress > "$W/ev_L.stdout" 2> "$W/ev_L.stderr" &
EL=$!
python3 -m foundationpose.evaluate --weights "$W/w_tee" --data "$W/seq_tee" --out "$W/ev_tee" --views $VIEWS \
  --no-progress > "$W/ev_tee.stdout" 2> "$W/ev_tee.stderr" &
ET=$!
wait $EL; wait $ET
tail -3 "$W/ev_L.stderr" "$W/ev_tee.stderr"

python3 - <<PY
import json, pathlib, shutil
W, OUT = pathlib.Path("$W"), pathlib.Path("$OUT")
def load(p):
    p = W / p
    return json.loads(p.read_text()) if p.is_file() else None
res = {"train_minutes_each": float("$MIN"), "views": $VIEWS}
for name in ("L", "tee"):
    summary = load(f"w_{name}/train_summary.json")
    if summary:
        summary.pop("config", None)
    ev = load(f"ev_{name}/eval.json")
    res[name] = {"train": summary, "eval": ev}
    if ev:  # the headline numbers the issue asks for
        seq, views = ev.get("sequence", {}), ev.get("views", {})
        d = ev["object"]["diameter_m"]
        res[name]["figures"] = {
            "register_first_frame_add_diameters": seq.get("register", {}).get("add_m", float("nan")) / d,
            "views_register_success_rate": views.get("register_success_rate"),
            "track_mean_adds_mm": 1000 * seq.get("adds_m", {}).get("mean", float("nan")),
            "track_worst_add_diameters": seq.get("worst_add_diameters"),
            "samples_per_s_last": (summary or {}).get("last", {}).get("samples_per_s"),
            "peak_mem_gib": (summary or {}).get("peak_mem_gib"),
        }
    src = W / f"w_{name}/loss_curve.png"
    if src.is_file():
        shutil.copy(src, OUT / f"loss_{name}.png")
(OUT / "results.json").write_text(json.dumps(res, indent=1) + "\n")
print(json.dumps({k: v.get("figures") for k, v in res.items() if isinstance(v, dict)}, indent=1))
for src, dst in (("ev_L/sequence/000000.png", "overlay_L_000000.png"), ("ev_L/sequence/000039.png", "overlay_L_000039.png"),
                 ("ev_tee/sequence/000020.png", "overlay_tee_000020.png"), ("ev_L/views/view_000.png", "overlay_L_view000.png")):
    if (W / src).is_file():
        shutil.copy(W / src, OUT / dst)
PY
ls -la "$OUT"
