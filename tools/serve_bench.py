"""Ray Serve scale-out benchmark: 1 pose replica vs 2 on the same device, and the Serve hop; prints one JSON.

    python tools/serve_bench.py --device cuda --out serve_bench.json          # the H200 run (tools/h200/serve.sh)
    python tools/serve_bench.py --device cpu --tiny --sessions 4 --frames 2 --registers 4 --lone-tracks 5   # smoke

Phases, each over loopback HTTP with the same synthetic frame (``--image``, default 640x480):

* ``single_process``: ``python -m server`` (spawned as tools/loadtest.py does): a lone session's
  sequential tracks (latency) and sequential registers.
* for each Serve layout (``1x1``: 1 replica with ``num_gpus`` 1; ``2x0.5``: 2 replicas sharing the
  device, ``num_gpus`` 0.5 each; on CPU ``num_gpus`` 0): the same lone track and registers, then
  ``--sessions`` sessions tracking ``--frames`` frames each, all at once (each session one frame after
  another: throughput in frames/s), and ``--registers`` registers ``--register-concurrency`` at a time.

``serve_hop_ms`` = lone-track p50 through Serve minus the single-process p50 (the issue's target: <= 1 ms).
Latencies are client-side (httpx), in ms: p50/p90/p99. One asyncio client drives the load: on a busy
host it can itself be the bottleneck (``client_cpu_s`` is reported). A 503 is counted and retried after
its Retry-After (at most 0.5 s).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "tools"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from loadtest import Stats, Uploads, _request, spawned_server  # noqa: E402  (tools/loadtest.py)

from deploy_core.report import emit_json_report  # noqa: E402
from deploy_core.timing import percentile  # noqa: E402

OBJECT_ID = "bench_block"
LAYOUTS = {"1x1": (1, 1.0), "2x0.5": (2, 0.5)}  # name -> (replicas, num_gpus per replica on a GPU)


def _latency(values_ms: list[float]) -> dict:
    v = sorted(values_ms)
    return {"n": len(v), "p50_ms": round(percentile(v, 50), 2), "p90_ms": round(percentile(v, 90), 2),
            "p99_ms": round(percentile(v, 99), 2)} if v else {"n": 0}


def _files(up: Uploads, with_mask: bool) -> dict:
    files = {"rgb": ("rgb.png", up.rgb), "depth": ("depth.png", up.depth)}
    if with_mask:
        files["mask"] = ("mask.png", up.mask)
    return files


async def _register(client, stats: Stats, up: Uploads) -> str | None:
    for _ in range(50):  # retried on 503 (after Retry-After), so every phase gets its sessions
        r = await _request(client, stats, "register", "POST", "/register", data={"object_id": OBJECT_ID, "K": up.K},
                           files=_files(up, True))
        if r is not None and r.status_code == 200:
            return r.json()["session_id"]
        if r is None or r.status_code != 503:
            return None
    return None


async def _track(client, stats: Stats, up: Uploads, session_id: str) -> bool:
    for _ in range(50):
        r = await _request(client, stats, "track", "POST", "/track", data={"session_id": session_id},
                           files=_files(up, False))
        if r is not None and r.status_code == 200:
            return True
        if r is None or r.status_code != 503:
            return False
    return False


def _stats() -> Stats:
    return Stats(max_requests=10**9, deadline=time.monotonic() + 3600)


def _errors(stats: Stats) -> dict:
    return {f"{name} {code}": n for name, counter in stats.statuses.items() for code, n in counter.items() if code >= 400}


async def lone(client, up: Uploads, tracks: int, registers: int) -> dict:
    """A lone session's sequential tracks, then sequential registers (latency, nothing else running)."""
    stats = _stats()
    session_id = await _register(client, stats, up)
    if session_id is None:
        raise RuntimeError(f"register failed: {stats.error_samples}")
    for _ in range(3):  # warm the path (batcher, allocator) before timing
        await _track(client, stats, up, session_id)
    stats.latencies_ms["track"].clear()
    for _ in range(tracks):
        await _track(client, stats, up, session_id)
    reg_stats = _stats()
    for _ in range(registers):
        await _register(client, reg_stats, up)
    return {"track": _latency(stats.latencies_ms["track"]), "register": _latency(reg_stats.latencies_ms["register"]),
            "errors": {**_errors(stats), **_errors(reg_stats)}}


async def sessions_throughput(client, up: Uploads, sessions: int, frames: int) -> dict:
    """``sessions`` sessions registered, then all tracking ``frames`` frames at once."""
    reg = _stats()
    sem = asyncio.Semaphore(8)

    async def one_register():
        async with sem:
            return await _register(client, reg, up)

    ids = [s for s in await asyncio.gather(*(one_register() for _ in range(sessions))) if s is not None]
    stats = _stats()

    async def run(session_id: str) -> int:
        return sum([await _track(client, stats, up, session_id) for _ in range(frames)])

    started = time.perf_counter()
    done = sum(await asyncio.gather(*(run(s) for s in ids)))
    wall = time.perf_counter() - started
    return {"sessions": len(ids), "frames_per_session": frames, "frames_ok": done, "wall_s": round(wall, 3),
            "frames_per_s": round(done / wall, 1) if wall > 0 else None, "track": _latency(stats.latencies_ms["track"]),
            "errors": _errors(stats)}


async def registers_throughput(client, up: Uploads, registers: int, concurrency: int) -> dict:
    stats = _stats()
    sem = asyncio.Semaphore(concurrency)

    async def one():
        async with sem:
            return await _register(client, stats, up)

    started = time.perf_counter()
    ok = sum(s is not None for s in await asyncio.gather(*(one() for _ in range(registers))))
    wall = time.perf_counter() - started
    return {"registers_ok": ok, "concurrency": concurrency, "wall_s": round(wall, 3),
            "registers_per_s": round(ok / wall, 2) if wall > 0 else None,
            "register": _latency(stats.latencies_ms["register"]), "errors": _errors(stats)}


def _client(url: str, api_key: str | None, connections: int) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(base_url=url, headers=headers, timeout=300.0,
                             limits=httpx.Limits(max_connections=connections + 4))


async def _upload_object(client) -> None:
    from foundationpose.synthetic.meshes import make_procedural_mesh

    ply = make_procedural_mesh("vertex_color_asym").export(file_type="ply")
    r = await client.post("/objects", data={"object_id": OBJECT_ID}, files={"mesh": ("block.ply", ply)})
    if r.status_code not in (201, 409):
        raise RuntimeError(f"object upload failed: {r.status_code} {r.text[:300]}")


def run_single_process(args, up: Uploads) -> dict:
    import secrets

    api_key = secrets.token_urlsafe(16)
    spawn_args = argparse.Namespace(device=args.device, hypotheses=args.hypotheses,
                                    register_iterations=args.register_iterations,
                                    track_iterations=args.track_iterations, image_hw=args.image_hw,
                                    weights=args.weights, ready_timeout_s=args.ready_timeout_s)
    with spawned_server(spawn_args, api_key) as (url, info):
        async def go():
            async with _client(url, api_key, 4) as client:
                await _upload_object(client)
                return await lone(client, up, args.lone_tracks, args.lone_registers)

        result = asyncio.run(go())
    result["startup_s"] = info.get("startup_s")
    return result


def run_serve_layout(args, up: Uploads, name: str, objects_dir: Path, port: int) -> dict:
    from ray import serve

    from server.config import ServerConfig
    from server.serve.app import build_app
    from server.serve.settings import ServeSettings

    replicas, gpus = LAYOUTS[name]
    num_gpus = gpus if args.device != "cpu" else 0.0
    config = ServerConfig.from_settings(objects_dir=objects_dir, device=args.device, weights=args.weights,
                          num_hypotheses=args.hypotheses, register_iterations=args.register_iterations,
                          track_iterations=args.track_iterations, max_image_hw=args.image_hw,
                          track_max_batch=args.track_max_batch, submit_timeout_s=1.0, max_sessions=4096)
    settings = ServeSettings(server=config, replicas=replicas, num_gpus=num_gpus, num_cpus=args.replica_cpus,
                             ingress_num_cpus=0.0, max_ongoing_requests=max(64, args.track_max_batch * 2),
                             max_queued_requests=-1, app_name=f"bench_{name.replace('.', '_')}")
    started = time.monotonic()
    serve.run(build_app(settings), name=settings.app_name, route_prefix="/", blocking=False)
    startup_s = round(time.monotonic() - started, 1)
    url = f"http://127.0.0.1:{port}"

    async def go():
        async with _client(url, None, args.sessions) as client:
            out = {"lone": await lone(client, up, args.lone_tracks, args.lone_registers)}
            out["sessions"] = await sessions_throughput(client, up, args.sessions, args.frames)
            out["registers"] = await registers_throughput(client, up, args.registers, args.register_concurrency)
            text = (await client.get("/metrics")).text
            out["retries"] = next((float(x.split()[-1]) for x in text.splitlines()
                                   if x.startswith("fp_serve_retries_total ")), None)
            return out

    try:
        result = asyncio.run(go())
    finally:
        serve.delete(settings.app_name)
    result.update(replicas=replicas, num_gpus_per_replica=num_gpus, startup_s=startup_s)
    return result


def build_parser() -> argparse.ArgumentParser:
    from server.config import parse_image_size

    p = argparse.ArgumentParser(prog="python tools/serve_bench.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda | cpu (default cuda)")
    p.add_argument("--weights", default=None, help="weights root (default: random weights)")
    p.add_argument("--tiny", action="store_true", help="4 hypotheses, 1 + 1 iterations (a CPU smoke run)")
    p.add_argument("--hypotheses", type=int, default=252, help="register hypotheses (default 252: the full grid)")
    p.add_argument("--register-iterations", type=int, default=5)
    p.add_argument("--track-iterations", type=int, default=2)
    p.add_argument("--track-max-batch", type=int, default=16)
    p.add_argument("--image", type=parse_image_size, default=(480, 640), dest="image_hw", help="WIDTHxHEIGHT (640x480)")
    p.add_argument("--sessions", type=int, default=64, help="concurrent tracking sessions (default 64)")
    p.add_argument("--frames", type=int, default=20, help="frames per session (default 20)")
    p.add_argument("--registers", type=int, default=32, help="registers in the register-throughput phase (32)")
    p.add_argument("--register-concurrency", type=int, default=8)
    p.add_argument("--lone-tracks", type=int, default=100, help="sequential tracks of the lone session (100)")
    p.add_argument("--lone-registers", type=int, default=5)
    p.add_argument("--layouts", default="1x1,2x0.5", help=f"Serve layouts to run, of {sorted(LAYOUTS)}")
    p.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves per pose replica")
    p.add_argument("--skip-single-process", action="store_true")
    p.add_argument("--ready-timeout-s", type=float, default=300.0)
    p.add_argument("--out", default=None, help="also write the JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.tiny:
        args.hypotheses, args.register_iterations, args.track_iterations = 4, 1, 1
    layouts = [name for name in args.layouts.split(",") if name]
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        raise SystemExit(f"--layouts: unknown {unknown}; expected some of {sorted(LAYOUTS)}")
    up = Uploads(*args.image_hw)
    cpu0 = time.process_time()
    report: dict = {"settings": {k: v for k, v in vars(args).items() if k != "out"}}
    report["settings"]["image_wh"] = [args.image_hw[1], args.image_hw[0]]
    if not args.skip_single_process:
        print("single-process server ...", file=sys.stderr)
        report["single_process"] = run_single_process(args, up)
    import ray
    from loadtest import _free_port
    from ray import serve

    from foundationpose.synthetic.meshes import make_procedural_mesh

    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    ray.init(include_dashboard=False, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    report["serve"] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="fp-serve-bench-") as tmp:
            objects = Path(tmp)
            make_procedural_mesh("vertex_color_asym").export(objects / f"{OBJECT_ID}.ply")
            for name in layouts:
                print(f"serve layout {name} ...", file=sys.stderr)
                report["serve"][name] = run_serve_layout(args, up, name, objects, port)
    finally:
        serve.shutdown()
        ray.shutdown()
    single = report.get("single_process", {}).get("track", {})
    for result in report["serve"].values():
        if single.get("p50_ms") is not None:
            result["serve_hop_ms"] = round(result["lone"]["track"]["p50_ms"] - single["p50_ms"], 2)
    if {"1x1", "2x0.5"} <= set(report["serve"]):
        one, two = report["serve"]["1x1"], report["serve"]["2x0.5"]
        report["two_vs_one_replica"] = {
            "sessions_frames_per_s": _ratio(two["sessions"]["frames_per_s"], one["sessions"]["frames_per_s"]),
            "registers_per_s": _ratio(two["registers"]["registers_per_s"], one["registers"]["registers_per_s"]),
        }
    report["client_cpu_s"] = round(time.process_time() - cpu0, 1)
    emit_json_report(report, args.out)
    return 0


def _ratio(a, b):
    return round(a / b, 3) if a and b else None


if __name__ == "__main__":
    sys.exit(main())
