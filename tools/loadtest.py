"""Bounded HTTP load test of the pose service, loopback only; prints one JSON summary.

    python tools/loadtest.py --spawn --clients 4 --duration-s 20            # start a tiny server itself
    python tools/loadtest.py --url http://127.0.0.1:8000 --clients 8 --max-requests 500

N concurrent clients (httpx.AsyncClient) each loop: ``POST /register`` on a synthetic frame, then
``--tracks-per-register`` x ``POST /track`` of that session, then ``DELETE /sessions/{id}``. The run
stops at ``--duration-s`` or after ``--max-requests`` requests, whichever comes first. A 503 is counted
and the client waits for its Retry-After (at most 0.5 s) before going on.

Only loopback targets are allowed (127.0.0.1, localhost, ::1): this tool must never load someone
else's server. ``--spawn`` runs ``python -m server`` with a tiny configuration (4 hypotheses, 1
iteration, random weights unless ``--weights``) on a free 127.0.0.1 port with a random API key and a
temporary objects directory, waits for ``/readyz`` and stops it at the end.

Output (stdout): ``{"requests", "requests_per_s", "endpoints": {name: {count, ok, p50_ms, p99_ms,
mean_ms, errors_by_status}}, "errors_by_status", "transport_errors", ...}``; progress goes to stderr.
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
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from deploy_core.timing import percentile  # noqa: E402
from server import codecs  # noqa: E402
from foundationpose.synthetic.scenes import synthetic_frame  # noqa: E402

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
    """Latencies (ms) and statuses per endpoint; a shared request budget."""

    max_requests: int
    deadline: float
    sent: int = 0
    latencies_ms: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    statuses: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    transport_errors: Counter = field(default_factory=Counter)
    error_samples: dict[str, str] = field(default_factory=dict)  # "endpoint status" -> first error message

    def take(self) -> bool:
        """Claim one request of the budget; False once the run is over."""
        if self.sent >= self.max_requests or time.monotonic() >= self.deadline:
            return False
        self.sent += 1
        return True

    def summary(self, elapsed_s: float) -> dict:
        endpoints = {}
        all_errors: Counter = Counter()
        for name in sorted(self.statuses):
            lat = sorted(self.latencies_ms[name])
            statuses = self.statuses[name]
            errors = {str(k): v for k, v in sorted(statuses.items()) if k >= 400}
            all_errors.update(errors)
            endpoints[name] = {
                "count": sum(statuses.values()),
                "ok": sum(v for k, v in statuses.items() if k < 400),
                "p50_ms": round(percentile(lat, 50), 1) if lat else None,
                "p99_ms": round(percentile(lat, 99), 1) if lat else None,
                "mean_ms": round(sum(lat) / len(lat), 1) if lat else None,
                "errors_by_status": errors,
            }
        total = sum(e["count"] for e in endpoints.values())
        return {
            "requests": total,
            "elapsed_s": round(elapsed_s, 2),
            "requests_per_s": round(total / elapsed_s, 2) if elapsed_s > 0 else None,
            "endpoints": endpoints,
            "errors_by_status": dict(sorted(all_errors.items())),
            "transport_errors": dict(self.transport_errors),
            "error_samples": dict(sorted(self.error_samples.items())),
        }


class Uploads:
    """The synthetic frame, encoded once."""

    def __init__(self, height: int, width: int) -> None:
        frame = synthetic_frame(height, width)
        self.K = json.dumps(frame.K.tolist())
        self.rgb = codecs.encode_rgb_png(frame.rgb)
        self.depth = codecs.encode_depth_png_mm(frame.depth_m)
        self.mask = codecs.encode_mask_png(frame.mask)


async def _request(client: httpx.AsyncClient, stats: Stats, name: str, method: str, path: str, **kw) -> httpx.Response | None:
    started = time.perf_counter()
    try:
        response = await client.request(method, path, **kw)
    except httpx.HTTPError as exc:
        stats.transport_errors[type(exc).__name__] += 1
        return None
    stats.latencies_ms[name].append((time.perf_counter() - started) * 1e3)
    stats.statuses[name][response.status_code] += 1
    if response.status_code >= 400 and f"{name} {response.status_code}" not in stats.error_samples:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            stats.error_samples[f"{name} {response.status_code}"] = response.json()["error"]["message"][:300]
    if response.status_code == 503:
        with contextlib.suppress(ValueError):
            await asyncio.sleep(min(0.5, float(response.headers.get("retry-after", "0.1"))))
    return response


async def _client_loop(client: httpx.AsyncClient, stats: Stats, up: Uploads, object_id: str, tracks: int) -> None:
    while stats.take():
        reg = await _request(client, stats, "register", "POST", "/register", data={"object_id": object_id, "K": up.K},
                             files={"rgb": ("rgb.png", up.rgb), "depth": ("depth.png", up.depth),
                                    "mask": ("mask.png", up.mask)})
        if reg is None or reg.status_code != 200:
            continue
        session_id = reg.json()["session_id"]
        for _ in range(tracks):
            if not stats.take():
                break
            tr = await _request(client, stats, "track", "POST", "/track", data={"session_id": session_id},
                                files={"rgb": ("rgb.png", up.rgb), "depth": ("depth.png", up.depth)})
            if tr is not None and tr.status_code == 404:
                break
        if stats.take():
            await _request(client, stats, "delete_session", "DELETE", f"/sessions/{session_id}")


async def run_load(url: str, *, clients: int, duration_s: float, max_requests: int, tracks: int,
                   image_hw: tuple[int, int], api_key: str | None, object_id: str | None) -> dict:
    check_loopback(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    up = Uploads(*image_hw)
    limits = httpx.Limits(max_connections=clients + 2)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120.0, limits=limits) as client:
        oid = object_id or await _ensure_object(client)
        stats = Stats(max_requests=max_requests, deadline=time.monotonic() + duration_s)
        started = time.perf_counter()
        await asyncio.gather(*(_client_loop(client, stats, up, oid, tracks) for _ in range(clients)))
        elapsed = time.perf_counter() - started
        summary = stats.summary(elapsed)
        metrics = await client.get("/metrics")
    summary["object_id"] = oid
    summary["server_track_batches"] = _metric(metrics.text, "fp_track_batches_total")
    summary["server_track_batched_requests"] = _metric(metrics.text, "fp_track_batched_requests_total")
    return summary


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


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
def spawned_server(args: argparse.Namespace, api_key: str) -> Iterator[tuple[str, dict]]:
    """Run ``python -m server`` (tiny config) on a free loopback port until the block exits."""
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
        env = {**os.environ, "FP_API_KEY": api_key}
        server_info = {"command": " ".join(command[1:]), "port": port}
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
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
    p.add_argument("--clients", type=int, default=4, help="concurrent clients, 1..64 (default 4)")
    p.add_argument("--duration-s", type=float, default=20.0, help="run time cap in seconds, <= 600 (default 20)")
    p.add_argument("--max-requests", type=int, default=400, help="request cap, <= 100000 (default 400)")
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
    if not 1 <= args.clients <= 64:
        parser.error("--clients must be in 1..64")
    if not 0 < args.duration_s <= 600:
        parser.error("--duration-s must be in (0, 600]")
    if not 1 <= args.max_requests <= 100_000:
        parser.error("--max-requests must be in 1..100000")
    try:
        check_loopback(args.url)
    except ValueError as exc:
        parser.error(str(exc))
    load = dict(clients=args.clients, duration_s=args.duration_s, max_requests=args.max_requests,
                tracks=args.tracks_per_register, image_hw=args.image_hw, object_id=args.object_id)
    settings = {"clients": args.clients, "duration_s": args.duration_s, "max_requests": args.max_requests,
                "tracks_per_register": args.tracks_per_register, "image_wh": [args.image_hw[1], args.image_hw[0]]}
    if args.spawn:
        api_key = secrets.token_urlsafe(16)
        with spawned_server(args, api_key) as (url, server_info):
            print(f"server ready at {url} after {server_info['startup_s']} s; loading ...", file=sys.stderr)
            summary = asyncio.run(run_load(url, api_key=api_key, **load))
        summary["server"] = server_info
    else:
        summary = asyncio.run(run_load(args.url, api_key=args.api_key, **load))
    summary["settings"] = settings
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
