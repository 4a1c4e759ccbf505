"""First request against steady latency, per transport, of a freshly started server: is ready warm?

    python -m server --objects DIR --device cuda --max-image 640x480 &
    python -m tools.first_requests --url http://127.0.0.1:8000 --image 640x480

Waits for ``/readyz`` (``--ready-timeout-s``), then per transport, one after the other on one open connection: its
first request, then ``--requests`` more one at a time, and prints one JSON object: per transport ``first_ms``, the
steady ``p50_ms`` / ``p99_ms`` (of the requests after the first), ``ratio`` (first / p50) and ``within_2x``; the
server's ``warmup_ms`` and ``warmup_paths_ms`` from ``/readyz``; ``all_within_2x``. Run it once per server start:
only the first request of a transport after ready says whether ready meant warm.

Transports: ``register_png`` (``POST /register``, PNG images), ``track_png``, ``track_raw`` (``POST /track`` with
PNG / raw images), ``track_binary`` (``POST /track/binary`` to ``--track-url``, default ``--url``: with ingest
workers on the server's port, they serve it), ``track_sessions`` (``POST /track/sessions``), ``stream_register``
and ``stream_frame`` (``WS /track/stream`` at ``--track-url``). The object is ``--object-id``, default the first one
``GET /objects`` lists (a loaded object: one uploaded now would not have been warmed); the frame is the load
generator's synthetic one at ``--image`` (use the server's ``--max-image``: the size its start-up warmed). A track
refused because its pose left the working range (422 naming ``pose``, random weights) counts as answered. Loopback
only, like the load generator.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the checkout's packages
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from deploy_core.timing import percentile

__all__ = ["TRANSPORTS", "build_parser", "main", "measure"]

TRANSPORTS = ("register_png", "track_png", "track_raw", "track_binary", "track_sessions", "stream_register",
              "stream_frame")


def _answered(status: int, body: Any) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    return status == 200 or (status == 422 and isinstance(error, dict) and error.get("field") == "pose")


def _timed(send: Callable[[], tuple[int, Any]], name: str) -> tuple[float, Any]:
    started = time.perf_counter()
    status, body = send()
    ms = (time.perf_counter() - started) * 1e3
    if not _answered(status, body):
        raise RuntimeError(f"{name}: answered {status}: {json.dumps(body)[:300]}")
    return ms, body


def _summary(samples: list[float]) -> dict[str, Any]:
    first, rest = samples[0], sorted(samples[1:])
    p50 = percentile(rest, 50)
    return {"first_ms": round(first, 2), "p50_ms": round(p50, 2), "p99_ms": round(percentile(rest, 99), 2),
            "requests": len(samples), "ratio": round(first / p50, 2) if p50 > 0 else None,
            "within_2x": first <= 2 * p50}


def wait_ready(client: httpx.Client, timeout_s: float) -> dict[str, Any]:
    """``/readyz``'s body once it answers 200; RuntimeError with its last answer past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            answer = client.get("/readyz")
            last = answer.json()
            if answer.status_code == 200:
                return last
        except httpx.TransportError as exc:
            last = str(exc)
        time.sleep(0.2)
    raise RuntimeError(f"not ready within {timeout_s:g} s: {last}")


def measure(url: str, *, track_url: str | None = None, image_hw: tuple[int, int] = (480, 640),
            requests: int = 50, object_id: str | None = None, api_key: str | None = None,
            ready_timeout_s: float = 600.0) -> dict[str, Any]:
    """The report described in the module docstring."""
    from server.client import BINARY_HEADERS, STREAM_CONNECT_OPTIONS
    from tools.loadtest import Uploads, check_loopback

    check_loopback(url)
    track_url = track_url or url
    check_loopback(track_url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    up = Uploads(*image_hw)
    out: dict[str, Any] = {"url": url, "track_url": track_url, "image_wh": [image_hw[1], image_hw[0]],
                           "transports": {}}
    with httpx.Client(base_url=url, headers=headers, timeout=120.0) as client, \
            httpx.Client(base_url=track_url, headers=headers, timeout=120.0) as tracks:
        ready = wait_ready(client, ready_timeout_s)
        tracks.get("/healthz")  # the track port's connection is open before its first track
        out.update(server_warmup_ms=ready.get("warmup_ms"), server_warmup_paths_ms=ready.get("warmup_paths_ms"))
        oid = object_id or sorted(o["object_id"] for o in client.get("/objects").json()["objects"])[0]
        out["object_id"] = oid

        def post(c: httpx.Client, path: str, **kw: Any) -> Callable[[], tuple[int, Any]]:
            def send() -> tuple[int, Any]:
                answer = c.post(path, **kw)
                return answer.status_code, answer.json()
            return send

        register = post(client, "/register", data={"object_id": oid, "K": up.K},
                        files={"rgb": ("rgb.png", up.rgb), "depth": ("depth.png", up.depth),
                               "mask": ("mask.png", up.mask)})
        samples: dict[str, list[float]] = {name: [] for name in TRANSPORTS}
        sessions = []
        for _ in range(requests + 1):
            ms, body = _timed(register, "register_png")
            samples["register_png"].append(ms)
            sessions.append(body["session_id"])
        session = sessions[0]
        sends = {
            "track_png": post(client, "/track", data={"session_id": session},
                              files={"rgb": ("rgb.png", up.rgb), "depth": ("depth.png", up.depth)}),
            "track_raw": post(client, "/track", data={"session_id": session, **up.raw_fields}, files=up.raw_files),
            "track_binary": post(tracks, "/track/binary", content=up.binary_body(session_id=session),
                                 headers=BINARY_HEADERS),
            "track_sessions": post(client, "/track/sessions", data={"session_ids": ",".join(sessions[:2])},
                                   files={"rgb": ("rgb.png", up.rgb), "depth": ("depth.png", up.depth)}),
        }
        for name, send in sends.items():
            for _ in range(requests + 1):
                samples[name].append(_timed(send, name)[0])
        from websockets.sync.client import connect

        ws_url = track_url.replace("http://", "ws://", 1).rstrip("/") + "/track/stream"
        for n in range(requests + 1):
            with connect(ws_url, additional_headers=headers, **STREAM_CONNECT_OPTIONS) as ws:
                def stream_send(message: Any) -> Callable[[], tuple[int, Any]]:
                    def send() -> tuple[int, Any]:
                        ws.send(message)
                        answer = json.loads(ws.recv())
                        if answer.get("type") == "error":
                            error = answer.get("error", {})
                            return (422 if error.get("field") == "pose" else 500), answer
                        return 200, answer
                    return send
                samples["stream_register"].append(_timed(stream_send(up.register_message(oid)),
                                                         "stream_register")[0])
                if n == 0:  # the frames of the first stream: its first frame, then the steady ones
                    for i in range(requests + 1):
                        samples["stream_frame"].append(_timed(stream_send(up.frame_message(i)), "stream_frame")[0])
        for session_id in sessions:
            client.delete(f"/sessions/{session_id}")
    out["transports"] = {name: _summary(values) for name, values in samples.items()}
    out["all_within_2x"] = all(t["within_2x"] for t in out["transports"].values())
    return out


def _parse_hw(text: str) -> tuple[int, int]:
    from server.config import parse_image_size

    return parse_image_size(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.first_requests", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server, loopback only (default %(default)s)")
    p.add_argument("--track-url", default=None, help="where POST /track/binary and the streams go (default --url)")
    p.add_argument("--image", type=_parse_hw, default=(480, 640), dest="image_hw",
                   help="frame WIDTHxHEIGHT: the server's --max-image (default 640x480)")
    p.add_argument("--requests", type=int, default=50, help="steady requests after each first one (default 50)")
    p.add_argument("--object-id", default=None, help="a loaded object (default: the first GET /objects lists)")
    p.add_argument("--api-key", default=None, help="bearer key (default $FP_API_KEY)")
    p.add_argument("--ready-timeout-s", type=float, default=600.0, help="wait this long for /readyz (default 600)")
    return p


def main(argv: list[str] | None = None) -> int:
    import os

    args = build_parser().parse_args(argv)
    if args.requests < 2:
        raise SystemExit("--requests must be >= 2")
    report = measure(args.url, track_url=args.track_url, image_hw=args.image_hw, requests=args.requests,
                     object_id=args.object_id, api_key=args.api_key or os.environ.get("FP_API_KEY"),
                     ready_timeout_s=args.ready_timeout_s)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
