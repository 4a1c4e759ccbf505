#!/usr/bin/env bash
# CUDA check of the `rules` branch (issue 9 steps 2, 7, 8): one back-projection, owned constant memos,
# the depth-filter switch through EstimatorConfig, the render/crop twins. Run from the repo root on a fresh
# H200 with the wheels of ../shared/tools/device-wheels.sh in .whl/. Under 5 minutes.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD TORCH_EXTENSIONS_DIR=/tmp/torch_ext || exit 1;
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONIOENCODING=utf-8 LANG=C.UTF-8 MAX_JOBS=16 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
OUT=${OUT:-/tmp/rules_out}; mkdir -p "$OUT"
echo "=== $(date +%T) CUDA parametrisations of the touched modules (crop, backprojection, filters, render)"
timeout 150 python3 -m pytest -q -rs -p no:cacheprovider --junitxml="$OUT/cuda_units.xml" \
  tests/foundationpose/test_crop.py tests/foundationpose/test_depth_filters.py \
  tests/foundationpose/test_depth_filters_triton.py tests/foundationpose/test_render_projection.py \
  tests/foundationpose/test_render_nvdiffrast.py 2>&1 | tail -15
echo "=== $(date +%T) pipelined == reference on CUDA (estimator-owned constants, Triton filters via the config)"
FP_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider --junitxml="$OUT/cuda_service.xml" \
  tests/foundationpose/test_service.py tests/foundationpose/test_service_batching.py \
  tests/foundationpose/test_estimator.py 2>&1 | tail -10
echo "=== $(date +%T) steady state: no memo misses after warm-up; Triton picked by 'auto' on CUDA"
timeout 60 python3 - <<'PY' 2>&1 | tee "$OUT/steady_state.json"
import json
from foundationpose.demo.dataset import BUNDLED_SEQUENCE_DIR, RecordedSequence
from foundationpose.estimator import EstimatorConfig, PoseEstimator
from foundationpose.sampling import depth_filters
est = PoseEstimator.create(device="cuda", renderer="auto", config=EstimatorConfig(num_hypotheses=16, register_iterations=1))
kernels = depth_filters._triton_filters()
calls = []
real = kernels.erode_depth_triton
kernels.erode_depth_triton = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
seq = RecordedSequence(BUNDLED_SEQUENCE_DIR)
obj, f = est.load_object(seq.mesh_path), seq[0]
est.register(obj, f.rgb, f.depth, f.mask, seq.K)
first = (len(est.constants.shapes), len(est.constants.intrinsics), len(est.renderer.constants.intrinsics))
est.register(obj, f.rgb, f.depth, f.mask, seq.K)
second = (len(est.constants.shapes), len(est.constants.intrinsics), len(est.renderer.constants.intrinsics))
print(json.dumps({"memo_sizes_after_first": first, "memo_sizes_after_second": second, "erode_triton_calls": len(calls)}))
PY
echo "=== $(date +%T) done"
