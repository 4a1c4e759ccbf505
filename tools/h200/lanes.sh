python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD TORCH_EXTENSIONS_DIR=/tmp/torch_ext || exit 1;
# Lease-reuse ordering (issue 9 step 4) and the lane changes of branch `lanes`, on the H200.
# Run from the repo root with the wheels of /work/shared/tools/device-wheels.sh carried in .whl/.
# Writes $OUT/lanes.json (pass/fail/skip per test) and the pytest logs. About 3-4 minutes.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONIOENCODING=utf-8 LANG=C.UTF-8 MAX_JOBS=16
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# 1. the CUDA lease tests (real streams/events): must pass, none skipped
timeout 240 python3 -m pytest -q -rs -p no:cacheprovider --junitxml="$OUT/lease.xml" \
  tests/deploy_core/test_pipeline_streams.py tests/deploy_core/test_mempool.py \
  tests/foundationpose/test_service_lease_cuda.py 2>&1 | tail -25 | tee "$OUT/lease.txt"
# 2. the lanes on CUDA: per-item track failures, deadlines, pipelined == reference (fp16 tolerance)
FP_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -rs -x -p no:cacheprovider --junitxml="$OUT/lanes.xml" \
  tests/foundationpose/test_service_faults.py tests/foundationpose/test_service.py 2>&1 | tail -25 | tee "$OUT/lanes.txt"
# 3. depth filters / back-projection with the owner's constants memo on CUDA (Triton and torch paths)
FP_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -rs -p no:cacheprovider --junitxml="$OUT/filters.xml" \
  tests/foundationpose/test_depth_filters.py tests/foundationpose/test_depth_filters_triton.py \
  tests/foundationpose/test_no_host_sync.py 2>&1 | tail -25 | tee "$OUT/filters.txt"
python3 - "$OUT" <<'PY'
import json, sys, xml.etree.ElementTree as ET
out = sys.argv[1]; report = {}
for name in ("lease", "lanes", "filters"):
    try:
        root = ET.parse(f"{out}/{name}.xml").getroot()
    except Exception as exc:  # pytest died before writing it
        report[name] = {"error": repr(exc)}; continue
    cases = {}
    for case in root.iter("testcase"):
        state = "failed" if case.find("failure") is not None or case.find("error") is not None else \
            "skipped" if case.find("skipped") is not None else "passed"
        cases[f"{case.get('classname')}.{case.get('name')}"] = state
    report[name] = {"passed": sum(v == "passed" for v in cases.values()),
                    "failed": sorted(k for k, v in cases.items() if v == "failed"),
                    "skipped": sorted(k for k, v in cases.items() if v == "skipped")}
json.dump(report, open(f"{out}/lanes.json", "w"), indent=1); print(json.dumps(report, indent=1))
PY
