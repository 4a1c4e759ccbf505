#!/usr/bin/env bash
# The server's background track-step preparation on the H200 (< 3 minutes), from the repository root with the wheels
# of ../shared/tools/device-wheels.sh in .whl/ (carry [".whl"]). Writes $OUT/prep.json and $OUT/prep.log.
# For each mode (--no-prepare-track, then --prepare-track; same estimator, a fresh app and service each): one
# register of a new object at 480x640, then a burst of SESSIONS threads x FRAMES stateless tracks of it (the
# batcher groups them into batches of every padded size). Per mode: register_ms, prepare_wait_ms (register answer
# -> preparer idle), captures after the register / after the preparation / after the burst, the burst's latency
# percentiles and its first wave's max, fp_track_prepares_total. Expect: "on" captures 5 steps (batch sizes
# 1, 2, 4, 8, 16) before the burst and none during it; "off" captures during the burst, in the requests' path.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_EXTENSIONS_DIR=/tmp/torch_ext
export PYTHONUNBUFFERED=1 PYTHONIOENCODING=utf-8 LANG=C.UTF-8 MAX_JOBS=16
OUT=${OUT:-/tmp/prep_out}; mkdir -p "$OUT"
echo "=== $(date +%T) $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader)"
SESSIONS=${SESSIONS:-16} FRAMES=${FRAMES:-20} timeout 240 python3 - "$OUT/prep.json" > "$OUT/prep.log" 2>&1 <<'PY'
import json, logging, os, re, sys, tempfile, threading, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from fastapi.testclient import TestClient

from foundationpose.estimator import PoseEstimator
from foundationpose.synthetic.meshes import make_procedural_mesh
from foundationpose.synthetic.scenes import synthetic_frame
from server import ServerConfig, codecs, create_app

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
sessions, frames = int(os.environ["SESSIONS"]), int(os.environ["FRAMES"])
est = PoseEstimator.create(device="cuda", weights=None, renderer="auto")
frame = synthetic_frame(480, 640, seed=1)
rgb, depth, mask = codecs.encode_rgb_png(frame.rgb), codecs.encode_depth_png_mm(frame.depth_m), codecs.encode_mask_png(frame.mask)
K = json.dumps(frame.K.tolist())


def metric(client, name, labels=""):
    m = re.search(rf"^{name}{re.escape(labels)} (\S+)$", client.get("/metrics").text, re.MULTILINE)
    return None if m is None else float(m.group(1))


def pct(ms):
    a = np.asarray(ms)
    return {"n": len(a), "p50_ms": round(float(np.percentile(a, 50)), 2), "p90_ms": round(float(np.percentile(a, 90)), 2),
            "p99_ms": round(float(np.percentile(a, 99)), 2), "max_ms": round(float(a.max()), 2)}


def run(mode: bool) -> dict:
    root = Path(tempfile.mkdtemp())
    make_procedural_mesh("vertex_color_asym").export(root / "obj.ply")
    config = ServerConfig.from_settings(objects_dir=root, device="cuda", max_image_hw=(480, 640), track_max_batch=16,
                                        prepare_track=mode, track_capacity=1024, track_latency_budget_s=0)
    app = create_app(config, estimator=est)
    out = {"prepare_track": mode}
    with TestClient(app) as client:
        state = app.state.fp
        assert state.wait_ready(600), state.failure
        out["captures_after_warmup"] = state.service.stats().track_captures
        t0 = time.perf_counter()
        r = client.post("/register", data={"object_id": "obj", "K": K},
                        files={"rgb": ("rgb.png", rgb), "depth": ("depth.png", depth), "mask": ("mask.png", mask)})
        assert r.status_code == 200, r.text
        out["register_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
        out["captures_after_register"] = state.service.stats().track_captures
        pose = json.dumps(r.json()["pose"])
        t0 = time.perf_counter()
        if state.track_preparer is not None:
            assert state.track_preparer.wait_idle(120)
        out["prepare_wait_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
        out["captures_after_prepare"] = state.service.stats().track_captures
        start = threading.Barrier(sessions)

        def client_loop(_):
            start.wait()
            times = []
            for _ in range(frames):
                t = time.perf_counter()
                resp = client.post("/track", data={"object_id": "obj", "pose": pose, "K": K},
                                   files={"rgb": ("rgb.png", rgb), "depth": ("depth.png", depth)})
                times.append((time.perf_counter() - t) * 1e3 if resp.status_code == 200 else float("nan"))
            return times

        with ThreadPoolExecutor(sessions) as pool:
            per_client = list(pool.map(client_loop, range(sessions)))
        ok = [t for ts in per_client for t in ts if t == t]
        out["burst"] = pct(ok)
        out["burst"]["errors"] = sum(t != t for ts in per_client for t in ts)
        out["first_wave_max_ms"] = round(max(ts[0] for ts in per_client if ts[0] == ts[0]), 2)
        out["captures_after_burst"] = state.service.stats().track_captures
        out["prepares_ok"] = metric(client, "fp_track_prepares_total", '{outcome="ok"}')
        out["prepares_failed"] = metric(client, "fp_track_prepares_total", '{outcome="failed"}')
        out["graph_captures_metric"] = metric(client, "fp_track_graph_captures_total")
    print(json.dumps(out), file=sys.stderr)
    return out


result = {"sessions": sessions, "frames": frames, "runs": [run(False), run(True)]}
json.dump(result, open(sys.argv[1], "w", encoding="utf-8"), indent=1)
print(json.dumps(result, indent=1))
PY
rc=$?
echo "=== $(date +%T) exit $rc"
tail -30 "$OUT/prep.log"
exit $rc
