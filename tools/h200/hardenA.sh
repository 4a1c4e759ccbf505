#!/usr/bin/env bash
# hardenA on the H200: the service tests on CUDA (pipelined == reference, iterations= on the service,
# requests validated once, masked-depth count on the device). Run from the repo root; < 5 minutes.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD TORCH_EXTENSIONS_DIR=/tmp/torch_ext || exit 1;
export PYTHONUNBUFFERED=1 PYTHONIOENCODING=utf-8 LANG=C.UTF-8 MAX_JOBS=16
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
FP_TEST_DEVICE=cuda timeout 270 python3 -m pytest -q -x -p no:cacheprovider \
    tests/foundationpose/test_service.py tests/foundationpose/test_service_batching.py \
    --junitxml="$OUT/hardenA_junit.xml" 2>&1 | tail -40 | tee "$OUT/hardenA.txt"
python3 - "$OUT" <<'PY'
import json, sys, xml.etree.ElementTree as ET
root = ET.parse(f"{sys.argv[1]}/hardenA_junit.xml").getroot()
suite = root if root.tag == "testsuite" else root[0]
summary = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
summary["failed"] = [c.get("name") for c in suite.iter("testcase") if c.find("failure") is not None or c.find("error") is not None]
json.dump(summary, open(f"{sys.argv[1]}/hardenA.json", "w"), indent=1)
print(json.dumps(summary))
PY
