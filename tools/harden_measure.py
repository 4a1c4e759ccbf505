"""Re-measure the issue-12 hardening on this machine (CPU by default); prints one JSON object.

    python tools/harden_measure.py                      # everything below, about 2 minutes on 2 CPU cores
    python tools/harden_measure.py --skip-shutdown      # without the real-server SIGTERM timing

* ``heavy_mesh``: in-process app (random weights, ``--hypotheses`` x ``--register-iterations``, CPU):
  upload time and status of icospheres of growing face counts under the default limits and the
  device's register-cost budget; then the time of a register of a small object right after (the lane is
  never held by a refused mesh), and of a register of the largest accepted mesh (what the budget allows).
* ``texture``: peak (and kept) RSS growth while loading a GLB of ~200 KB that embeds an 8192x8192 texture, with
  ``max_texture_side`` 2048 (the server's default) and without a limit (the reference behaviour),
  each in a fresh subprocess whose peak is reset after its imports (Linux ``/proc/self/clear_refs``).
* ``shutdown``: ``python -m server`` on the CPU with the full 252 x 5 config, SIGTERM while the warm-up
  computes: seconds until exit, exit status, and whether "Application shutdown failed" was logged.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

_TEXTURE_PROBE = """
import io, sys, time
import numpy as np, trimesh
from PIL import Image
from foundationpose.mesh import limit_texture_images, load_object
side = None if sys.argv[2] == "none" else int(sys.argv[2])
def status_kib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1])
data = open(sys.argv[1], "rb").read()
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS: imports excluded
base = status_kib("VmRSS:")
t = time.perf_counter()
scene = trimesh.load(file_obj=io.BytesIO(data), file_type="glb")
limit_texture_images(scene, side)
model = load_object(scene, max_texture_side=side)
print(status_kib("VmHWM:") - base, time.perf_counter() - t, "x".join(str(n) for n in model.tensors.texture.shape),
      status_kib("VmRSS:") - base)
"""


def _big_texture_glb(path: Path, side: int = 8192) -> int:
    import numpy as np
    import trimesh
    from PIL import Image

    mesh = trimesh.creation.box(extents=(0.1, 0.08, 0.05))
    uv = np.random.default_rng(0).random((len(mesh.vertices), 2))
    mesh.visual = trimesh.visual.TextureVisuals(uv=uv, image=Image.new("RGB", (side, side), (200, 30, 10)))
    data = mesh.export(file_type="glb")
    path.write_bytes(data)
    return len(data)


def measure_texture(tmp: Path) -> dict:
    glb = tmp / "big_texture.glb"
    size = _big_texture_glb(glb)
    out = {"glb_bytes": size, "texture_px": "8192x8192"}
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for label, side in (("max_texture_side_2048", "2048"), ("no_limit", "none")):
        done = subprocess.run([sys.executable, "-c", _TEXTURE_PROBE, str(glb), side], capture_output=True, text=True,
                              env=env, timeout=300)
        if done.returncode != 0:
            out[label] = {"error": done.stderr[-500:]}
            continue
        kib, seconds, shape, kept_kib = done.stdout.split()
        out[label] = {"peak_rss_growth_mib": round(int(kib) / 1024, 1), "kept_rss_growth_mib": round(int(kept_kib) / 1024, 1),
                      "load_s": round(float(seconds), 2), "texture_tensor": shape}
    return out


def measure_heavy_mesh(hypotheses: int, iterations: int) -> dict:
    import trimesh
    from fastapi.testclient import TestClient

    from foundationpose.estimator import EstimatorConfig, PoseEstimator
    from foundationpose.synthetic.meshes import make_procedural_mesh
    from foundationpose.synthetic.scenes import synthetic_frame
    from server import ServerConfig, codecs, create_app

    estimator = PoseEstimator.create(device="cpu", weights=None, renderer="cpu", config=EstimatorConfig(
        num_hypotheses=hypotheses, register_iterations=iterations, track_iterations=1))
    tmp = Path(tempfile.mkdtemp(prefix="harden-objects-"))
    make_procedural_mesh("vertex_color_asym").export(tmp / "block.ply")
    config = ServerConfig.from_settings(objects_dir=tmp, num_hypotheses=hypotheses, register_iterations=iterations,
                          track_iterations=1, warmup=False, max_image_hw=(240, 320))
    frame = synthetic_frame(240, 320, seed=1)
    files = {"rgb": ("rgb.png", codecs.encode_rgb_png(frame.rgb)),
             "depth": ("depth.png", codecs.encode_depth_png_mm(frame.depth_m)),
             "mask": ("mask.png", codecs.encode_mask_png(frame.mask))}
    K = json.dumps(frame.K.tolist())
    out: dict = {"config": {"hypotheses": hypotheses, "register_iterations": iterations, "device": "cpu",
                            "request_timeout_s": config.request_timeout_s}}
    app = create_app(config, estimator=estimator)
    with TestClient(app) as client:
        state = app.state.fp
        assert state.wait_ready(120), state.failure
        out["face_budget"] = state.objects._face_budget()
        out["max_register_cost"] = state.objects.max_register_cost
        uploads = []
        largest_ok = None
        for subdivisions in (5, 6, 7, 8):  # 20k, 82k, 328k, 1.3M faces
            mesh = trimesh.creation.icosphere(subdivisions=subdivisions, radius=0.05)
            data = mesh.export(file_type="ply")
            started = time.perf_counter()
            response = client.post("/objects", data={"object_id": f"sphere{subdivisions}"}, files={"mesh": ("s.ply", data)})
            row = {"faces": len(mesh.faces), "status": response.status_code,
                   "upload_ms": round((time.perf_counter() - started) * 1e3, 1)}
            if response.status_code != 201:
                row["message"] = response.json()["error"]["message"][:160]
            elif largest_ok is None or len(mesh.faces) > largest_ok[1]:
                largest_ok = (f"sphere{subdivisions}", len(mesh.faces))
            uploads.append(row)
        out["uploads"] = uploads
        started = time.perf_counter()
        response = client.post("/register", data={"object_id": "block", "K": K}, files=files)
        out["register_small_after_refusals"] = {"status": response.status_code,
                                                "ms": round((time.perf_counter() - started) * 1e3, 1)}
        if largest_ok is not None:
            started = time.perf_counter()
            response = client.post("/register", data={"object_id": largest_ok[0], "K": K}, files=files)
            out["register_largest_accepted"] = {"faces": largest_ok[1], "status": response.status_code,
                                                "ms": round((time.perf_counter() - started) * 1e3, 1)}
    return out


def measure_shutdown(tmp: Path) -> dict:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "server", "--objects", str(tmp / "objects"), "--device", "cpu", "--port", str(port),
           "--hypotheses", "252", "--register-iterations", "5"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = []
    for line in proc.stdout:
        log.append(line)
        if "loaded 0 objects from" in line:
            break
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    took = time.monotonic() - sent
    text = "".join(log) + rest
    return {"during": "warm-up (252 hypotheses x 5 iterations on CPU)", "sigterm_to_exit_s": round(took, 2),
            "exit_status": proc.returncode, "shutdown_failed_logged": "Application shutdown failed" in text}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/harden_measure.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hypotheses", type=int, default=16, help="register hypotheses (default 16, the CPU default)")
    parser.add_argument("--register-iterations", type=int, default=2, help="register iterations (default 2)")
    parser.add_argument("--skip-shutdown", action="store_true", help="skip the real-server SIGTERM timing")
    parser.add_argument("--skip-heavy", action="store_true", help="skip the heavy-mesh uploads and registers")
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="harden-measure-"))
    result: dict = {"texture": measure_texture(tmp)}
    if not args.skip_heavy:
        result["heavy_mesh"] = measure_heavy_mesh(args.hypotheses, args.register_iterations)
    if not args.skip_shutdown:
        result["shutdown"] = measure_shutdown(tmp)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
