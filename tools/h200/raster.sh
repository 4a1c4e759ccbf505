python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD TORCH_EXTENSIONS_DIR=/tmp/torch_ext || exit 1;
# Triton renderer on the H200 (issue 10, part 1), from the repository root with the wheels of
# ../shared/tools/device-wheels.sh in .whl/ (carry [".whl"]). Writes to $OUT:
#   parity_10k.json  nvdiffrast vs triton, 252 crops of a 10 092-face textured pillow box: render parity,
#                    p50/p90 at batch 252 and 1
#   parity_box.json  the same for the 12-face box
#   graph.json       the same as parity_10k plus a CUDA graph capture of the triton render, replayed on new
#                    poses == eager (caller-stream and side-stream renderers); a separate process, so a crash
#                    in capture cannot take the other reports with it
#   tests.txt        the CUDA tests of tests/foundationpose/test_render_triton.py (compiled kernels vs the CPU twin)
#   summary.json     goals met / missed
# Budget: < 4 minutes (nvdiffrast plugin build ~30 s once, Triton JIT ~10-30 s per process).
set -uo pipefail
OUT=${OUT:-/tmp/raster_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONIOENCODING=utf-8 LANG=C.UTF-8 MAX_JOBS=16
log() { echo "=== $(date +%T) $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'

log "parity + speed: 10k-face textured mesh (builds nvdiffrast, compiles the kernels)"
timeout 150 python3 -m foundationpose.bench.render_parity --backend triton --n 252 --subdivisions 29 \
  --out "$OUT/parity_10k.json" > "$OUT/parity_10k.log" 2>&1; echo "rc=$?"; tail -c 3000 "$OUT/parity_10k.log"

log "parity + speed: 12-face box"
timeout 60 python3 -m foundationpose.bench.render_parity --backend triton --n 252 --subdivisions 1 \
  --out "$OUT/parity_box.json" > "$OUT/parity_box.log" 2>&1; echo "rc=$?"; tail -c 2000 "$OUT/parity_box.log"

log "CUDA graph capture of the triton render (10k-face mesh, 252 crops)"
timeout 60 python3 -m foundationpose.bench.render_parity --backend triton --n 252 --subdivisions 29 --graph \
  --out "$OUT/graph.json" > "$OUT/graph.log" 2>&1; echo "rc=$?"; tail -c 1500 "$OUT/graph.log"

log "CUDA tests of the triton renderer"
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout 90 python3 -m pytest -q -rs -p no:cacheprovider \
  tests/foundationpose/test_render_triton.py -k "cuda" 2>&1 | tail -30 | tee "$OUT/tests.txt"

log "summary"
python3 - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
summary = {}
for name in ("parity_10k", "parity_box", "graph"):
    path = out / f"{name}.json"
    if not path.exists():
        summary[name] = {"error": "no report"}
        continue
    r = json.loads(path.read_text(encoding="utf-8"))
    if "render" not in r:
        summary[name] = r
        continue
    if name == "graph":
        summary[name] = {mode: {k: g.get(k) for k in ("captured", "replay_equals_eager", "equal", "error")}
                         | ({"replay_p50_ms": g["replay_ms"]["p50"]} if "replay_ms" in g else {})
                         for mode, g in r.get("graph", {}).items()}
        continue
    m, t = r["render"], r["timing_ms"]
    row = {
        "faces": r["faces"],
        "mask_iou": m["mask"]["iou"], "mask_iou_ok": m["mask"]["iou"] >= 0.999,
        "worst_crop_iou": m["mask"]["min_iou_per_crop"], "worst_crop_ok": m["mask"]["min_iou_per_crop"] >= 0.995,
        "xyz_mean_abs_m": m["xyz_m"]["mean"], "xyz_ok": m["xyz_m"]["mean"] <= 1e-6,
        "rgb_mean_abs": m["rgb"]["mean"], "rgb_ok": m["rgb"]["mean"] <= 1e-3,
        "background_zero": m["background_zero"],
    }
    for label, v in t.items():
        row[f"{label}_p50_ms"] = {"nvdiffrast": v["nvdiffrast"]["p50"], "triton": v["triton"]["p50"]}
        row[f"{label}_speed_ok"] = v["triton"]["p50"] <= v["nvdiffrast"]["p50"]
    summary[name] = row
text = json.dumps(summary, indent=1)
(out / "summary.json").write_text(text, encoding="utf-8")
print(text)
EOF
log "done"
