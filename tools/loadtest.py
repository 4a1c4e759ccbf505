"""Bounded load test of the pose service, loopback only, clients in several processes; prints one JSON summary.

    python tools/loadtest.py --spawn --clients 4 --duration-s 20                 # start a tiny server itself
    python tools/loadtest.py --url http://127.0.0.1:8000 --clients 64 --processes 8 --mode stream
    python tools/loadtest.py --url http://127.0.0.1:8000 --clients 64 --processes 8 --mode http-raw \
        --registers-alongside 2 --tracks-per-register 1000
    python tools/loadtest.py --url http://127.0.0.1:8000 --track-url http://127.0.0.1:8001 --mode http-binary
    python tools/loadtest.py --spawn --spawn-ingest-workers 4 --mode http-binary --clients 16 --processes 4

``--clients`` concurrent clients are spread over ``--processes`` worker processes (each an asyncio
loop), so the load generator is not the bottleneck. Each client loops: register on a synthetic frame,
then ``--tracks-per-register`` tracks of that session, then end the session.

Set-up, then the measured window: first every track client obtains its session (a register; a stream
keeps its connection open), waiting out each refusal as the server asks, for at most
``--setup-timeout-s``; then all worker processes start the clock together (a barrier) and the window of
``--duration-s`` begins with every session ready, so it measures tracking, not the register lane's
start-up storm (64 clients registering at once against a lane of ~10 registers/s). A client whose set-up
ran out registers inside the window. ``--no-setup``: no set-up phase, every client registers inside the
window (the old behaviour). ``--mode``:

* ``http-png``: ``POST /track`` with PNG frames (multipart), ``DELETE /sessions/{id}`` at the end;
* ``http-raw``: ``POST /track`` with raw frames (``rgb_shape`` / ``depth_shape`` / ``depth_dtype`` fields);
* ``http-binary``: ``POST /track/binary``, raw frames in one binary body (packed once per session);
  with ``--track-url`` every ``POST /track/binary`` (session and stateless tracks) goes to that URL (a
  server's ingest workers' track port, ``python -m server --ingest-workers N --ingest-port P``) and
  everything else (registers, deletes, /metrics) to ``--url``;
* ``stream``: ``WS /track/stream``, one connection per session, the next frame after each answer;
* ``stream-deflate``: the same, offering ``permessage-deflate`` as ``websockets``' default client does
  (``python -m server`` refuses it; against a server that accepts it, this shows what zlib costs per frame).

``--registers-alongside N`` adds N clients that only register (HTTP, PNG), offering ``--register-rate``
registers/s together inside the window (they have no set-up), to see registers/s under track load.

Random weights make tracking drift out of the working range after a few hundred steps, and every later
track of that session is a 422 naming ``pose``: such a track is counted in ``diverged`` (not as an
error), and the client registers a new session (``--on-diverge reregister``; a stream reconnects and
registers) or goes on from the registered pose without a register (``--on-diverge stateless``: HTTP
with stateless tracks; a stream reconnects with a ``start`` message from that pose, endpoint
``stream_start``). Latency percentiles are of answered (status < 400) requests only; refusals and
errors are counted by status. The window stops at ``--duration-s`` or after ``--max-requests``
requests, whichever comes first. A 503/429 is counted as a refusal and the client waits the server's
``Retry-After-Ms`` (else ``Retry-After``) times 1 + U(0, 0.1) (jitter), at most 10 s and never past the
end of its phase (the set-up's timeout, the window's end), then goes on (a stream sends the refused
register again on its connection).

Only loopback targets are allowed (127.0.0.1, localhost, ::1): this tool must never load someone
else's server. ``--spawn`` runs ``python -m server`` with a tiny configuration (4 hypotheses, 1
iteration, random weights unless ``--weights``) on a free 127.0.0.1 port with a random API key and a
temporary objects directory, waits for ``/readyz`` and stops it at the end; with
``--spawn-ingest-workers N`` (``--mode http-binary`` only) it also passes ``--ingest-workers N
--ingest-port P`` (another free port), waits for that port's ``/healthz`` and sends the tracks there.

Output (stdout): ``{"requests", "elapsed_s", "requests_per_s", "tracks_per_s", "registers_per_s", "endpoints": {name:
{count, ok, diverged, p50_ms, p90_ms, p99_ms, mean_ms, per_s, active_per_s, errors_by_status}}, "refusals",
"errors_by_status", "diverged", "transport_errors", "refusals_without_retry_after", "stream_outside_phases_ms": {p50_ms,
p90_ms, p99_ms}, "setup": {...}, "server_phases_ms": {endpoint: {phase: mean ms}}, "server_stages_ms": ...,
"load_generator": {processes, cpu_fraction, busiest, saturated}, "settings": {..., "url", "track_url"}}``
(``track_url``: where the track requests went, ``url`` unless ``--track-url`` or ``--spawn-ingest-workers``;
``load_generator``: each load process's CPU seconds per second of the window, ``saturated`` from 0.85 on, with a
warning on stderr: the figures may then be the generator's limit, not the server's; with ``--processes 1`` the load
runs in the calling process, whose other threads count too).
Everything but ``setup`` and the ``server_*`` keys is the measured window only (``elapsed_s`` its
length). ``setup`` (null with ``--no-setup``): ``{seconds, timeout_s, clients, sessions_ready,
registers_ok, registers_refused, register_p50_ms, register_p99_ms, errors_by_status, transport_errors,
refusals_without_retry_after, error_samples}`` (``seconds``: the first process's set-up start to the
last one's end; ``sessions_ready``: track clients that entered the window with a session).
``server_phases_ms`` / ``server_stages_ms`` are means from /metrics deltas over set-up and window
together (the track endpoints' are the window's: the set-up sends no track); the other ``server_*``
keys are the server's counters at the end. ``per_s`` over the whole window,
``active_per_s`` between the endpoint's first and last answer, i.e. without the ramp-up;
``refusals_without_retry_after`` counts the 429/503 answers, by ``"endpoint status"``, that lacked a
``Retry-After`` header (a stream's error: ``retry_after_ms``); ``stream_outside_phases_ms``: per answered stream frame, the round trip minus the
server's phases in its ``timings_ms``, i.e. transport and client time); progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
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
from server.client import STREAM_FRAGMENT_BYTES  # noqa: E402
from server.phases import accounted_ms  # noqa: E402
from tools.raw_http import RawHttpClient, RawHttpError  # noqa: E402

MODES = ("http-png", "http-raw", "http-binary", "stream", "stream-deflate")
HTTP_CLIENTS = ("raw", "httpx")  # what sends the http-binary tracks (see run_load)
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
OBJECT_ID = "loadtest_block"
RETRY_CAP_S = 10.0  # the longest wait for a Retry-After: a server asking for more is waited on this long, then asked again
RETRY_JITTER = 0.1  # waits are the server's Retry-After times 1 + U(0, this): clients refused together come back spread


_TRACK_URL_MODES = ("http-binary", "stream")  # the modes a --track-url (the ingest workers' port) serves


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

    def over(self) -> bool:
        """The budget is spent or the deadline passed."""
        return self.sent >= self.max_requests or time.monotonic() >= self.deadline

    def take(self) -> bool:
        """Claim one request of the budget; False once the run is over."""
        if self.over():
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

    def __init__(self, height: int, width: int, fragment_bytes: int = 0) -> None:
        """fragment_bytes: stream messages go out as WebSocket fragments of this size (0: each in one frame)."""
        from server.client import (
            depth_mm,
            fragments,
            frame_message,
            raw_track_form,
            register_message,
            start_message,
            track_body,
        )

        def pieces(message: bytes) -> Any:
            return fragments(message, fragment_bytes) if fragment_bytes > 0 else message

        frame = synthetic_frame(height, width)
        self.frame = frame
        depth = depth_mm(frame.depth_m)  # once: every message sends these millimetres (the conversion costs ms)
        self.K = json.dumps(frame.K.tolist())
        self.rgb = codecs.encode_rgb_png(frame.rgb)
        self.depth = codecs.encode_depth_png_mm(frame.depth_m)
        self.mask = codecs.encode_mask_png(frame.mask)
        self.raw_fields, self.raw_files = raw_track_form(frame.rgb, frame.depth_m)
        self.register_message = lambda object_id: pieces(register_message(object_id, frame.K, frame.rgb, depth,
                                                                          frame.mask))
        self.frame_message = lambda n: pieces(frame_message(n, frame.rgb, depth))
        self.start_message = lambda object_id, pose: start_message(object_id, frame.K, pose)
        # POST /track/binary bodies: packed once per session (or per stateless start pose), before the clock
        self.binary_body = lambda **header: track_body(frame.rgb, depth, **header)

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
    """The server's Retry-After-Ms (or Retry-After) in seconds; 0.1 when it sent neither."""
    with contextlib.suppress(TypeError, ValueError):
        return float(response.headers.get("retry-after-ms")) / 1e3
    with contextlib.suppress(TypeError, ValueError):
        return float(response.headers.get("retry-after", "0.1"))
    return 0.1


def retry_wait_s(retry_s: float, remaining_s: float, jitter: float) -> float:
    """How long a refused client waits: the server's ``retry_s`` times ``1 + jitter`` (``jitter`` drawn
    from [0, RETRY_JITTER]), at most RETRY_CAP_S and never past the end of its phase (``remaining_s``)."""
    return max(0.0, min(max(0.0, retry_s) * (1.0 + jitter), RETRY_CAP_S, remaining_s))


async def _pause(retry_s: float, stats: Stats) -> None:
    """Wait as :func:`retry_wait_s` says, within ``stats``' deadline."""
    remaining = stats.deadline - time.monotonic()
    await asyncio.sleep(retry_wait_s(retry_s, remaining, random.uniform(0.0, RETRY_JITTER)))


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
    except (httpx.HTTPError, RawHttpError) as exc:
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
        await _pause(_retry_s(response), stats)
    return response


async def _register(client: httpx.AsyncClient, stats: Stats, up: Uploads, object_id: str,
                    name: str) -> tuple[int | None, tuple[str, list] | None]:
    """(status, (session_id, registered pose)); status None on a transport error, the pair None unless 200."""
    reg = await _request(client, stats, name, "POST", "/register", data={"object_id": object_id, "K": up.K},
                         files={"rgb": ("rgb.png", up.rgb), "depth": ("depth.png", up.depth),
                                "mask": ("mask.png", up.mask)})
    if reg is None or reg.status_code != 200:
        return (None if reg is None else reg.status_code), None
    body = reg.json()
    return 200, (body["session_id"], body["pose"])


async def _setup_http(client: httpx.AsyncClient, setup: Stats, up: Uploads, object_id: str) -> tuple[str, list] | None:
    """Set-up of one HTTP client: register until answered, waiting out each refusal (429/503) as the server
    asks (:func:`_request`), until ``setup``'s deadline; None when it ran out or another error came."""
    while setup.take():
        status, registered = await _register(client, setup, up, object_id, "register")
        if registered is not None or status not in (429, 503):
            return registered
    return None


async def _http_client(client: httpx.AsyncClient, stats: Stats, up: Uploads, object_id: str, tracks: int,
                       mode: str, on_diverge: str = "reregister", registered: tuple[str, list] | None = None,
                       track_client: httpx.AsyncClient | None = None) -> None:
    """Register (``registered``: the session of the set-up, used first), ``tracks`` tracks of the session,
    end it; again. A diverged track (see :func:`is_diverged`) ends the session early (``reregister``: the
    next loop registers afresh) or (``stateless``) turns the session's remaining tracks into stateless ones
    from the registered pose, which cannot drift. ``track_client`` (default ``client``) sends the tracks."""
    track_client = client if track_client is None else track_client
    while not stats.over():
        if registered is None:
            if not stats.take():
                break
            _, registered = await _register(client, stats, up, object_id, "register")
            if registered is None:
                continue
        (session_id, start), registered = registered, None
        body = up.binary_body(session_id=session_id) if mode == "http-binary" else None
        path, kw = up.track_request(mode, session_id=session_id, body=body)
        stateless = False
        for _ in range(tracks):
            if not stats.take():
                break
            tr = await _request(track_client, stats, "track", "POST", path, divergence=True, **kw)
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
        _, registered = await _register(client, stats, up, object_id, "register_alongside")
        if registered is not None:
            await client.delete(f"/sessions/{registered[0]}")


@dataclass
class StreamSession:
    """An open ``/track/stream`` connection whose session began (``registered`` or ``started``);
    ``pose``: the registered pose (a stateless reconnect starts from it)."""

    ws: Any
    pose: list


def _stream_options(deflate: bool) -> dict:
    from server.client import STREAM_CONNECT_OPTIONS

    return {**STREAM_CONNECT_OPTIONS, "compression": "deflate"} if deflate else STREAM_CONNECT_OPTIONS


async def _stream_open(ws_url: str, headers: dict, options: dict, stats: Stats, up: Uploads, object_id: str,
                       start_pose: list | None = None) -> StreamSession | None:
    """Connect and begin a session: a register, or with ``start_pose`` a start message from that pose (no
    register). A refusal (429/503) is waited out as the server's ``retry_after_ms`` asks and the message
    sent again on the same connection, within ``stats``' budget and deadline. None (the connection
    closed) when out of budget or time, on another error, or when the transport failed."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import WebSocketException

    name = "stream_register" if start_pose is None else "stream_start"
    if not stats.take():
        return None
    ws = None
    try:
        ws = await connect(ws_url, additional_headers=headers, **options)
        while True:
            message = up.register_message(object_id) if start_pose is None else up.start_message(object_id, start_pose)
            started = time.perf_counter()
            await ws.send(message)
            reply = json.loads(await ws.recv())
            ms = (time.perf_counter() - started) * 1e3
            if reply["type"] in ("registered", "started"):
                stats.record(name, ms, 200)
                return StreamSession(ws, reply["pose"] if start_pose is None else start_pose)
            status = _status_of(reply)
            stats.record(name, ms, status)
            error = reply.get("error", {})
            stats.error_samples.setdefault(f"{name} {status}", str(error.get("message", ""))[:300])
            if status not in (429, 503):
                break
            if "retry_after_ms" not in error:
                stats.refusals_without_retry_after[f"{name} {status}"] += 1
            await _pause(error.get("retry_after_ms", 100) / 1e3, stats)
            if not stats.take():
                break
    except (OSError, WebSocketException) as exc:
        stats.transport_errors[type(exc).__name__] += 1
    if ws is not None:
        await _close(ws)
    return None


async def _close(ws: Any) -> None:
    from websockets.exceptions import WebSocketException

    with contextlib.suppress(OSError, WebSocketException):
        await ws.close()


async def _stream_frames(ws: Any, stats: Stats, up: Uploads, tracks: int) -> bool:
    """Up to ``tracks`` frames lock-step on an open session; True when one diverged (the session cannot
    recover: see :func:`is_diverged`)."""
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
            return True
        stats.record("stream_frame", round_trip_ms, status)
        if status == 200:  # the transport's share (and this client's): outside every server phase
            stats.outside_ms.append(round_trip_ms - accounted_ms(reply["timings_ms"]))
        if status != 200 and f"stream_frame {status}" not in stats.error_samples:
            stats.error_samples[f"stream_frame {status}"] = reply["error"]["message"][:300]
    return False


async def _stream_client(ws_url: str, headers: dict, stats: Stats, up: Uploads, object_id: str, tracks: int,
                         deflate: bool = False, on_diverge: str = "reregister",
                         session: StreamSession | None = None) -> None:
    """Sessions of ``tracks`` frames, one connection each (``session``: the set-up's, used first). After a
    diverged frame the client reconnects with a register (``reregister``) or a start message from its
    registered pose (``stateless``: no register, so no wait for the register lane)."""
    from websockets.exceptions import WebSocketException

    options = _stream_options(deflate)
    registered_pose = None if session is None else session.pose
    start_pose = None
    while not stats.over():
        if session is None:
            session = await _stream_open(ws_url, headers, options, stats, up, object_id, start_pose)
            if session is None:
                continue
            registered_pose = session.pose
        diverged = False
        try:
            diverged = await _stream_frames(session.ws, stats, up, tracks)
        except (OSError, WebSocketException) as exc:
            stats.transport_errors[type(exc).__name__] += 1
        finally:
            await _close(session.ws)
            session = None
        start_pose = registered_pose if diverged and on_diverge == "stateless" else None


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
    setup_timeout_s: float | None = 60.0  # None: no set-up phase (every client registers inside the window)
    barrier: Any = None  # a Manager barrier: every process starts its clock when all are set up
    announce: bool = False  # print a line to stderr when the window starts (one process does)
    track_url: str | None = None  # where the tracks go (http-binary only); None: ``url``
    fragment_bytes: int = STREAM_FRAGMENT_BYTES  # stream messages as WebSocket fragments of this size (0: one frame each)
    http_client: str = "raw"  # http-binary tracks: one tools.raw_http connection per client, or the shared httpx pool


async def _run_job(job: Job) -> dict:
    headers = {"Authorization": f"Bearer {job.api_key}"} if job.api_key else {}
    up = Uploads(*job.image_hw, fragment_bytes=job.fragment_bytes)
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
             on_diverge: str = "reregister", setup_timeout_s: float | None = 60.0,
             track_url: str | None = None, fragment_bytes: int = STREAM_FRAGMENT_BYTES,
             http_client: str = "raw") -> dict:
    """Run the load from ``processes`` worker processes (1 = in this process) and summarise it.

    setup_timeout_s: how long the set-up phase (every track client obtains its session before the
    measured window) may take; None = no set-up (the clients register inside the window).
    track_url: where every ``POST /track/binary`` (``mode="http-binary"``) or every stream connection (the stream
    modes) goes; None: ``url``.
    fragment_bytes: the stream modes send each message as WebSocket fragments of this size
    (:data:`server.client.STREAM_FRAGMENT_BYTES`, the default); 0 sends each message as one frame.
    http_client: ``http-binary`` tracks go through one :class:`tools.raw_http.RawHttpClient` connection per client
    (``raw``, ~0.6 ms of client CPU per 640x480 request) or the shared ``httpx`` pool (``httpx``, ~2 ms); the
    other requests (registers, deletes, the other modes) always use ``httpx``."""
    if http_client not in HTTP_CLIENTS:
        raise ValueError(f"http_client must be one of {HTTP_CLIENTS}, got {http_client!r}")
    if fragment_bytes < 0:
        raise ValueError(f"fragment_bytes must be >= 0, got {fragment_bytes}")
    check_loopback(url)
    if track_url is not None:
        check_loopback(track_url)
        if mode not in _TRACK_URL_MODES:
            raise ValueError(f"track_url applies to modes {', '.join(_TRACK_URL_MODES)} only, got mode {mode!r}")
    oid, before = asyncio.run(_prepare(url, api_key, object_id))
    processes = max(1, min(processes, clients + registers_alongside))
    interval = registers_alongside / register_rate if register_rate > 0 else 0.0  # per alongside client
    shares = [(c, r, m, interval) for c, r, m in zip(_split(clients, processes), _split(registers_alongside, processes),
                                                     _split(max_requests, processes), strict=True)]
    if processes == 1:
        parts = [_worker(Job(url, api_key, mode, *shares[0], duration_s, tracks, image_hw, oid, on_diverge,
                             setup_timeout_s, announce=True, track_url=track_url, fragment_bytes=fragment_bytes,
                             http_client=http_client))]
    else:
        ctx = multiprocessing.get_context("spawn")
        with ctx.Manager() as manager, ctx.Pool(processes) as pool:
            barrier = manager.Barrier(processes)
            jobs = [Job(url, api_key, mode, *share, duration_s, tracks, image_hw, oid, on_diverge, setup_timeout_s,
                        barrier, announce=i == 0, track_url=track_url, fragment_bytes=fragment_bytes,
                        http_client=http_client)
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
    summary["server_track_batches"] = _metric(after, "fp_track_batches_total")
    summary["server_track_batched_requests"] = _metric(after, "fp_track_batched_requests_total")
    summary["server_shed"] = _labelled(after, "fp_requests_shed_total")
    summary["server_stream_frames_skipped"] = _metric(after, "fp_stream_frames_skipped_total")
    return summary


GENERATOR_BUSY = 0.85  # a load process this busy (CPU seconds per window second) may be what limits the load


def _generator_summary(cpu_fractions: list[float]) -> dict:
    """The load processes' own CPU use over the window: ``{processes, cpu_fraction (each), busiest, saturated}``;
    warns on stderr when one is near a whole core (then the figures may be the generator's, not the server's)."""
    busiest = max(cpu_fractions)
    saturated = busiest >= GENERATOR_BUSY
    if saturated:
        print(f"loadtest: a load process used {busiest:.0%} of a core over the window: the load generator may be "
              "what limits these figures (more --processes, or fewer clients per process)", file=sys.stderr)
    return {"processes": len(cpu_fractions), "cpu_fraction": cpu_fractions, "busiest": busiest,
            "saturated": saturated}


def _setup_summary(parts: list[dict], timeout_s: float) -> dict:
    """The set-up phase over every worker process (see the module docstring)."""
    stats = Stats(max_requests=0, deadline=0.0)
    for part in parts:
        stats.merge(part["stats"])
    seconds = max(p["ended"] for p in parts) - min(p["started"] for p in parts)
    summary = stats.summary(seconds)
    register = next((e for name, e in summary["endpoints"].items() if name in ("register", "stream_register")), {})
    return {"seconds": round(seconds, 2), "timeout_s": timeout_s, "clients": sum(p["clients"] for p in parts),
            "sessions_ready": sum(p["ready"] for p in parts), "registers_ok": register.get("ok", 0),
            "registers_refused": sum(summary["refusals"].values()),
            "register_p50_ms": register.get("p50_ms"), "register_p99_ms": register.get("p99_ms"),
            "errors_by_status": summary["errors_by_status"], "transport_errors": summary["transport_errors"],
            "refusals_without_retry_after": summary["refusals_without_retry_after"],
            "error_samples": summary["error_samples"]}


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


def _free_port(*taken: int) -> int:
    """A free 127.0.0.1 port, none of ``taken`` (ports picked for the same server, not yet bound)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in taken:
            return port


@contextlib.contextmanager
def spawned_server(args: argparse.Namespace, api_key: str, extra_args: tuple[str, ...] = (),
                   ingest_workers: int = 0) -> Iterator[tuple[str, dict]]:
    """Run ``python -m server`` (tiny config, then ``extra_args``) on a free loopback port until the block
    exits; ``server_info`` has the command, port, ``pid`` and start-up seconds (and the exit code after).
    ``ingest_workers`` > 0: also ``--ingest-workers N --ingest-port P`` on another free port, ready once
    that port's ``/healthz`` answers too; ``server_info["track_url"]`` is its URL."""
    port = _free_port()
    ingest_port = _free_port(port) if ingest_workers > 0 else None
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
        if ingest_port is not None:
            command += ["--ingest-workers", str(ingest_workers), "--ingest-port", str(ingest_port)]
        command += list(extra_args)
        env = {**os.environ, "FP_API_KEY": api_key}
        server_info = {"command": " ".join(command[1:]), "port": port}
        if ingest_port is not None:
            server_info.update(ingest_workers=ingest_workers, ingest_port=ingest_port,
                               track_url=f"http://127.0.0.1:{ingest_port}")
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
            server_info["pid"] = proc.pid
            try:
                url = f"http://127.0.0.1:{port}"
                started = time.monotonic()
                _wait_ready(url, api_key, proc, args.ready_timeout_s, log_path)
                if ingest_port is not None:  # the ingest workers may come up after the GPU process
                    _wait_ready(server_info["track_url"], api_key, proc, args.ready_timeout_s, log_path, "/healthz")
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


def _wait_ready(url: str, api_key: str, proc: subprocess.Popen, timeout_s: float, log_path: Path,
                path: str = "/readyz") -> None:
    """Poll ``url + path`` until it answers 200; RuntimeError if ``proc`` exits first, TimeoutError."""
    deadline = time.monotonic() + timeout_s
    headers = {"Authorization": f"Bearer {api_key}"}
    with httpx.Client(base_url=url, headers=headers, timeout=2.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode} during start-up:\n"
                                   + log_path.read_text(errors="replace")[-4000:])
            with contextlib.suppress(httpx.HTTPError):
                if client.get(path).status_code == 200:
                    return
            time.sleep(0.2)  # polling another process's readiness: nothing to wait on but time
    raise TimeoutError(f"{url}{path} did not answer 200 within {timeout_s} s:\n" + log_path.read_text(errors="replace")[-4000:])


def _parse_hw(text: str) -> tuple[int, int]:
    from server.config import parse_image_size

    return parse_image_size(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python tools/loadtest.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server URL, loopback only (default %(default)s)")
    p.add_argument("--track-url", default=None,
                   help="--mode http-binary: send every POST /track/binary here, --mode stream: open every stream "
                        "here (e.g. the server's --ingest-port), loopback only; registers over HTTP, deletes and "
                        "/metrics stay on --url (default: --url)")
    p.add_argument("--spawn", action="store_true", help="start a tiny server on a free 127.0.0.1 port and stop it after")
    p.add_argument("--spawn-ingest-workers", type=int, default=0, metavar="N",
                   help="--spawn, --mode http-binary or stream: start the server with --ingest-workers N on another "
                        "free port and send the tracks (streams) there (default 0: no ingest workers)")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients, 1..256 (default 4)")
    p.add_argument("--processes", type=int, default=1,
                   help="worker processes the clients are spread over, 1..64 (default 1)")
    p.add_argument("--mode", choices=MODES, default="http-png",
                   help="track path: PNG multipart, raw-frame multipart, one binary body (POST /track/binary), "
                        "WS /track/stream, or the stream offering permessage-deflate (default http-png)")
    p.add_argument("--stream-fragment-kib", type=int, default=STREAM_FRAGMENT_BYTES // 1024, metavar="KIB",
                   help="stream modes: send each message as WebSocket fragments of KIB KiB, as server.client does "
                        "(default %(default)s); 0: each message in one frame")
    p.add_argument("--http-client", choices=HTTP_CLIENTS, default="raw",
                   help="http-binary: send the tracks through one lean keep-alive connection per client (raw, "
                        "tools/raw_http.py) or httpx's pool (default %(default)s)")
    p.add_argument("--on-diverge", choices=("reregister", "stateless"), default="reregister",
                   help="after a track refused for the pose's range (random weights drift there): register a new "
                        "session, or go on from the registered pose without a register (no register-lane wait "
                        "under load): HTTP with stateless tracks, a stream by reconnecting with a start message "
                        "(default reregister)")
    p.add_argument("--setup-timeout-s", type=float, default=60.0,
                   help="set-up phase: every track client registers its first session (waiting out refusals as "
                        "the server's Retry-After asks) before the measured window starts, for at most this "
                        "long, in (0, 600]; keep it under the server's stream idle timeout (default 60)")
    p.add_argument("--no-setup", action="store_true",
                   help="no set-up phase: the clients register inside the measured window (the register lane's "
                        "start-up storm is then part of what is measured)")
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
    if args.stream_fragment_kib < 0:
        parser.error(f"--stream-fragment-kib must be >= 0 (0: one frame per message), got {args.stream_fragment_kib}")
    if not 0 < args.duration_s <= 600:
        parser.error("--duration-s must be in (0, 600]")
    if not 1 <= args.max_requests <= 1_000_000:
        parser.error("--max-requests must be in 1..1000000")
    if not 0 < args.setup_timeout_s <= 600:
        parser.error("--setup-timeout-s must be in (0, 600]")
    try:
        check_loopback(args.url)
        if args.track_url is not None:
            check_loopback(args.track_url)
    except ValueError as exc:
        parser.error(str(exc))
    if args.track_url is not None and args.mode not in _TRACK_URL_MODES:
        parser.error(f"--track-url applies to --mode {'/'.join(_TRACK_URL_MODES)} only, got --mode {args.mode}")
    if args.spawn_ingest_workers < 0:
        parser.error(f"--spawn-ingest-workers must be >= 0, got {args.spawn_ingest_workers}")
    if args.spawn_ingest_workers > 0:
        if not args.spawn:
            parser.error("--spawn-ingest-workers needs --spawn (else start the server with --ingest-workers "
                         "yourself and pass its port as --track-url)")
        if args.mode not in _TRACK_URL_MODES:
            parser.error(f"--spawn-ingest-workers applies to --mode {'/'.join(_TRACK_URL_MODES)} only, "
                         f"got --mode {args.mode}")
        if args.track_url is not None:
            parser.error("--spawn-ingest-workers sends the tracks to the spawned ingest port: drop --track-url")
    load = dict(clients=args.clients, duration_s=args.duration_s, max_requests=args.max_requests,
                tracks=args.tracks_per_register, image_hw=args.image_hw, object_id=args.object_id, mode=args.mode,
                processes=args.processes, registers_alongside=args.registers_alongside,
                register_rate=args.register_rate, on_diverge=args.on_diverge,
                setup_timeout_s=None if args.no_setup else args.setup_timeout_s,
                fragment_bytes=args.stream_fragment_kib * 1024, http_client=args.http_client)
    settings = {"clients": args.clients, "processes": args.processes, "mode": args.mode, "on_diverge": args.on_diverge,
                "registers_alongside": args.registers_alongside, "register_rate": args.register_rate, "duration_s": args.duration_s,
                "max_requests": args.max_requests, "tracks_per_register": args.tracks_per_register,
                "setup_timeout_s": None if args.no_setup else args.setup_timeout_s,
                "image_wh": [args.image_hw[1], args.image_hw[0]], "stream_fragment_kib": args.stream_fragment_kib,
                "http_client": args.http_client}
    if args.spawn:
        api_key = secrets.token_urlsafe(16)
        with spawned_server(args, api_key, ingest_workers=args.spawn_ingest_workers) as (url, server_info):
            track_url = server_info.get("track_url")
            print(f"server ready at {url}" + (f" (tracks to {track_url})" if track_url else "")
                  + f" after {server_info['startup_s']} s; loading ...", file=sys.stderr)
            summary = run_load(url, api_key=api_key, track_url=track_url, **load)
        summary["server"] = server_info
    else:
        url, track_url = args.url, args.track_url
        summary = run_load(url, api_key=args.api_key, track_url=track_url, **load)
    summary["settings"] = {**settings, "url": url, "track_url": track_url or url}
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
