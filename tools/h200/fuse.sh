#!/usr/bin/env bash
# Issue 10: the fused Triton network-input kernel (foundationpose/_network_inputs_triton.py) against its eager twin
# on the H200, from the repository root with the wheels of ../shared/tools/device-wheels.sh in .whl/ (carry
# [".whl"]). No nvdiffrast: the triton renderer. Writes to $OUT:
#   tests.txt    tests/foundationpose/test_network_inputs_triton.py: interpreter tests (CPU), the sm_90 PTX check,
#                and the CUDA ones: bit-identical at N = 1, 64, 252 (S = 160), captured in a CUDA graph
#   probe.json   tools/network_inputs_probe.py: bit equality on random and on real renders/warps (refiner and
#                scorer, N = 1, 64, 252); CUDA-event p50 of assemble_pair_inputs per impl at N = 252 and 1,
#                and of the two kernel launches alone (triton/kernel);
#                register p50/p90 per impl (fp16 channels-last, --fold-bn, no torch.compile; interleaved runs)
#   profile.txt  torch.profiler of one build_refiner_inputs at N = 252 per impl (by input shape, top 20 by CUDA)
#   probe.log    its stderr
#   graphs.txt   CUDA tests of foundationpose/track_graph.py (the kernel now runs inside the captured track step):
#                replay == eager step bit for bit, == the step-by-step path within the fp16 tolerance (last; 80 s cap)
# Budget: < 3.5 minutes (renderer and kernel JIT ~20-40 s, estimator start-up, 2 x 17 registers; graphs.txt last).
set -uo pipefail
OUT=${OUT:-/tmp/fuse_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONIOENCODING=utf-8 LANG=C.UTF-8 MAX_JOBS=16
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_EXTENSIONS_DIR=/tmp/torch_ext PATH=/tmp/site/bin:$PATH
log() { echo "=== $(date +%T) $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'

log "tests (interpreter, PTX, CUDA)"
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout 100 python3 -m pytest -q -rs -p no:cacheprovider \
  tests/foundationpose/test_network_inputs_triton.py 2>&1 | tail -30 | tee "$OUT/tests.txt"

log "probe: equality, timing, register A/B, profile"
timeout 150 python3 tools/network_inputs_probe.py --out "$OUT" --runs 15 --fold-bn > /dev/null 2> "$OUT/probe.log"
echo "rc=$?"; tail -c 1500 "$OUT/probe.log"

log "summary"
python3 - "$OUT" <<'PY'
import json, pathlib, sys
path = pathlib.Path(sys.argv[1]) / "probe.json"
if not path.exists():
    print("no probe.json"); sys.exit(0)
r = json.loads(path.read_text(encoding="utf-8"))
reg = r["register"]
print(json.dumps({
    "bit_identical": r["bit_identical"],
    "assemble_gpu_p50_ms": {n: {i: v["gpu_p50_ms"] for i, v in t.items()} for n, t in r["assemble_pair_inputs_timing"].items()},
    "assemble_host_p50_ms": {n: {i: v["host_p50_ms"] for i, v in t.items()} for n, t in r["assemble_pair_inputs_timing"].items()},
    "register_p50_ms": {"torch": reg["torch"]["p50_ms"], "triton": reg["triton"]["p50_ms"], "saving": reg["p50_saving_ms"]},
    "register_pose_max_abs_diff": reg["pose_max_abs_diff"],
}, indent=1))
PY
log "head of the profile"; head -c 6000 "$OUT/profile.txt" 2>/dev/null

log "track-graph CUDA tests (the kernel inside the captured step)"
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout 80 python3 -m pytest -q -rs -p no:cacheprovider \
  tests/foundationpose/test_track_graph.py -k "cuda" 2>&1 | tail -20 | tee "$OUT/graphs.txt"
log "done"
