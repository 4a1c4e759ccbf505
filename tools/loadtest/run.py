"""Running the load: the set-up phase, then the measured window, from one or several worker processes."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx

from server.client import STREAM_FRAGMENT_BYTES
from tools.raw_http import RawHttpClient

from .clients import (
    HTTP_CLIENTS,
    SCENE_OBJECT_IDS,
    Uploads,
    _http_client,
    _register_client,
    _setup_http,
    _stream_client,
    _stream_open,
    _stream_options,
    scene_frame,
)
from .stats import (
    Stats,
    _counter_deltas,
    _generator_summary,
    _histogram_means,
    _labelled,
    _metric,
    _setup_summary,
    _stage_gpu_p50_ms,
)

__all__ = ["Job", "check_loopback", "run_load"]


LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})


_TRACK_URL_MODES = ("http-binary", "stream")  # the modes a --track-url (the ingest workers' port) serves


def check_loopback(url: str) -> httpx.URL:
    """The parsed URL; ValueError unless it is http(s) on a loopback host."""
    parsed = httpx.URL(url)
    if parsed.scheme not in ("http", "https") or parsed.host not in LOOPBACK_HOSTS:
        raise ValueError(f"refusing to load {url!r}: only http(s)://127.0.0.1, localhost or [::1] are allowed")
    return parsed


@dataclass(frozen=True)
class Job:
    """What one worker process runs (picklable)."""

    url: str
    api_key: str | None
    mode: str
    clients: int
    registers_alongside: int
    max_requests: int
    register_interval_s: float
    duration_s: float
    tracks: int
    image_hw: tuple[int, int]
    object_id: str
    on_diverge: str = "reregister"
    setup_timeout_s: float | None = 60.0  # None: no set-up phase (every client registers inside the window)
    barrier: Any = None  # a Manager barrier: every process starts its clock when all are set up
    announce: bool = False  # print a line to stderr when the window starts (one process does)
    track_url: str | None = None  # where the tracks go (http-binary only); None: ``url``
    fragment_bytes: int = STREAM_FRAGMENT_BYTES  # stream messages as WebSocket fragments of this size (0: one frame each)
    http_client: str = "raw"  # http-binary tracks: one tools.raw_http connection per client, or the shared httpx pool
    scene: str = "synthetic"  # what the frames show (clients.scene_frame)


async def _run_job(job: Job) -> dict:
    headers = {"Authorization": f"Bearer {job.api_key}"} if job.api_key else {}
    up = Uploads(*job.image_hw, fragment_bytes=job.fragment_bytes, scene=job.scene)
    stream = job.mode.startswith("stream")
    if stream:
        import websockets.asyncio.client  # noqa: F401 - imported before the clock starts
    stream_base = job.url if job.track_url is None else job.track_url  # a stream's connection is all its tracks
    ws_url = stream_base.replace("http://", "ws://", 1).replace("https://", "wss://", 1).rstrip("/") + "/track/stream"
    limits = httpx.Limits(max_connections=job.clients + job.registers_alongside + 2)
    async with contextlib.AsyncExitStack() as clients:
        client = await clients.enter_async_context(
            httpx.AsyncClient(base_url=job.url, headers=headers, timeout=120.0, limits=limits))
        track_client = client if job.track_url is None else await clients.enter_async_context(
            httpx.AsyncClient(base_url=job.track_url, headers=headers, timeout=120.0,
                              limits=httpx.Limits(max_connections=job.clients + 2)))
        setup_started = time.time()
        setup = Stats(max_requests=10**9, deadline=time.monotonic() + (job.setup_timeout_s or 0.0))
        ready: list[Any] = [None] * job.clients
        if job.setup_timeout_s is not None:  # every track client obtains its session before the clock
            options = _stream_options(job.mode == "stream-deflate")
            ready = await asyncio.gather(*(
                _stream_open(ws_url, headers, options, setup, up, job.object_id) if stream
                else _setup_http(client, setup, up, job.object_id) for _ in range(job.clients)))
        setup_ended = time.time()
        if job.barrier is not None:  # the others' set-up may still run: wait at most theirs, plus start-up
            await asyncio.to_thread(job.barrier.wait, (job.setup_timeout_s or 0.0) + 300.0)
        started = time.time()
        cpu_started = time.process_time()  # this process's CPU time (every thread): is the generator the bound?
        stats = Stats(max_requests=job.max_requests, deadline=time.monotonic() + job.duration_s)
        if job.announce:  # e.g. for a profiler that must sample the window, not the set-up
            print(f"loadtest: set-up done ({sum(s is not None for s in ready)}/{job.clients} sessions of this process "
                  f"ready); the window of {job.duration_s:g} s starts", file=sys.stderr, flush=True)
        if stream:
            loops = [_stream_client(ws_url, headers, stats, up, job.object_id, job.tracks, job.mode == "stream-deflate",
                                    job.on_diverge, session) for session in ready]
        else:
            raw = job.mode == "http-binary" and job.http_client == "raw"
            tracks_by = [RawHttpClient(job.track_url or job.url, headers) if raw else track_client for _ in ready]
            for connection in tracks_by if raw else ():  # each closed with the job's other clients
                clients.push_async_callback(connection.aclose)
            loops = [_http_client(client, stats, up, job.object_id, job.tracks, job.mode, job.on_diverge, session,
                                  tracks) for session, tracks in zip(ready, tracks_by, strict=True)]
        loops += [_register_client(client, stats, up, job.object_id, job.register_interval_s)
                  for _ in range(job.registers_alongside)]
        await asyncio.gather(*loops)
        cpu_s = time.process_time() - cpu_started
    setup_part = {"stats": setup.to_dict(), "started": setup_started, "ended": setup_ended, "clients": job.clients,
                  "ready": sum(session is not None for session in ready)}
    ended = time.time()
    return {**stats.to_dict(), "started": started, "ended": ended, "setup": setup_part,
            "cpu_fraction": round(cpu_s / max(ended - started, 1e-9), 3)}


def _worker(job: Job) -> dict:
    return asyncio.run(_run_job(job))


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


async def _prepare(url: str, api_key: str | None, object_id: str | None, scene: str) -> tuple[str, str]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120.0) as client:
        oid = object_id or await _ensure_object(client, scene)
        return oid, (await client.get("/metrics")).text


async def _scrape(url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30.0) as client:
        return (await client.get("/metrics")).text


def run_load(url: str, *, clients: int, duration_s: float, max_requests: int, tracks: int,
             image_hw: tuple[int, int], api_key: str | None, object_id: str | None, mode: str = "http-png",
             processes: int = 1, registers_alongside: int = 0, register_rate: float = 5.0,
             on_diverge: str = "reregister", setup_timeout_s: float | None = 60.0,
             track_url: str | None = None, fragment_bytes: int = STREAM_FRAGMENT_BYTES,
             http_client: str = "raw", scene: str = "synthetic") -> dict:
    """Run the load from ``processes`` worker processes (1 = in this process) and summarise it.

    setup_timeout_s: how long the set-up phase (every track client obtains its session before the
    measured window) may take; None = no set-up (the clients register inside the window).
    track_url: where every ``POST /track/binary`` (``mode="http-binary"``) or every stream connection (the stream
    modes) goes; None: ``url``.
    fragment_bytes: the stream modes send each message as WebSocket fragments of this size
    (:data:`server.client.STREAM_FRAGMENT_BYTES`, the default); 0 sends each message as one frame.
    http_client: ``http-binary`` tracks go through one :class:`tools.raw_http.RawHttpClient` connection per client
    (``raw``, ~0.6 ms of client CPU per 640x480 request) or the shared ``httpx`` pool (``httpx``, ~2 ms); the
    other requests (registers, deletes, the other modes) always use ``httpx``.
    scene: what the frames show (:func:`~tools.loadtest.clients.scene_frame`; ``bundled`` is 640x480 only), and
    the object uploaded for it unless ``object_id`` is given."""
    if http_client not in HTTP_CLIENTS:
        raise ValueError(f"http_client must be one of {HTTP_CLIENTS}, got {http_client!r}")
    if fragment_bytes < 0:
        raise ValueError(f"fragment_bytes must be >= 0, got {fragment_bytes}")
    check_loopback(url)
    if track_url is not None:
        check_loopback(track_url)
        if mode not in _TRACK_URL_MODES:
            raise ValueError(f"track_url applies to modes {', '.join(_TRACK_URL_MODES)} only, got mode {mode!r}")
    scene_frame(scene, *image_hw)  # an unknown scene or a size it lacks fails here, before any process starts
    oid, before = asyncio.run(_prepare(url, api_key, object_id, scene))
    processes = max(1, min(processes, clients + registers_alongside))
    interval = registers_alongside / register_rate if register_rate > 0 else 0.0  # per alongside client
    shares = [(c, r, m, interval) for c, r, m in zip(_split(clients, processes), _split(registers_alongside, processes),
                                                     _split(max_requests, processes), strict=True)]
    if processes == 1:
        parts = [_worker(Job(url, api_key, mode, *shares[0], duration_s, tracks, image_hw, oid, on_diverge,
                             setup_timeout_s, announce=True, track_url=track_url, fragment_bytes=fragment_bytes,
                             http_client=http_client, scene=scene))]
    else:
        ctx = multiprocessing.get_context("spawn")
        with ctx.Manager() as manager, ctx.Pool(processes) as pool:
            barrier = manager.Barrier(processes)
            jobs = [Job(url, api_key, mode, *share, duration_s, tracks, image_hw, oid, on_diverge, setup_timeout_s,
                        barrier, announce=i == 0, track_url=track_url, fragment_bytes=fragment_bytes,
                        http_client=http_client, scene=scene)
                    for i, share in enumerate(shares)]
            parts = pool.map(_worker, jobs)
    elapsed = max(p["ended"] for p in parts) - min(p["started"] for p in parts)
    stats = Stats(max_requests=max_requests, deadline=0.0)
    for part in parts:
        stats.merge(part)
    summary = stats.summary(elapsed)
    summary["setup"] = None if setup_timeout_s is None else _setup_summary([p["setup"] for p in parts], setup_timeout_s)
    summary["load_generator"] = _generator_summary([p["cpu_fraction"] for p in parts])
    after = asyncio.run(_scrape(url, api_key))
    summary["object_id"] = oid
    summary["server_phases_ms"] = _histogram_means(before, after, "fp_request_phase_seconds", "phase")
    summary["server_stages_ms"] = _histogram_means(before, after, "fp_pose_stage_duration_seconds", "stage")
    summary["server_counts"] = _counter_deltas(before, after)
    summary["server_gpu_p50_ms"] = _stage_gpu_p50_ms(after)
    summary["server_track_batches"] = _metric(after, "fp_track_batches_total")
    summary["server_track_batched_requests"] = _metric(after, "fp_track_batched_requests_total")
    summary["server_shed"] = _labelled(after, "fp_requests_shed_total")
    summary["server_stream_frames_skipped"] = _metric(after, "fp_stream_frames_skipped_total")
    return summary


async def _ensure_object(client: httpx.AsyncClient, scene: str = "synthetic") -> str:
    """Upload the scene's object unless it is there already: the procedural block as ``loadtest_block``, or the
    bundled sequence's textured mesh as ``loadtest_bundled``."""
    object_id = SCENE_OBJECT_IDS[scene]
    listing = await client.get("/objects")
    listing.raise_for_status()
    if object_id not in {o["object_id"] for o in listing.json()["objects"]}:
        if scene == "bundled":
            from foundationpose.demo.dataset import BUNDLED_SEQUENCE_DIR

            mesh = BUNDLED_SEQUENCE_DIR / "mesh"
            files = {"mesh": ("textured_simple.obj", (mesh / "textured_simple.obj").read_bytes()),
                     "texture": ("texture_map.png", (mesh / "texture_map.png").read_bytes())}
        else:
            from foundationpose.synthetic.meshes import make_procedural_mesh

            files = {"mesh": ("block.ply", make_procedural_mesh("vertex_color_asym").export(file_type="ply"))}
        response = await client.post("/objects", data={"object_id": object_id}, files=files)
        response.raise_for_status()
    return object_id
