"""Bounded load test of the pose service, loopback only, clients in several processes; prints one JSON summary.

    python tools/loadtest.py --spawn --clients 4 --duration-s 20                 # start a tiny server itself
    python tools/loadtest.py --url http://127.0.0.1:8000 --clients 64 --processes 8 --mode stream
    python tools/loadtest.py --url http://127.0.0.1:8000 --clients 64 --processes 8 --mode http-raw \
        --registers-alongside 2 --tracks-per-register 1000

``--clients`` concurrent clients are spread over ``--processes`` worker processes (each an asyncio
loop), so the load generator is not the bottleneck. Each client loops: register on a synthetic frame,
then ``--tracks-per-register`` tracks of that session, then end the session. ``--mode``:

* ``http-png``: ``POST /track`` with PNG frames (multipart), ``DELETE /sessions/{id}`` at the end;
* ``http-raw``: ``POST /track`` with raw frames (``rgb_shape`` / ``depth_shape`` / ``depth_dtype`` fields);
* ``http-binary``: ``POST /track/binary``, raw frames in one binary body (packed once per session);
* ``stream``: ``WS /track/stream``, one connection per session, the next frame after each answer;
* ``stream-deflate``: the same, offering ``permessage-deflate`` as ``websockets``' default client does
  (``python -m server`` refuses it; against a server that accepts it, this shows what zlib costs per frame).

``--registers-alongside N`` adds N clients that only register (HTTP, PNG), offering ``--register-rate``
registers/s together, to see registers/s under track load.

Random weights make tracking drift out of the working range after a few hundred steps, and every later
track of that session is a 422 naming ``pose``: such a track is counted in ``diverged`` (not as an
error), and the client registers a new session (``--on-diverge reregister``; a stream reconnects) or
goes on with stateless tracks from the registered pose (``--on-diverge stateless``). Latency
percentiles are of answered (status < 400) requests only; refusals and errors are counted by status. The run stops at ``--duration-s`` or after ``--max-requests`` requests, whichever comes
first. A 503/429 is counted as a refusal and the client waits the server's ``Retry-After-Ms`` (at most
0.5 s) before going on.

Only loopback targets are allowed (127.0.0.1, localhost, ::1): this tool must never load someone
else's server. ``--spawn`` runs ``python -m server`` with a tiny configuration (4 hypotheses, 1
iteration, random weights unless ``--weights``) on a free 127.0.0.1 port with a random API key and a
temporary objects directory, waits for ``/readyz`` and stops it at the end.

Output (stdout): ``{"requests", "requests_per_s", "tracks_per_s", "registers_per_s", "endpoints": {name:
{count, ok, diverged, p50_ms, p90_ms, p99_ms, mean_ms, per_s, active_per_s, errors_by_status}}, "refusals",
"errors_by_status", "diverged", "transport_errors", "refusals_without_retry_after", "stream_outside_phases_ms": {p50_ms,
p90_ms, p99_ms}, "server_phases_ms": {endpoint: {phase: mean ms}}, "server_stages_ms": ...}`` (``per_s`` over
the whole run, ``active_per_s`` between the endpoint's first and last answer, i.e. without the ramp-up;
``refusals_without_retry_after`` counts the 429/503 answers, by ``"endpoint status"``, that lacked a
``Retry-After`` header; ``stream_outside_phases_ms``: per answered stream frame, the round trip minus the
server's phases in its ``timings_ms``, i.e. transport and client time); progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from deploy_core.timing import percentile  # noqa: E402
from foundationpose.synthetic.scenes import synthetic_frame  # noqa: E402
from server import codecs  # noqa: E402
from server.phases import accounted_ms  # noqa: E402

MODES = ("http-png", "http-raw", "http-binary", "stream", "stream-deflate")
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
OBJECT_ID = "loadtest_block"


def check_loopback(url: str) -> httpx.URL:
    """The parsed URL; ValueError unless it is http(s) on a loopback host."""
    parsed = httpx.URL(url)
    if parsed.scheme not in ("http", "https") or parsed.host not in LOOPBACK_HOSTS:
        raise ValueError(f"refusing to load {url!r}: only http(s)://127.0.0.1, localhost or [::1] are allowed")
    return parsed


@dataclass
class Stats:
    """Latencies (ms, answered requests only) and statuses per endpoint, diverged tracks apart; a shared
    request budget."""

    max_requests: int
    deadline: float
    sent: int = 0
    latencies_ms: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))  # status < 400 only
    statuses: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    diverged: Counter = field(default_factory=Counter)  # endpoint -> tracks refused for the pose's range
    transport_errors: Counter = field(default_factory=Counter)
    error_samples: dict[str, str] = field(default_factory=dict)  # "endpoint status" -> first error message
    refusals_without_retry_after: Counter = field(default_factory=Counter)  # "endpoint status" -> count
    ok_window: dict[str, tuple[float, float]] = field(default_factory=dict)  # first / last answered, time.time()
    outside_ms: list[float] = field(default_factory=list)  # per answered stream frame: round trip - server phases

    def record(self, name: str, ms: float, status: int) -> None:
        self.statuses[name][status] += 1
        if status < 400:  # percentiles of answered requests; the window: throughput without the ramp-up
            self.latencies_ms[name].append(ms)
            now = time.time()
            first, _ = self.ok_window.get(name, (now, now))
            self.ok_window[name] = (first, now)

    def to_dict(self) -> dict:
        """Plain data (picklable) for the parent process."""
        return {"latencies_ms": dict(self.latencies_ms), "statuses": {k: dict(v) for k, v in self.statuses.items()},
                "diverged": dict(self.diverged),
                "transport_errors": dict(self.transport_errors), "error_samples": dict(self.error_samples),
                "refusals_without_retry_after": dict(self.refusals_without_retry_after),
                "ok_window": dict(self.ok_window), "outside_ms": list(self.outside_ms)}

    def merge(self, part: dict) -> None:
        for name, (first, last) in part.get("ok_window", {}).items():
            old = self.ok_window.get(name, (first, last))
            self.ok_window[name] = (min(old[0], first), max(old[1], last))
        for name, values in part["latencies_ms"].items():
            self.latencies_ms[name].extend(values)
        for name, counts in part["statuses"].items():
            self.statuses[name].update(counts)
        self.transport_errors.update(part["transport_errors"])
        self.diverged.update(part.get("diverged", {}))
        self.refusals_without_retry_after.update(part.get("refusals_without_retry_after", {}))
        self.outside_ms.extend(part.get("outside_ms", ()))
        for key, text in part["error_samples"].items():
            self.error_samples.setdefault(key, text)

    def take(self) -> bool:
        """Claim one request of the budget; False once the run is over."""
        if self.sent >= self.max_requests or time.monotonic() >= self.deadline:
            return False
        self.sent += 1
        return True

    def summary(self, elapsed_s: float) -> dict:
        endpoints = {}
        all_errors: Counter = Counter()
        for name in sorted(set(self.statuses) | set(self.diverged)):
            lat = sorted(self.latencies_ms[name])
            statuses = self.statuses[name]
            errors = {str(k): v for k, v in sorted(statuses.items()) if k >= 400}
            all_errors.update(errors)
            ok = sum(v for k, v in statuses.items() if k < 400)
            endpoints[name] = {
                "count": sum(statuses.values()) + self.diverged[name],
                "ok": ok,
                "diverged": self.diverged[name],
                "p50_ms": round(percentile(lat, 50), 2) if lat else None,
                "p90_ms": round(percentile(lat, 90), 2) if lat else None,
                "p99_ms": round(percentile(lat, 99), 2) if lat else None,
                "mean_ms": round(sum(lat) / len(lat), 2) if lat else None,
                "per_s": round(ok / elapsed_s, 2) if elapsed_s > 0 else None,
                "active_per_s": _rate(ok, self.ok_window.get(name)),
                "errors_by_status": errors,
            }
        total = sum(e["count"] for e in endpoints.values())

        def ok_per_s(*names: str) -> float | None:
            n = sum(endpoints[e]["ok"] for e in names if e in endpoints)
            return round(n / elapsed_s, 2) if elapsed_s > 0 else None

        return {
            "requests": total,
            "elapsed_s": round(elapsed_s, 2),
            "requests_per_s": round(total / elapsed_s, 2) if elapsed_s > 0 else None,
            "tracks_per_s": ok_per_s("track", "stream_frame"),
            "registers_per_s": ok_per_s("register", "stream_register", "register_alongside"),
            "refusals": {name: sum(v for k, v in e["errors_by_status"].items() if k in ("429", "503"))
                         for name, e in endpoints.items()},
            "endpoints": endpoints,
            "errors_by_status": dict(sorted(all_errors.items())),
            "diverged": dict(sorted(self.diverged.items())),
            "transport_errors": dict(self.transport_errors),
            "refusals_without_retry_after": dict(sorted(self.refusals_without_retry_after.items())),
            "error_samples": dict(sorted(self.error_samples.items())),
            "stream_outside_phases_ms": _percentiles(self.outside_ms),
        }


def _percentiles(values: list[float]) -> dict[str, float | None]:
    ordered = sorted(values)
    return {f"p{q}_ms": round(percentile(ordered, q), 2) if ordered else None for q in (50, 90, 99)}


def _rate(n: int, window: tuple[float, float] | None) -> float | None:
    """Answers per second between the first and the last answer (None with fewer than two)."""
    if window is None or n < 2 or window[1] <= window[0]:
        return None
    return round((n - 1) / (window[1] - window[0]), 2)


class Uploads:
    """The synthetic frame, encoded once per process: PNG parts, raw parts and stream messages."""

    def __init__(self, height: int, width: int) -> None:
        from server.client import frame_message, raw_track_form, register_message, track_body

        frame = synthetic_frame(height, width)
        self.frame = frame
        self.K = json.dumps(frame.K.tolist())
        self.rgb = codecs.encode_rgb_png(frame.rgb)
        self.depth = codecs.encode_depth_png_mm(frame.depth_m)
        self.mask = codecs.encode_mask_png(frame.mask)
        self.raw_fields, self.raw_files = raw_track_form(frame.rgb, frame.depth_m)
        self.register_message = lambda object_id: register_message(object_id, frame.K, frame.rgb, frame.depth_m,
                                                                   frame.mask)
        self.frame_message = lambda n: frame_message(n, frame.rgb, frame.depth_m)
        # POST /track/binary bodies: packed once per session (or per stateless start pose), before the clock
        self.binary_body = lambda **header: track_body(frame.rgb, frame.depth_m, **header)

    def track_request(self, mode: str, *, session_id: str | None = None, pose: list | None = None,
                      object_id: str | None = None, body: bytes | None = None) -> tuple[str, dict]:
        """(path, httpx request kwargs) of one track: of the session, or stateless from ``pose``."""
        if mode == "http-binary":
            from server.client import BINARY_HEADERS

            return "/track/binary", {"content": body, "headers": BINARY_HEADERS}
        fields = {"session_id": session_id} if session_id is not None else \
            {"object_id": object_id, "pose": json.dumps(pose), "K": self.K}
        if mode == "http-raw":
            return "/track", {"data": {**fields, **self.raw_fields}, "files": self.raw_files}
        return "/track", {"data": fields, "files": {"rgb": ("rgb.png", self.rgb), "depth": ("depth.png", self.depth)}}


def _retry_s(response: httpx.Response) -> float:
    with contextlib.suppress(TypeError, ValueError):
        return min(0.5, float(response.headers.get("retry-after-ms")) / 1e3)
    with contextlib.suppress(TypeError, ValueError):
        return min(0.5, float(response.headers.get("retry-after", "0.1")))
    return 0.1


def _error_of(response: httpx.Response) -> dict:
    with contextlib.suppress(ValueError, KeyError, TypeError):
        error = response.json()["error"]
        if isinstance(error, dict):
            return error
    return {}


def is_diverged(status: int, error: dict) -> bool:
    """A track refused because the pose it starts from left the working range (422 naming ``pose``): with
    random weights tracking drifts there after a few hundred steps. Not the server's failure: counted apart."""
    return status == 422 and error.get("field") == "pose"


async def _request(client: httpx.AsyncClient, stats: Stats, name: str, method: str, path: str, *,
                   divergence: bool = False, **kw) -> httpx.Response | None:
    """One request, timed and counted; ``divergence``: a diverged track (:func:`is_diverged`) is counted in
    ``stats.diverged`` instead of as a 422."""
    started = time.perf_counter()
    try:
        response = await client.request(method, path, **kw)
    except httpx.HTTPError as exc:
        stats.transport_errors[type(exc).__name__] += 1
        return None
    ms = (time.perf_counter() - started) * 1e3
    status = response.status_code
    error = _error_of(response) if status >= 400 else {}
    if divergence and is_diverged(status, error):
        stats.diverged[name] += 1
        return response
    stats.record(name, ms, status)
    if status >= 400 and f"{name} {status}" not in stats.error_samples:
        stats.error_samples[f"{name} {status}"] = str(error.get("message", response.text))[:300]
    if status in (429, 503):
        if "retry-after" not in response.headers:
            stats.refusals_without_retry_after[f"{name} {status}"] += 1
        await asyncio.sleep(_retry_s(response))
    return response


async def _register(client: httpx.AsyncClient, stats: Stats, up: Uploads, object_id: str,
                    name: str) -> tuple[str, list] | None:
    """(session_id, registered pose), or None when the register was not answered 200."""
    reg = await _request(client, stats, name, "POST", "/register", data={"object_id": object_id, "K": up.K},
                         files={"rgb": ("rgb.png", up.rgb), "depth": ("depth.png", up.depth),
                                "mask": ("mask.png", up.mask)})
    if reg is None or reg.status_code != 200:
        return None
    body = reg.json()
    return body["session_id"], body["pose"]


async def _http_client(client: httpx.AsyncClient, stats: Stats, up: Uploads, object_id: str, tracks: int,
                       mode: str, on_diverge: str = "reregister") -> None:
    """Register, ``tracks`` tracks of the session, end it; again. A diverged track (see :func:`is_diverged`)
    ends the session early (``reregister``: the next loop registers afresh) or (``stateless``) turns the
    session's remaining tracks into stateless ones from the registered pose, which cannot drift."""
    while stats.take():
        registered = await _register(client, stats, up, object_id, "register")
        if registered is None:
            continue
        session_id, start = registered
        body = up.binary_body(session_id=session_id) if mode == "http-binary" else None
        path, kw = up.track_request(mode, session_id=session_id, body=body)
        stateless = False
        for _ in range(tracks):
            if not stats.take():
                break
            tr = await _request(client, stats, "track", "POST", path, divergence=True, **kw)
            if tr is None:
                continue
            if tr.status_code == 404:
                break
            if is_diverged(tr.status_code, _error_of(tr)):
                if on_diverge != "stateless" or stateless:  # (from the registered pose it cannot drift)
                    break
                stateless = True
                body = up.binary_body(object_id=object_id, pose=start, K=up.frame.K) if mode == "http-binary" else None
                path, kw = up.track_request(mode, pose=start, object_id=object_id, body=body)
        if stats.take():
            await _request(client, stats, "delete_session", "DELETE", f"/sessions/{session_id}")


async def _register_client(client: httpx.AsyncClient, stats: Stats, up: Uploads, object_id: str,
                           interval_s: float) -> None:
    """Registers only (the 'registers alongside' clients), one every ``interval_s`` at most; each session
    is deleted at once. Paced, so that they measure registers/s under load instead of filling the lane."""
    next_start = time.monotonic()
    while stats.take():
        await asyncio.sleep(max(0.0, next_start - time.monotonic()))
        next_start = max(next_start + interval_s, time.monotonic())
        registered = await _register(client, stats, up, object_id, "register_alongside")
        if registered is not None:
            await client.delete(f"/sessions/{registered[0]}")


async def _stream_client(ws_url: str, headers: dict, stats: Stats, up: Uploads, object_id: str, tracks: int,
                         deflate: bool = False) -> None:
    from websockets.asyncio.client import connect
    from websockets.exceptions import WebSocketException

    from server.client import STREAM_CONNECT_OPTIONS

    options = {**STREAM_CONNECT_OPTIONS, "compression": "deflate"} if deflate else STREAM_CONNECT_OPTIONS
    while stats.take():
        try:
            async with connect(ws_url, additional_headers=headers, **options) as ws:
                started = time.perf_counter()
                await ws.send(up.register_message(object_id))
                reply = json.loads(await ws.recv())
                stats.record("stream_register", (time.perf_counter() - started) * 1e3,
                             200 if reply["type"] == "registered" else _status_of(reply))
                if reply["type"] != "registered":
                    await asyncio.sleep(min(0.5, reply["error"].get("retry_after_ms", 100) / 1e3))
                    continue
                for n in range(1, tracks + 1):
                    if not stats.take():
                        break
                    message = up.frame_message(n)  # packed before the clock, as the HTTP modes' bodies are
                    started = time.perf_counter()
                    await ws.send(message)
                    reply = json.loads(await ws.recv())
                    round_trip_ms = (time.perf_counter() - started) * 1e3
                    status = 200 if reply["type"] == "pose" else _status_of(reply)
                    if status != 200 and is_diverged(status, reply.get("error", {})):
                        stats.diverged["stream_frame"] += 1
                        break  # the session cannot recover: a new connection registers afresh
                    stats.record("stream_frame", round_trip_ms, status)
                    if status == 200:  # the transport's share (and this client's): outside every server phase
                        stats.outside_ms.append(round_trip_ms - accounted_ms(reply["timings_ms"]))
                    if status != 200 and f"stream_frame {status}" not in stats.error_samples:
                        stats.error_samples[f"stream_frame {status}"] = reply["error"]["message"][:300]
        except (OSError, WebSocketException) as exc:
            stats.transport_errors[type(exc).__name__] += 1


def _status_of(reply: dict) -> int:
    kind = reply.get("error", {}).get("type", "")
    return {"InputError": 422, "SessionBusyError": 429, "OverloadedError": 503, "BusyError": 503,
            "NotReadyError": 503, "UnknownObjectError": 404, "UnknownSessionError": 404,
            "RequestTimeoutError": 504}.get(kind, 500)


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
    barrier: Any = None  # a Manager barrier: every process starts its clock when all are set up


async def _run_job(job: Job) -> dict:
    headers = {"Authorization": f"Bearer {job.api_key}"} if job.api_key else {}
    up = Uploads(*job.image_hw)
    if job.mode.startswith("stream"):
        import websockets.asyncio.client  # noqa: F401 - imported before the clock starts
    if job.barrier is not None:
        await asyncio.to_thread(job.barrier.wait)
    started = time.time()
    stats = Stats(max_requests=job.max_requests, deadline=time.monotonic() + job.duration_s)
    limits = httpx.Limits(max_connections=job.clients + job.registers_alongside + 2)
    async with httpx.AsyncClient(base_url=job.url, headers=headers, timeout=120.0, limits=limits) as client:
        if job.mode.startswith("stream"):
            ws_url = job.url.replace("http://", "ws://", 1).replace("https://", "wss://", 1).rstrip("/") + "/track/stream"
            loops = [_stream_client(ws_url, headers, stats, up, job.object_id, job.tracks, job.mode == "stream-deflate")
                     for _ in range(job.clients)]
        else:
            loops = [_http_client(client, stats, up, job.object_id, job.tracks, job.mode, job.on_diverge)
                     for _ in range(job.clients)]
        loops += [_register_client(client, stats, up, job.object_id, job.register_interval_s)
                  for _ in range(job.registers_alongside)]
        await asyncio.gather(*loops)
    return {**stats.to_dict(), "started": started, "ended": time.time()}


def _worker(job: Job) -> dict:
    return asyncio.run(_run_job(job))


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


async def _prepare(url: str, api_key: str | None, object_id: str | None) -> tuple[str, str]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120.0) as client:
        oid = object_id or await _ensure_object(client)
        return oid, (await client.get("/metrics")).text


async def _scrape(url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30.0) as client:
        return (await client.get("/metrics")).text


def run_load(url: str, *, clients: int, duration_s: float, max_requests: int, tracks: int,
             image_hw: tuple[int, int], api_key: str | None, object_id: str | None, mode: str = "http-png",
             processes: int = 1, registers_alongside: int = 0, register_rate: float = 5.0,
             on_diverge: str = "reregister") -> dict:
    """Run the load from ``processes`` worker processes (1 = in this process) and summarise it."""
    check_loopback(url)
    oid, before = asyncio.run(_prepare(url, api_key, object_id))
    processes = max(1, min(processes, clients + registers_alongside))
    interval = registers_alongside / register_rate if register_rate > 0 else 0.0  # per alongside client
    shares = [(c, r, m, interval) for c, r, m in zip(_split(clients, processes), _split(registers_alongside, processes),
                                                     _split(max_requests, processes), strict=True)]
    if processes == 1:
        parts = [_worker(Job(url, api_key, mode, *shares[0], duration_s, tracks, image_hw, oid, on_diverge))]
    else:
        ctx = multiprocessing.get_context("spawn")
        with ctx.Manager() as manager, ctx.Pool(processes) as pool:
            barrier = manager.Barrier(processes)
            jobs = [Job(url, api_key, mode, *share, duration_s, tracks, image_hw, oid, on_diverge, barrier)
                    for share in shares]
            parts = pool.map(_worker, jobs)
    elapsed = max(p["ended"] for p in parts) - min(p["started"] for p in parts)
    stats = Stats(max_requests=max_requests, deadline=0.0)
    for part in parts:
        stats.merge(part)
    summary = stats.summary(elapsed)
    after = asyncio.run(_scrape(url, api_key))
    summary["object_id"] = oid
    summary["server_phases_ms"] = _histogram_means(before, after, "fp_request_phase_seconds", "phase")
    summary["server_stages_ms"] = _histogram_means(before, after, "fp_pose_stage_duration_seconds", "stage")
    summary["server_track_batches"] = _metric(after, "fp_track_batches_total")
    summary["server_track_batched_requests"] = _metric(after, "fp_track_batched_requests_total")
    summary["server_shed"] = _labelled(after, "fp_requests_shed_total")
    summary["server_stream_frames_skipped"] = _metric(after, "fp_stream_frames_skipped_total")
    return summary


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def _labelled(text: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of every sample of ``name`` (labels as written in the exposition)."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, _, value = line[len(name):].rpartition(" ")
            out[labels.strip("{}")] = float(value)
    return out


def _histogram_means(before: str, after: str, name: str, key: str) -> dict[str, dict[str, float]]:
    """Mean ms per (endpoint, ``key``) over the run, from the _sum/_count deltas of a histogram."""
    def read(text: str) -> dict[str, float]:
        return {**{f"sum|{k}": v for k, v in _labelled(text, name + "_sum").items()},
                **{f"count|{k}": v for k, v in _labelled(text, name + "_count").items()}}

    b, a = read(before), read(after)
    out: dict[str, dict[str, float]] = {}
    for label_key, total in a.items():
        kind, labels = label_key.split("|", 1)
        if kind != "sum":
            continue
        count = a.get(f"count|{labels}", 0.0) - b.get(f"count|{labels}", 0.0)
        if count <= 0:
            continue
        fields = dict(part.split("=", 1) for part in labels.split(","))
        endpoint, item = fields["endpoint"].strip('"'), fields[key].strip('"')
        out.setdefault(endpoint, {})[item] = round((total - b.get(label_key, 0.0)) / count * 1e3, 3)
    return out


async def _ensure_object(client: httpx.AsyncClient) -> str:
    """Upload the procedural block as ``loadtest_block`` unless it is there already."""
    listing = await client.get("/objects")
    listing.raise_for_status()
    if OBJECT_ID not in {o["object_id"] for o in listing.json()["objects"]}:
        from foundationpose.synthetic.meshes import make_procedural_mesh

        ply = make_procedural_mesh("vertex_color_asym").export(file_type="ply")
        response = await client.post("/objects", data={"object_id": OBJECT_ID}, files={"mesh": ("block.ply", ply)})
        response.raise_for_status()
    return OBJECT_ID


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def spawned_server(args: argparse.Namespace, api_key: str, extra_args: tuple[str, ...] = ()) -> Iterator[tuple[str, dict]]:
    """Run ``python -m server`` (tiny config, then ``extra_args``) on a free loopback port until the block
    exits; ``server_info`` has the command, port, ``pid`` and start-up seconds (and the exit code after)."""
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="fp-loadtest-") as tmp:
        objects = Path(tmp) / "objects"
        objects.mkdir()
        log_path = Path(tmp) / "server.log"
        command = [sys.executable, "-m", "server", "--objects", str(objects), "--host", "127.0.0.1", "--port", str(port),
                   "--device", args.device, "--hypotheses", str(args.hypotheses),
                   "--register-iterations", str(args.register_iterations),
                   "--track-iterations", str(args.track_iterations),
                   "--max-image", f"{args.image_hw[1]}x{args.image_hw[0]}", "--log-level", "WARNING"]
        if args.weights:
            command += ["--weights", args.weights]
        command += list(extra_args)
        env = {**os.environ, "FP_API_KEY": api_key}
        server_info = {"command": " ".join(command[1:]), "port": port}
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
            server_info["pid"] = proc.pid
            try:
                url = f"http://127.0.0.1:{port}"
                started = time.monotonic()
                _wait_ready(url, api_key, proc, args.ready_timeout_s, log_path)
                server_info["startup_s"] = round(time.monotonic() - started, 1)
                yield url, server_info
            finally:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)  # uvicorn: graceful shutdown
                    try:
                        proc.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
                server_info["exit_code"] = proc.returncode


def _wait_ready(url: str, api_key: str, proc: subprocess.Popen, timeout_s: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    headers = {"Authorization": f"Bearer {api_key}"}
    with httpx.Client(base_url=url, headers=headers, timeout=2.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode} during start-up:\n"
                                   + log_path.read_text(errors="replace")[-4000:])
            with contextlib.suppress(httpx.HTTPError):
                if client.get("/readyz").status_code == 200:
                    return
            time.sleep(0.2)  # polling another process's readiness: nothing to wait on but time
    raise TimeoutError(f"the server was not ready within {timeout_s} s:\n" + log_path.read_text(errors="replace")[-4000:])


def _parse_hw(text: str) -> tuple[int, int]:
    from server.config import parse_image_size

    return parse_image_size(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python tools/loadtest.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server URL, loopback only (default %(default)s)")
    p.add_argument("--spawn", action="store_true", help="start a tiny server on a free 127.0.0.1 port and stop it after")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients, 1..256 (default 4)")
    p.add_argument("--processes", type=int, default=1,
                   help="worker processes the clients are spread over, 1..64 (default 1)")
    p.add_argument("--mode", choices=MODES, default="http-png",
                   help="track path: PNG multipart, raw-frame multipart, one binary body (POST /track/binary), "
                        "WS /track/stream, or the stream offering permessage-deflate (default http-png)")
    p.add_argument("--on-diverge", choices=("reregister", "stateless"), default="reregister",
                   help="HTTP modes, after a track refused for the pose's range (random weights drift there): "
                        "register a new session, or go on with stateless tracks from the registered pose "
                        "(no register-lane wait under load); streams always reconnect (default reregister)")
    p.add_argument("--registers-alongside", type=int, default=0,
                   help="extra clients that only register, to measure registers/s under load (default 0)")
    p.add_argument("--register-rate", type=float, default=5.0,
                   help="registers/s the alongside clients offer together, 0 = as fast as answered (default 5)")
    p.add_argument("--duration-s", type=float, default=20.0, help="run time cap in seconds, <= 600 (default 20)")
    p.add_argument("--max-requests", type=int, default=400, help="request cap, <= 1000000 (default 400)")
    p.add_argument("--tracks-per-register", type=int, default=5, help="tracks per session (default 5)")
    p.add_argument("--image", type=_parse_hw, default=(240, 320), dest="image_hw",
                   help="synthetic frame WIDTHxHEIGHT in pixels (default 320x240)")
    p.add_argument("--api-key", default=os.environ.get("FP_API_KEY"), help="bearer key (default $FP_API_KEY)")
    p.add_argument("--object-id", default=None, help=f"object to use (default: upload the procedural block as {OBJECT_ID})")
    p.add_argument("--device", default="cpu", help="--spawn: server device (default cpu)")
    p.add_argument("--hypotheses", type=int, default=4, help="--spawn: register hypotheses (default 4)")
    p.add_argument("--register-iterations", type=int, default=1, help="--spawn: default 1")
    p.add_argument("--track-iterations", type=int, default=1, help="--spawn: default 1")
    p.add_argument("--weights", default=None, help="--spawn: weights root (default: random weights)")
    p.add_argument("--ready-timeout-s", type=float, default=180.0, help="--spawn: wait for /readyz (default 180)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 1 <= args.clients <= 256:
        parser.error("--clients must be in 1..256")
    if not 1 <= args.processes <= 64:
        parser.error("--processes must be in 1..64")
    if not 0 < args.duration_s <= 600:
        parser.error("--duration-s must be in (0, 600]")
    if not 1 <= args.max_requests <= 1_000_000:
        parser.error("--max-requests must be in 1..1000000")
    try:
        check_loopback(args.url)
    except ValueError as exc:
        parser.error(str(exc))
    load = dict(clients=args.clients, duration_s=args.duration_s, max_requests=args.max_requests,
                tracks=args.tracks_per_register, image_hw=args.image_hw, object_id=args.object_id, mode=args.mode,
                processes=args.processes, registers_alongside=args.registers_alongside,
                register_rate=args.register_rate, on_diverge=args.on_diverge)
    settings = {"clients": args.clients, "processes": args.processes, "mode": args.mode, "on_diverge": args.on_diverge,
                "registers_alongside": args.registers_alongside, "register_rate": args.register_rate, "duration_s": args.duration_s,
                "max_requests": args.max_requests, "tracks_per_register": args.tracks_per_register,
                "image_wh": [args.image_hw[1], args.image_hw[0]]}
    if args.spawn:
        api_key = secrets.token_urlsafe(16)
        with spawned_server(args, api_key) as (url, server_info):
            print(f"server ready at {url} after {server_info['startup_s']} s; loading ...", file=sys.stderr)
            summary = run_load(url, api_key=api_key, **load)
        summary["server"] = server_info
    else:
        summary = run_load(args.url, api_key=args.api_key, **load)
    summary["settings"] = settings
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
