"""Re-measure the issue-12 hardening on this machine (CPU by default); prints one JSON object.

    python tools/harden_measure.py                      # everything below, about 3 minutes on 2 CPU cores
    python tools/harden_measure.py --skip-shutdown      # without the real-server SIGTERM timing
    python tools/harden_measure.py --sections session_flood,track_overload   # the load sections only

* ``heavy_mesh``: in-process app (random weights, ``--hypotheses`` x ``--register-iterations``, CPU):
  upload time and status of icospheres of growing face counts under the default limits and the
  device's register-cost budget; then the time of a register of a small object right after (the lane is
  never held by a refused mesh), and of a register of the largest accepted mesh (what the budget allows).
* ``texture``: peak (and kept) RSS growth while loading a GLB of ~200 KB that embeds an 8192x8192 texture, with
  ``max_texture_side`` 2048 (the server's default) and without a limit (the reference behaviour),
  each in a fresh subprocess whose peak is reset after its imports (Linux ``/proc/self/clear_refs``).
* ``shutdown``: ``python -m server`` on the CPU with the full 252 x 5 config, SIGTERM while the warm-up
  computes: seconds until exit, exit status, and whether "Application shutdown failed" was logged.
* ``session_flood``: a real ``python -m server`` on 127.0.0.1 (4 hypotheses x 1 iteration, CPU, the default
  1920x1080 largest image); one session registered on a 1920x1080 frame and tracked twice, then
  ``--flood-requests`` (100) concurrent ``POST /track`` on it, each a raw 1920x1080 frame (uint8 RGB +
  float32 depth in metres, a 14.5 MB body). The server's RSS (``/proc/PID/status``) before, peak during
  (sampled every 20 ms, and the kernel's VmHWM after resetting it), right after and 2 s after; answers by
  status, the slowest answer, 429/503 answers without ``Retry-After``; then one more track shows that the
  session still advances.
* ``track_overload``: ``--overload-clients`` (64) clients in lock-step (the next request after each answer,
  PNG multipart, ``tools/loadtest.py``'s request and statistics code) for ``--overload-s`` (20) seconds
  against a real server (same config, 320x240 largest image, default track capacity), then for at most
  10 s against one with ``--track-capacity`` ``--overload-small-capacity`` (16): answers by status,
  p50/p90/p99, the slowest, the server's shed counters, and 429/503 answers without ``Retry-After`` (none
  expected). ``--overload-flow stateless`` (default) sends stateless tracks with the pose of one register;
  ``sessions`` registers one session per client first (two at a time, not timed; over a minute on 2 cores).

Each real-server section starts its own server (about 6 s on a 2-core CPU machine); ``--sections`` picks them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

SECTIONS = ("texture", "heavy_mesh", "shutdown", "session_flood", "track_overload")

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


def _server_args(image_hw: tuple[int, int]) -> argparse.Namespace:
    """What ``loadtest.spawned_server`` reads: the tiny CPU config, random weights."""
    return argparse.Namespace(device="cpu", hypotheses=4, register_iterations=1, track_iterations=1,
                              image_hw=image_hw, weights=None, ready_timeout_s=180.0)


def _rss_kib(pid: int, key: str = "VmRSS:") -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(key):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class RssSampler:
    """Samples another process's RSS every ``interval_s`` in a thread; ``peak_kib`` is the largest seen."""

    def __init__(self, pid: int, interval_s: float = 0.02) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.peak_kib = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):  # polling another process: there is nothing to wait on
            kib = _rss_kib(self.pid)
            if kib is not None:
                self.peak_kib = max(self.peak_kib, kib)
                self.samples += 1

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _mib(kib: int | None) -> float | None:
    return None if kib is None else round(kib / 1024, 1)


async def _flood(url: str, api_key: str, pid: int, requests: int, image_hw: tuple[int, int]) -> dict:
    import httpx
    import loadtest
    import numpy as np

    from foundationpose.synthetic.scenes import synthetic_frame
    from server import codecs

    h, w = image_hw
    frame = synthetic_frame(h, w, seed=1)
    rgb = np.ascontiguousarray(frame.rgb, dtype=np.uint8).tobytes()
    depth = np.ascontiguousarray(frame.depth_m, dtype="<f4").tobytes()
    fields = {"rgb_shape": f"{h},{w},3", "depth_shape": f"{h},{w}", "depth_dtype": "float32"}
    headers = {"Authorization": f"Bearer {api_key}"}
    limits = httpx.Limits(max_connections=requests + 4, max_keepalive_connections=requests + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=180.0, limits=limits) as client:
        object_id = await loadtest._ensure_object(client)
        started = time.perf_counter()
        reg = await client.post("/register", data={"object_id": object_id, "K": json.dumps(frame.K.tolist())},
                                files={"rgb": ("rgb.png", codecs.encode_rgb_png(frame.rgb)),
                                       "depth": ("depth.png", codecs.encode_depth_png_mm(frame.depth_m)),
                                       "mask": ("mask.png", codecs.encode_mask_png(frame.mask))})
        register = {"status": reg.status_code, "ms": round((time.perf_counter() - started) * 1e3, 1)}
        if reg.status_code != 200:
            return {"register": {**register, "message": reg.text[:300]}}
        session_id = reg.json()["session_id"]
        files = {"rgb": ("rgb.raw", rgb), "depth": ("depth.raw", depth)}
        first = _rss_kib(pid)
        for _ in range(2):  # the first tracks of this size set up the lane's buffers: not the flood's growth
            warm = await client.post("/track", data={"session_id": session_id, **fields}, files=files)
            warm.raise_for_status()

        async def one() -> tuple[int | str, float, bool]:
            t = time.perf_counter()
            try:
                r = await client.post("/track", data={"session_id": session_id, **fields}, files=files)
            except httpx.HTTPError as exc:
                return type(exc).__name__, time.perf_counter() - t, False
            return r.status_code, time.perf_counter() - t, "retry-after" in r.headers

        with contextlib.suppress(OSError):  # reset the kernel's peak (VmHWM) to the current RSS
            Path(f"/proc/{pid}/clear_refs").write_text("5")
        before = _rss_kib(pid)
        started = time.perf_counter()
        with RssSampler(pid) as sampler:
            answers = await asyncio.gather(*(one() for _ in range(requests)))
        flood_s = time.perf_counter() - started
        hwm = _rss_kib(pid, "VmHWM:")
        right_after = _rss_kib(pid)
        await asyncio.sleep(2.0)  # what the allocator keeps once the flood is over
        settled = _rss_kib(pid)
        then = await client.post("/track", data={"session_id": session_id, **fields}, files=files)
    statuses: dict[str, int] = {}
    slowest: dict[str, float] = {}
    for status, seconds, _ in answers:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
        slowest[str(status)] = round(max(slowest.get(str(status), 0.0), seconds), 2)
    peak = max(v for v in (sampler.peak_kib, hwm or 0, before or 0))
    return {
        "sent": {"requests": requests, "body": f"raw {w}x{h} uint8 RGB + float32 depth (metres), multipart",
                 "body_mb": round((len(rgb) + len(depth)) / 1e6, 2), "total_gb": round(requests * (len(rgb) + len(depth)) / 1e9, 2)},
        "register": register,
        "statuses": dict(sorted(statuses.items())),
        "slowest_s": round(max(s for _, s, _ in answers), 2),
        "slowest_s_by_status": dict(sorted(slowest.items())),
        "all_answered_s": round(flood_s, 2),
        "refusals_without_retry_after": sum(1 for st, _, ra in answers if st in (429, 503) and not ra),
        "rss_mib": {"after_register": _mib(first), "before": _mib(before), "peak": _mib(peak), "peak_sampled": _mib(sampler.peak_kib),
                    "peak_vmhwm": _mib(hwm), "right_after": _mib(right_after), "after_2s": _mib(settled),
                    "samples": sampler.samples},
        "rss_growth_mib": {"peak": _mib(peak - before) if before else None,
                           "after_2s": _mib(settled - before) if before and settled else None},
        "track_after_flood": {"status": then.status_code,
                              "frame": then.json().get("frame") if then.status_code == 200 else None},
    }


def measure_session_flood(requests: int, image_hw: tuple[int, int] = (1080, 1920)) -> dict:
    import loadtest

    api_key = secrets.token_urlsafe(16)
    with loadtest.spawned_server(_server_args(image_hw), api_key) as (url, info):
        out = asyncio.run(_flood(url, api_key, info["pid"], requests, image_hw))
    out["server"] = info
    return out


async def _overload(url: str, api_key: str, clients: int, duration_s: float, image_hw: tuple[int, int],
                    flow: str) -> dict:
    import httpx
    import loadtest

    up = loadtest.Uploads(*image_hw)
    headers = {"Authorization": f"Bearer {api_key}"}
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120.0, limits=limits) as client:
        object_id = await loadtest._ensure_object(client)
        # set-up, not measured: the sessions (two registers at a time: the register lane's room), or for
        # stateless tracks one register whose pose every client sends as its previous pose
        setup = loadtest.Stats(max_requests=50 * clients, deadline=time.monotonic() + 120.0)
        room = asyncio.Semaphore(2)

        async def register() -> str | None:
            while setup.take():
                async with room:
                    session_id = await loadtest._register(client, setup, up, object_id, "register")
                if session_id is not None:
                    return session_id
            return None

        started = time.monotonic()
        sessions = [s for s in await asyncio.gather(*(register() for _ in range(clients if flow == "sessions" else 1)))
                    if s is not None]
        if not sessions:
            return {"error": "no register succeeded", "register_statuses": dict(setup.statuses["register"])}
        forms = [{"session_id": s} for s in sessions]
        if flow == "stateless":
            pose = (await client.get(f"/sessions/{sessions[0]}")).json()["pose"]
            forms = [{"object_id": object_id, "pose": json.dumps(pose), "K": up.K}] * clients
        setup_s = time.monotonic() - started
        before = (await client.get("/metrics")).text
        stats = loadtest.Stats(max_requests=1_000_000, deadline=time.monotonic() + duration_s)
        files = {"rgb": ("rgb.png", up.rgb), "depth": ("depth.png", up.depth)}

        async def track(form: dict) -> None:  # lock-step: the next frame after each answer
            while stats.take():
                await loadtest._request(client, stats, "track", "POST", "/track", data=form, files=files)

        started = time.monotonic()
        await asyncio.gather(*(track(f) for f in forms))
        elapsed = time.monotonic() - started
        after = (await client.get("/metrics")).text
    summary = stats.summary(elapsed)
    track_row = summary["endpoints"].get("track", {})
    return {
        "setup": {"sessions_registered": len(sessions), "setup_s": round(setup_s, 1),
                     "register_statuses": {str(k): v for k, v in sorted(setup.statuses["register"].items())},
                     "register_refusals_without_retry_after": dict(setup.refusals_without_retry_after)},
        "elapsed_s": summary["elapsed_s"],
        "track": {k: track_row.get(k) for k in ("count", "ok", "p50_ms", "p90_ms", "p99_ms", "mean_ms")},
        "track_statuses": {str(k): v for k, v in sorted(stats.statuses["track"].items())},
        "slowest_ms": round(max(stats.latencies_ms["track"]), 1) if stats.latencies_ms["track"] else None,
        "tracks_per_s": summary["tracks_per_s"],
        "refusals_without_retry_after": summary["refusals_without_retry_after"],
        "transport_errors": summary["transport_errors"],
        "error_samples": summary["error_samples"],
        "server_shed": loadtest._labelled(after, "fp_requests_shed_total"),
        "server_track_batches": (loadtest._metric(after, "fp_track_batches_total") or 0)
                                - (loadtest._metric(before, "fp_track_batches_total") or 0),
    }


def measure_track_overload(clients: int, duration_s: float, flow: str, capacity: int | None,
                           image_hw: tuple[int, int] = (240, 320)) -> dict:
    """One overload run against a fresh server; ``capacity`` None = the server's default track capacity."""
    import loadtest

    api_key = secrets.token_urlsafe(16)
    extra = () if capacity is None else ("--track-capacity", str(capacity))
    with loadtest.spawned_server(_server_args(image_hw), api_key, extra) as (url, info):
        out = asyncio.run(_overload(url, api_key, clients, duration_s, image_hw, flow))
    flows = {"sessions": "one session per client, then lock-step tracks of it",
             "stateless": "lock-step stateless tracks (object_id + pose + K), the pose of one register"}
    out["settings"] = {"clients": clients, "duration_s": duration_s, "mode": "http-png", "track_capacity":
                       capacity or "server default", "image_wh": [image_hw[1], image_hw[0]], "flow": flows[flow]}
    out["server"] = info
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/harden_measure.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hypotheses", type=int, default=16, help="register hypotheses (default 16, the CPU default)")
    parser.add_argument("--register-iterations", type=int, default=2, help="register iterations (default 2)")
    parser.add_argument("--skip-shutdown", action="store_true", help="skip the real-server SIGTERM timing")
    parser.add_argument("--skip-heavy", action="store_true", help="skip the heavy-mesh uploads and registers")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated sections to run, of {', '.join(SECTIONS)} (default all)")
    parser.add_argument("--flood-requests", type=int, default=100,
                        help="session_flood: concurrent tracks on one session, 1..200 (default 100)")
    parser.add_argument("--overload-clients", type=int, default=64, help="track_overload: clients, 1..256 (default 64)")
    parser.add_argument("--overload-s", type=float, default=20.0, help="track_overload: seconds, <= 120 (default 20)")
    parser.add_argument("--overload-flow", choices=("stateless", "sessions"), default="stateless",
                        help="track_overload: stateless tracks, or one session per client (registering 64 sessions "
                             "takes over a minute on 2 CPU cores; default stateless)")
    parser.add_argument("--overload-small-capacity", type=int, default=16,
                        help="track_overload: a second run (at most 10 s) with this --track-capacity, to see the "
                             "503 + Retry-After path; 0 = skip (default 16)")
    args = parser.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: unknown {', '.join(unknown)}; expected some of {', '.join(SECTIONS)}")
    if not 1 <= args.flood_requests <= 200:
        parser.error(f"--flood-requests must be in 1..200, got {args.flood_requests}")
    if not 1 <= args.overload_clients <= 256:
        parser.error(f"--overload-clients must be in 1..256, got {args.overload_clients}")
    if not 0 < args.overload_s <= 120:
        parser.error(f"--overload-s must be in (0, 120], got {args.overload_s}")
    if args.skip_heavy and "heavy_mesh" in sections:
        sections.remove("heavy_mesh")
    if args.skip_shutdown and "shutdown" in sections:
        sections.remove("shutdown")
    tmp = Path(tempfile.mkdtemp(prefix="harden-measure-"))
    result: dict = {}
    for name in sections:
        started = time.monotonic()
        if name == "texture":
            result[name] = measure_texture(tmp)
        elif name == "heavy_mesh":
            result[name] = measure_heavy_mesh(args.hypotheses, args.register_iterations)
        elif name == "shutdown":
            result[name] = measure_shutdown(tmp)
        elif name == "session_flood":
            result[name] = measure_session_flood(args.flood_requests)
        else:
            runs = {"default_capacity": measure_track_overload(args.overload_clients, args.overload_s,
                                                               args.overload_flow, None)}
            if args.overload_small_capacity:
                runs[f"capacity_{args.overload_small_capacity}"] = measure_track_overload(
                    args.overload_clients, min(args.overload_s, 10.0), args.overload_flow, args.overload_small_capacity)
            result[name] = runs
        result[name]["section_s"] = round(time.monotonic() - started, 1)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
