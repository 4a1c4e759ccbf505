#!/usr/bin/env bash
# GPU validation run used for the figures in README.md (run on the lent H200 through the device tool,
# from the repository root, with the wheels of ../shared/tools/device-wheels.sh in .whl/).
# Usage: bash tools/h200_check.sh [tests] [parity] [engines] [e2e] [demo]   (default: all)
set -uo pipefail
OUT=${OUT:-/tmp/h200_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONIOENCODING=utf-8 LANG=C.UTF-8 MAX_JOBS=16
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_ext}
steps=${*:-tests parity engines e2e server demo}
log() { echo "=== $(date +%T) $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for step in $steps; do
  case $step in
    tests)
      log "CUDA tests"
      PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout 420 python3 -m pytest -q -rs -p no:cacheprovider tests -k "cuda or nvdiffrast or Cuda or triton" 2>&1 | tail -60
      log "server and service tests on the GPU machine (its FastAPI/Starlette versions)"
      PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout 300 python3 -m pytest -q -p no:cacheprovider tests/server tests/foundationpose/test_service.py 2>&1 | tail -8
      log "pipelined == reference on CUDA (tiny config, batched tracks with mixed K, sizes, objects)"
      FP_TEST_DEVICE=cuda PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout 300 python3 -m pytest -q -p no:cacheprovider \
        tests/foundationpose/test_service.py tests/foundationpose/test_service_batching.py 2>&1 | tail -25
      ;;
    filters)
      log "depth filters: torch vs triton"
      timeout 200 python3 -m foundationpose.bench.filters 2>&1 | tail -60
      ;;
    parity)
      log "renderer parity"
      timeout 180 python3 -m foundationpose.bench.render_parity --out "$OUT/parity.json" 2>&1 | tail -40
      ;;
    engines)
      log "network bench"
      for opts in "--precision fp32" "--precision fp16" "--precision fp16 --cast-model --channels-last" \
                  "--precision fp16 --cast-model --channels-last --cuda-graphs" "--precision bf16 --cast-model --channels-last"; do
        timeout 240 python3 -m engines.bench $opts --batch 1,252 --compare-fp32 --iters 20 2>/dev/null \
          | python3 -c 'import json,sys; r=json.load(sys.stdin); print(json.dumps({"opts":sys.argv[1],"precision":r["precision"],"startup_s":r["startup_s"],"rows":[{k:x[k] for k in ("network","batch","p50_ms","p90_ms","tflops","samples_per_s","max_abs_diff_vs_fp32")} for x in r["results"]]}))' "$opts" \
          | tee -a "$OUT/engines.jsonl"
      done
      ;;
    compile)
      log "network bench with torch.compile"
      timeout 500 python3 -m engines.bench --precision fp16 --cast-model --channels-last --compile --batch 1,252 --iters 20 \
        --out "$OUT/engines_compile.json" 2>&1 | tail -5
      ;;
    e2e)
      log "end-to-end bench"
      timeout 500 python3 -m foundationpose.bench --fast --out "$OUT/e2e.json" 2>&1 | grep -v WARNING | tail -150
      ;;
    profile)
      log "per-step profile"
      timeout 300 python3 tools/profile_steps.py --device cuda 2>&1 | grep -v WARNING | head -120
      ;;
    e2e3)
      log "end-to-end bench, 3 register frames in flight"
      timeout 500 python3 -m foundationpose.bench --fast --frames-in-flight 3 --sessions 64 --out "$OUT/e2e3.json" 2>&1 \
        | grep -v WARNING | tail -150
      ;;
    server)
      log "HTTP load test (full config on the GPU, 640x480 frames)"
      timeout 300 python3 tools/loadtest.py --spawn --device cuda --hypotheses 252 --register-iterations 5 \
        --track-iterations 2 --clients 16 --duration-s 60 --max-requests 20000 --tracks-per-register 20 \
        --image 640x480 --ready-timeout-s 180 2>/dev/null | python3 -c "import json,sys; t=sys.stdin.read(); r=json.loads(t[t.index('{'):]); print(json.dumps({k: r[k] for k in ('requests', 'elapsed_s', 'requests_per_s', 'endpoints', 'errors_by_status', 'error_samples', 'server_track_batches', 'server_track_batched_requests') if k in r}))"
      ;;
    demo)
      log "demo"
      timeout 300 python3 -m foundationpose.demo --out "$OUT/demo" --no-video --json 2>&1 | tail -30
      ;;
  esac
done
log done
