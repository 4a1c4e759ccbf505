"""What one ingest track request costs the GPU process's event loop (issue 11 diagnostic, CPU or CUDA).

Through session 10, 64 HTTP clients were bound by the GPU process's GIL, most of it held by the event loop that
serves the ingest workers' track messages (:mod:`server.ingest.hub`). This runs the real server in this process
(uvicorn, uvloop, the hub, sessions, admission, the pipeline; the track step reduced to one copy unless
``--no-reduced-step``) and a stand-in ingest worker in a child process that speaks the hub's protocol straight from
a ring of frames (no HTTP: the child is cheap and the measurement is the GPU process's side only). Each of
``--sessions`` sessions keeps one track in flight, as a client of ``POST /track/binary`` does.

Printed as JSON: tracks/s, latency p50/p90/p99 (the child's send -> answer), the event loop's CPU per request
(``loop_us_per_request``, from /proc: the number to lower), the other threads' CPU per request, and with
``--profile`` the loop thread's top functions by own time (cProfile, which slows the loop ~2x: read its shares).

    python tools/hub_cost.py --sessions 16 --seconds 10                   # CPU, tiny networks
    python tools/hub_cost.py --device cuda --image 640x480 --sessions 64   # the H200 (the step graphed, reduced)

``--submit-in-loop`` (default on) submits on the loop as from a page-locked ring, which only CUDA has; on the CPU
that is the path this measures (without it, the CPU's requests validate and submit in worker threads).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import multiprocessing as mp
import os
import pstats
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from proc_cpu import comm_of, cpu_times  # tools/ is this script's folder

from deploy_core.timing import percentile

_TINY = dict(num_hypotheses=4, register_iterations=1, track_iterations=1)


def _thread_cpu_s(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (name, user + system CPU seconds) of every thread of ``pid`` (:mod:`proc_cpu`'s /proc readers)."""
    times = cpu_times(pid)
    threads = times[1] if times is not None else {}
    return {tid: (comm_of(Path(f"/proc/{pid}/task/{tid}/comm")), cpu) for tid, cpu in threads.items()}


def _worker(hub_path: str, max_hw: tuple[int, int], hw: tuple[int, int], sessions: list[str], seconds: float,
            result: Any) -> None:
    """The stand-in ingest worker (a child process): each session sends its next track once answered."""
    from server.ingest.ring import FrameRing
    from server.ingest.worker import HubClient

    async def run() -> dict[str, Any]:
        ring = FrameRing.create(len(sessions), max_hw)
        rng = np.random.default_rng(0)
        h, w = hw
        for slot in range(len(sessions)):
            ring.rgb(slot, hw)[...] = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            ring.depth(slot, hw)[...] = 0.5 + 0.1 * rng.random((h, w), dtype=np.float32)
        hub = HubClient()
        await hub.connect(Path(hub_path), ring)
        ring.unlink()
        latencies: list[float] = []
        statuses: dict[int, int] = {}
        stop_at = time.monotonic() + seconds

        async def session(slot: int, sid: str) -> None:
            n = 0
            while time.monotonic() < stop_at:
                header = {"op": "track", "slot": slot, "hw": [h, w], "depth_in_range": True,
                          "request_id": f"{slot}-{n}", "phases": {"receive": 0.0, "parse": 0.0, "decode": 0.0},
                          "session_id": sid, "object_id": None, "K": None, "pose": None}
                t0 = time.perf_counter()
                answer, _body = await (await hub.send(header))
                latencies.append((time.perf_counter() - t0) * 1e3)
                statuses[int(answer["status"])] = statuses.get(int(answer["status"]), 0) + 1
                n += 1

        started = time.perf_counter()
        await asyncio.gather(*(session(i, sid) for i, sid in enumerate(sessions)))
        elapsed = time.perf_counter() - started
        await hub.close()
        return {"latencies": latencies, "statuses": statuses, "elapsed_s": elapsed}

    result.put(asyncio.run(run()))


def _register_sessions(base_url: str, object_id: str, n: int, hw: tuple[int, int]) -> list[str]:
    import httpx

    from foundationpose.synthetic.scenes import synthetic_frame
    from server.client import BINARY_HEADERS, register_message

    frame = synthetic_frame(*hw, seed=1)
    body = register_message(object_id, frame.K, frame.rgb, frame.depth_m, frame.mask)
    ids = []
    with httpx.Client(base_url=base_url, timeout=600.0) as client:
        for _ in range(n):
            response = client.post("/register/binary", content=body, headers=BINARY_HEADERS)
            response.raise_for_status()
            ids.append(response.json()["session_id"])
    return ids


def wait_ready(base_url: str, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(base_url + "/readyz", timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the server was not ready within {timeout_s:.0f} s")


def reduced_server(*, device: str, renderer: str | None, image_hw: tuple[int, int], port: int, reduced: bool,
                   fast: bool, submit_in_loop: bool, ingest_workers: int = 1) -> tuple[Any, Any]:
    """(the app, its uvicorn.Server on ``port``: uvloop, httptools) of the real server with one procedural object
    ("block") and ``ingest_workers`` on ``port`` + 1; ``reduced``: graphed track steps reduced to one copy, on tiny
    networks (the step's GPU work gone, every pose stays put); ``submit_in_loop``: ingest tracks submitted on the
    loop as from a page-locked ring, also where there is none (the CPU). The server runs when ``.run()`` is called."""
    import uvicorn

    from foundationpose.estimator import EstimatorConfig, PoseEstimator
    from foundationpose.synthetic.meshes import make_procedural_mesh
    from foundationpose.track_graph import TrackGraphRunner
    from server.app import create_app
    from server.config import ServerConfig
    from server.ingest import hub as hub_module

    cuda = device.startswith("cuda")
    renderer = renderer or ("triton" if cuda else "cpu")
    estimator = None
    if reduced:
        from track_host_ceiling import reduced_step  # tools/ is this script's folder

        TrackGraphRunner._step = reduced_step
        estimator = PoseEstimator.create(device=device, renderer=renderer,
                                         config=EstimatorConfig(**_TINY, track_graphs=True))
    if submit_in_loop:  # as from a page-locked ring (CUDA); the CPU has none
        hub_module.IngestHub._submit_in_loop = lambda self, conn: self.state.config.ingest_submit_in_loop
    objects = Path(tempfile.mkdtemp(prefix="fp-reduced-server-"))
    make_procedural_mesh("vertex_color_asym").export(objects / "block.ply")
    settings: dict[str, Any] = dict(objects_dir=objects, max_image_hw=image_hw, device=device, renderer=renderer,
                                    port=port, ingest_workers=ingest_workers, ingest_port=port + 1, warmup=cuda)
    if cuda:
        settings.update(fast=fast)
    else:
        settings.update(_TINY, track_max_batch=8)
    app = create_app(ServerConfig.from_settings(**settings), estimator=estimator)
    return app, uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", loop="uvloop",
                                              http="httptools", lifespan="on"))


def run_beside(server: Any, name: str, work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run ``server`` (a uvicorn.Server) in this thread while ``work()`` runs in another, then stop it: ``work``'s
    report, or ``{"error": ...}`` when it raised."""
    report: dict[str, Any] = {}

    def drive() -> None:
        try:
            report.update(work())
        except BaseException as exc:  # noqa: BLE001 - reported, then the server stops
            report["error"] = repr(exc)
        finally:
            server.should_exit = True

    threading.Thread(target=drive, name=name, daemon=True).start()
    server.run()
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--renderer", default=None, help="the server's renderer (default: cpu on the CPU, triton on CUDA)")
    p.add_argument("--image", default="128x96", help="WxH of the frames (the server's max image too)")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--port", type=int, default=18931)
    p.add_argument("--submit-in-loop", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--fast", action=argparse.BooleanOptionalAction, default=True,
                   help="the server's --fast (CUDA only; default on, as the H200 figures are measured)")
    p.add_argument("--profile", action="store_true", help="cProfile the event loop's thread; print its top functions")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--profile-out", type=Path, default=None, help="also write the loop's cProfile stats here")
    p.add_argument("--switch-interval-ms", type=float, default=0.5)
    p.add_argument("--reduced-step", action=argparse.BooleanOptionalAction, default=True,
                   help="graphed track steps reduced to one copy (tools/track_host_ceiling.py; default on): every "
                        "pose stays put, so every track is answered 200. With the real step (--no-reduced-step) on "
                        "random weights sessions drift out of the working range and most tracks end in a cheap 422; "
                        "on the CPU the tiny networks' step, not the loop, would bound the rate")
    args = p.parse_args(argv)
    w, h = (int(v) for v in args.image.lower().split("x"))
    sys.setswitchinterval(args.switch_interval_ms / 1e3)

    app, server = reduced_server(device=args.device, renderer=args.renderer, image_hw=(h, w), port=args.port,
                                 reduced=args.reduced_step, fast=args.fast, submit_in_loop=args.submit_in_loop)
    def work() -> dict[str, Any]:
        report: dict[str, Any] = {}
        base = f"http://127.0.0.1:{args.port}"
        wait_ready(base, 900.0)
        state = app.state.fp
        sessions = _register_sessions(base, "block", args.sessions, (h, w))
        profiler = cProfile.Profile() if args.profile else None
        loop = state.ingest._server.get_loop()  # the app's event loop (the hub's server runs on it)
        loop_tid = os.getpid()  # uvicorn runs the loop in this process's main thread
        result: Any = mp.get_context("spawn").Queue()
        child = mp.get_context("spawn").Process(
            target=_worker, args=(str(state.ingest.socket_path), (h, w), (h, w), sessions, args.seconds, result))
        before = _thread_cpu_s(os.getpid())
        answered_before = state.ingest.requests
        if profiler is not None:
            loop.call_soon_threadsafe(profiler.enable)
        child.start()
        outcome = result.get(timeout=args.seconds + 600)
        child.join(30)
        if profiler is not None:
            done = threading.Event()
            loop.call_soon_threadsafe(lambda: (profiler.disable(), done.set()))
            done.wait(30)
        after = _thread_cpu_s(os.getpid())
        n = state.ingest.requests - answered_before
        lat = sorted(outcome["latencies"])
        loop_s = after[loop_tid][1] - before.get(loop_tid, ("", 0.0))[1]
        others: dict[str, float] = {}
        for tid, (name, cpu) in after.items():
            if tid != loop_tid:
                others[name] = others.get(name, 0.0) + cpu - before.get(tid, (name, 0.0))[1]
        report.update(
            device=args.device, image=args.image, sessions=args.sessions, submit_in_loop=args.submit_in_loop,
            profiled=args.profile, requests=n, statuses=outcome["statuses"],
            tracks_per_s=round(len(lat) / outcome["elapsed_s"], 1),
            latency_ms={q: round(percentile(lat, q / 100), 3) for q in (50, 90, 99)},
            loop_us_per_request=round(loop_s / max(n, 1) * 1e6, 1),
            other_threads_us_per_request={k: round(v / max(n, 1) * 1e6, 1)
                                          for k, v in sorted(others.items(), key=lambda kv: -kv[1]) if v > 0})
        if profiler is not None:
            stats = pstats.Stats(profiler)
            if args.profile_out is not None:
                stats.dump_stats(args.profile_out)
            rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:args.top]  # by own time
            report["loop_top_own_us_per_request"] = [
                [f"{Path(f).name}:{line}:{fn}", round(tt / max(n, 1) * 1e6, 2), round(ct / max(n, 1) * 1e6, 2)]
                for (f, line, fn), (_cc, _nc, tt, ct, _callers) in rows]
        return report

    report = run_beside(server, "hub-cost-driver", work)
    print(json.dumps(report, indent=1))
    return 0 if "error" not in report else 1


if __name__ == "__main__":
    sys.exit(main())
