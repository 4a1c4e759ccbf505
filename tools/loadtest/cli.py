"""``python -m tools.loadtest``: the command line (see the package's docstring)."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys

from server.client import STREAM_FRAGMENT_BYTES

from .clients import HTTP_CLIENTS, MODES, OBJECT_ID, SCENE_OBJECT_IDS, SCENES, scene_frame
from .run import _TRACK_URL_MODES, check_loopback, run_load
from .spawn import spawned_server

__all__ = ["build_parser", "main"]

DESCRIPTION = ("Bounded load test of the pose service, loopback only, clients in several processes; prints one JSON "
               "summary.")


def _parse_hw(text: str) -> tuple[int, int]:
    from server.config import parse_image_size

    return parse_image_size(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.loadtest", description=DESCRIPTION)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server URL, loopback only (default %(default)s)")
    p.add_argument("--track-url", default=None,
                   help="--mode http-binary: send every POST /track/binary here, --mode stream: open every stream "
                        "here (e.g. the server's --ingest-port), loopback only; registers over HTTP, deletes and "
                        "/metrics stay on --url (default: --url)")
    p.add_argument("--spawn", action="store_true",
                   help="start a tiny server on a free 127.0.0.1 port (on a CPU without its warm-up) and stop it after")
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
    p.add_argument("--image", type=_parse_hw, default=None, dest="image_hw",
                   help="frame WIDTHxHEIGHT in pixels (default 320x240 for --scene synthetic, the bundled "
                        "sequence's 640x480 for bundled)")
    p.add_argument("--scene", choices=SCENES, default="synthetic",
                   help="what the frames show: synthetic, a slab in front of a plane (any size; no trained weights "
                        "recognise it, so with --weights on the server every session is lost and recovers on every "
                        "frame), or bundled, the bundled demo sequence's first frame, whose object (uploaded as "
                        f"{SCENE_OBJECT_IDS['bundled']}) is the one python -m foundationpose.train trains on by "
                        "default (default synthetic)")
    p.add_argument("--api-key", default=os.environ.get("FP_API_KEY"), help="bearer key (default $FP_API_KEY)")
    p.add_argument("--object-id", default=None,
                   help=f"object to use (default: upload the scene's, the procedural block as {OBJECT_ID} or the "
                        f"bundled mesh as {SCENE_OBJECT_IDS['bundled']})")
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
    if args.image_hw is None:
        args.image_hw = (240, 320) if args.scene == "synthetic" else (480, 640)
    try:
        scene_frame(args.scene, *args.image_hw)
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
                fragment_bytes=args.stream_fragment_kib * 1024, http_client=args.http_client, scene=args.scene)
    settings = {"clients": args.clients, "processes": args.processes, "mode": args.mode, "on_diverge": args.on_diverge,
                "registers_alongside": args.registers_alongside, "register_rate": args.register_rate, "duration_s": args.duration_s,
                "max_requests": args.max_requests, "tracks_per_register": args.tracks_per_register,
                "setup_timeout_s": None if args.no_setup else args.setup_timeout_s,
                "image_wh": [args.image_hw[1], args.image_hw[0]], "stream_fragment_kib": args.stream_fragment_kib,
                "http_client": args.http_client, "scene": args.scene}
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
