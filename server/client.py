"""A small client of the pose service: raw-frame messages, ``python -m server.client stream`` and ``track``.

    python -m server.client stream --url ws://127.0.0.1:8000 --data foundationpose/data/demo_sequence
    python -m server.client track --url http://127.0.0.1:8000          # POST /track/binary per frame

streams a recorded sequence (default: the bundled 640x480 one) over ``WS /track/stream``: it uploads
the sequence's mesh when the server lacks it, registers the first frame with its mask and
``cam_K.txt``, then sends every later frame (``--frames N``: the N after it) as raw pixels and prints one
line per answer (frame, translation, latency) and a JSON summary (latency p50/p90/p99, answered, skipped).
``--fps`` sends at a fixed rate (newest frame wins on the server: slow answers show up as ``skipped``); the
default sends the next frame when the previous one is answered. The API key comes from ``--api-key`` or
``$FP_API_KEY``.

Connect with ``websockets.asyncio.client.connect(url, **STREAM_CONNECT_OPTIONS)``: the options turn
off the ``permessage-deflate`` that ``websockets`` offers by default, which zlibs every frame's raw
pixels before they leave (tens of ms per 640x480 frame, many times the server's own work on a GPU).
Send each message as ``ws.send(fragments(message))``: fragments of 128 KiB cost both ends a fraction of
one 1.5 MB frame (see :data:`STREAM_FRAGMENT_BYTES`).

``track`` does the same over HTTP: ``POST /register`` with the first frame, then one ``POST /track/binary``
(:func:`track_body`: the same container in one request body) per frame, and prints the same summary.

The message builders (:func:`register_message`, :func:`start_message`, :func:`frame_message`, :func:`track_body`, :func:`raw_track_form`) are the
documented formats of :mod:`server.flow.message`; tools and tests build their requests with them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from server.flow.message import pack_message

__all__ = ["BINARY_HEADERS", "STREAM_CONNECT_OPTIONS", "STREAM_FRAGMENT_BYTES", "depth_mm", "depth_part", "fragments", "frame_message", "main", "raw_track_form",
           "register_message", "start_message", "stream_sequence", "track_body", "track_sequence"]

BINARY_HEADERS = {"Content-Type": "application/octet-stream"}  # of POST /track/binary

# ``websockets`` connect() options of the stream: messages up to 16 MiB (a 640x480 register is 1.8 MB), no
# per-message compression (raw pixels: the zlib time is far above what it saves on loopback / LAN).
STREAM_CONNECT_OPTIONS: dict[str, Any] = {"max_size": 2**24, "compression": None}

# A stream message is sent as WebSocket fragments of this size (``ws.send(fragments(message))``): the
# server parses fragment k while this client masks fragment k+1, and every pass over the bytes (mask,
# frame, socket write; the server's unmask) works on a piece that stays in the CPU's cache instead of
# 1.5 MB that does not. The server sees the same message (it reassembles the fragments).
STREAM_FRAGMENT_BYTES = 128 * 1024  # H200 host, one 640x480 session: 32-256 KiB all beat one frame; 128 best


def fragments(message: bytes, size: int = STREAM_FRAGMENT_BYTES) -> list[memoryview] | bytes:
    """``message`` as consecutive views of at most ``size`` bytes, for ``websockets``' ``send`` (an iterable of
    bytes-likes goes out as one fragmented message); a message that fits one piece is returned as it is."""
    if size < 1:
        raise ValueError(f"fragment size must be >= 1 byte, got {size}")
    if len(message) <= size:
        return message
    view = memoryview(message)
    return [view[i:i + size] for i in range(0, len(message), size)]


def depth_mm(depth_m: np.ndarray) -> np.ndarray:
    """(H, W) float metres -> uint16 millimetres (rounded; NaN / negative -> 0, the no-reading value)."""
    depth = np.nan_to_num(np.asarray(depth_m, dtype=np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    return np.clip(np.round(depth * 1000.0), 0, 65535).astype(np.uint16)


def depth_part(depth: np.ndarray) -> np.ndarray:
    """A message's depth part: uint16 millimetres as given (a depth camera's own format: sent without a
    conversion), float metres converted by :func:`depth_mm`."""
    depth = np.asarray(depth)
    return depth if depth.dtype == np.uint16 else depth_mm(depth)


def register_message(object_id: str, K: np.ndarray, rgb: np.ndarray, depth_m: np.ndarray,
                     mask: np.ndarray | None = None, *, box: tuple[int, int, int, int] | None = None) -> bytes:
    """The stream's register message: raw uint8 rgb, uint16 millimetre depth, and a uint8 mask or a ``box``
    (x0, y0, x1, y1 pixels around the object). ``depth_m``: float metres, or uint16 millimetres sent as they are
    (:func:`depth_part`; the same for every message below)."""
    if (mask is None) == (box is None):
        raise ValueError("register_message needs a mask or a box (not both)")
    header: dict[str, Any] = {"type": "register", "object_id": object_id, "K": np.asarray(K, dtype=np.float64).tolist()}
    parts = {"rgb": rgb, "depth": depth_part(depth_m)}
    if box is not None:
        header["box"] = [int(v) for v in box]
    else:
        parts["mask"] = (np.asarray(mask) > 0).astype(np.uint8)
    return pack_message(header, parts)


def start_message(object_id: str, K: np.ndarray, pose: np.ndarray) -> bytes:
    """The stream's start message: a session from a known pose (4x4 cam_from_mesh, metres) without a register."""
    header = {"type": "start", "object_id": object_id, "K": np.asarray(K, dtype=np.float64).tolist(),
              "pose": np.asarray(pose, dtype=np.float64).tolist()}
    return pack_message(header, {})


def frame_message(frame: int, rgb: np.ndarray, depth_m: np.ndarray, K: np.ndarray | None = None) -> bytes:
    """The stream's frame message (``K`` only when it differs from the register's)."""
    header: dict[str, Any] = {"type": "frame", "frame": int(frame)}
    if K is not None:
        header["K"] = np.asarray(K, dtype=np.float64).tolist()
    return pack_message(header, {"rgb": rgb, "depth": depth_part(depth_m)})


def track_body(rgb: np.ndarray, depth_m: np.ndarray, *, session_id: str | None = None, K: np.ndarray | None = None,
               pose: np.ndarray | None = None, object_id: str | None = None) -> bytes:
    """The body of ``POST /track/binary`` (``Content-Type: application/octet-stream``): raw uint8 rgb and
    uint16 millimetre depth in the stream's message container. ``session_id`` (``K`` optional, for this
    frame only), or stateless: ``object_id`` + ``pose`` (4x4 cam_from_mesh, metres) + ``K``."""
    header: dict[str, Any] = {}
    if session_id is not None:
        header["session_id"] = session_id
    if object_id is not None:
        header["object_id"] = object_id
    if pose is not None:
        header["pose"] = np.asarray(pose, dtype=np.float64).tolist()
    if K is not None:
        header["K"] = np.asarray(K, dtype=np.float64).tolist()
    return pack_message(header, {"rgb": rgb, "depth": depth_part(depth_m)})


def raw_track_form(rgb: np.ndarray, depth_m: np.ndarray) -> tuple[dict[str, str], dict[str, tuple[str, bytes]]]:
    """(form fields, files) of a multipart ``/track`` with raw frames (add ``session_id`` or pose + K)."""
    h, w = depth_m.shape
    fields = {"rgb_shape": f"{h},{w},3", "depth_shape": f"{h},{w}", "depth_dtype": "uint16"}
    files = {"rgb": ("rgb.raw", np.ascontiguousarray(rgb, dtype=np.uint8).tobytes()),
             "depth": ("depth.raw", depth_mm(depth_m).tobytes())}
    return fields, files


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50_ms": None, "p90_ms": None, "p99_ms": None}
    arr = np.asarray(values)
    return {f"p{q}_ms": round(float(np.percentile(arr, q)), 2) for q in (50, 90, 99)}


def _ensure_object(http_url: str, headers: dict[str, str], object_id: str, mesh_path: Path | None) -> None:
    import httpx

    with httpx.Client(base_url=http_url, headers=headers, timeout=120.0) as client:
        listing = client.get("/objects")
        listing.raise_for_status()
        if object_id in {o["object_id"] for o in listing.json()["objects"]}:
            return
        if mesh_path is None:
            raise SystemExit(f"error: the server has no object {object_id!r} and the sequence has no mesh/ to upload")
        files = {"mesh": (mesh_path.name, mesh_path.read_bytes())}
        textures = sorted(p for p in mesh_path.parent.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
        if textures:
            files["texture"] = (textures[0].name, textures[0].read_bytes())
        response = client.post("/objects", data={"object_id": object_id}, files=files)
        response.raise_for_status()


async def stream_sequence(url: str, data: Path, *, object_id: str, api_key: str | None, max_frames: int | None,
                          fps: float, quiet: bool = False, upload: bool = True,
                          objects_url: str | None = None) -> dict[str, Any]:
    """Stream ``data`` over ``url`` (``ws://host:port``); returns the summary (see the module docstring).
    max_frames: frames read from the sequence, the register's (the first) included: ``max_frames - 1`` are tracked
    (the command line's ``--frames N`` passes N + 1).
    objects_url: where the mesh is uploaded when the server lacks the object (default: ``url``'s HTTP twin)."""
    from websockets.asyncio.client import connect

    from foundationpose.demo.dataset import RecordedSequence

    sequence = RecordedSequence(data, max_frames=max_frames)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if upload:
        http_url = objects_url or url.replace("ws://", "http://", 1).replace("wss://", "https://", 1)
        _ensure_object(http_url.rstrip("/"), headers, object_id, sequence.mesh_path)
    frames = [sequence.read(i) for i in range(len(sequence))]
    sent_at: dict[int, float] = {}
    latencies, poses, errors, skipped = [], {}, [], []

    def show(text: str) -> None:
        if not quiet:
            print(text, flush=True)

    endpoint = url.rstrip("/") + "/track/stream"
    async with connect(endpoint, additional_headers=headers, **STREAM_CONNECT_OPTIONS) as ws:
        first = frames[0]
        started = time.perf_counter()
        await ws.send(fragments(register_message(object_id, sequence.K, first.rgb, first.depth, first.mask)))
        reply = json.loads(await ws.recv())
        if reply["type"] != "registered":
            raise SystemExit(f"error: register failed: {reply}")
        register_ms = (time.perf_counter() - started) * 1e3
        show(f"registered session {reply['session_id']} in {register_ms:.1f} ms; t = {_t(reply['pose'])}")

        async def answers(expected: int) -> None:
            while len(poses) + len(errors) + len(skipped) < expected:
                reply = json.loads(await ws.recv())
                now = time.perf_counter()
                skipped.extend(reply.get("skipped", ()))
                n = reply.get("frame")
                if reply["type"] == "pose":
                    latencies.append((now - sent_at[n]) * 1e3)
                    poses[n] = reply["pose"]
                    show(f"frame {n:4d}  t = {_t(reply['pose'])}  {latencies[-1]:7.1f} ms"
                         + (f"  skipped {reply['skipped']}" if reply.get("skipped") else ""))
                else:
                    errors.append(reply)
                    show(f"frame {n}: {reply['error']['type']}: {reply['error']['message']}")

        n_frames = len(frames) - 1
        t0 = time.perf_counter()
        if fps <= 0:  # lock-step: the next frame when the previous is answered
            for i, frame in enumerate(frames[1:], start=1):
                sent_at[i] = time.perf_counter()
                await ws.send(fragments(frame_message(i, frame.rgb, frame.depth)))
                await answers(i)
        else:
            reader = asyncio.create_task(answers(n_frames))
            for i, frame in enumerate(frames[1:], start=1):
                await asyncio.sleep(max(0.0, t0 + (i - 1) / fps - time.perf_counter()))
                sent_at[i] = time.perf_counter()
                await ws.send(fragments(frame_message(i, frame.rgb, frame.depth)))
            await reader
        elapsed = time.perf_counter() - t0
    return {"frames": n_frames, "answered": len(poses), "errors": len(errors), "skipped": len(skipped),
            "register_ms": round(register_ms, 1), **_percentiles(latencies),
            "frames_per_s": round(len(poses) / elapsed, 1) if elapsed > 0 else None,
            "last_pose": poses[max(poses)] if poses else None}


def track_sequence(url: str, data: Path, *, object_id: str, api_key: str | None, max_frames: int | None,
                   quiet: bool = False, upload: bool = True, track_url: str | None = None) -> dict[str, Any]:
    """Track ``data`` over HTTP (``url``: ``http://host:port``): ``POST /register`` (multipart PNG) of the first
    frame, then every frame as one ``POST /track/binary`` of raw pixels (to ``track_url`` when given, e.g. the ingest
    workers' second port); returns the summary of :func:`stream_sequence` (``skipped`` is always 0: HTTP answers
    every request). max_frames: as in :func:`stream_sequence` (the register's frame included)."""
    import httpx

    from foundationpose.demo.dataset import RecordedSequence
    from server import codecs

    sequence = RecordedSequence(data, max_frames=max_frames)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base = url.rstrip("/")
    if upload:
        _ensure_object(base, headers, object_id, sequence.mesh_path)
    frames = [sequence.read(i) for i in range(len(sequence))]
    latencies, errors, last_pose = [], 0, None
    with httpx.Client(base_url=base, headers=headers, timeout=120.0) as client, \
            httpx.Client(base_url=(track_url or base).rstrip("/"), headers=headers, timeout=120.0) as tracks:
        first = frames[0]
        started = time.perf_counter()
        reply = client.post("/register", data={"object_id": object_id, "K": json.dumps(sequence.K.tolist())},
                            files={"rgb": ("rgb.png", codecs.encode_rgb_png(first.rgb)),
                                   "depth": ("depth.png", codecs.encode_depth_png_mm(first.depth)),
                                   "mask": ("mask.png", codecs.encode_mask_png(first.mask))})
        if reply.status_code != 200:
            raise SystemExit(f"error: register failed: {reply.status_code} {reply.text[:300]}")
        register_ms = (time.perf_counter() - started) * 1e3
        session_id = reply.json()["session_id"]
        if not quiet:
            print(f"registered session {session_id} in {register_ms:.1f} ms; t = {_t(reply.json()['pose'])}", flush=True)
        t0 = time.perf_counter()
        for i, frame in enumerate(frames[1:], start=1):
            body = track_body(frame.rgb, frame.depth, session_id=session_id)
            started = time.perf_counter()
            reply = tracks.post("/track/binary", content=body, headers=BINARY_HEADERS)
            ms = (time.perf_counter() - started) * 1e3
            if reply.status_code == 200:
                latencies.append(ms)
                last_pose = reply.json()["pose"]
                if not quiet:
                    print(f"frame {i:4d}  t = {_t(last_pose)}  {ms:7.1f} ms", flush=True)
            else:
                errors += 1
                if not quiet:
                    print(f"frame {i}: {reply.status_code} {reply.json().get('error', {}).get('message')}", flush=True)
        elapsed = time.perf_counter() - t0
        client.delete(f"/sessions/{session_id}")
    return {"frames": len(frames) - 1, "answered": len(latencies), "errors": errors, "skipped": 0,
            "register_ms": round(register_ms, 1), **_percentiles(latencies),
            "frames_per_s": round(len(latencies) / elapsed, 1) if elapsed > 0 else None, "last_pose": last_pose}


def _t(pose: list[list[float]]) -> str:
    return "[" + ", ".join(f"{row[3]:+.4f}" for row in pose[:3]) + "] m"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m server.client", description="Client of the FoundationPose service.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("stream", help="stream a recorded sequence over WS /track/stream")
    s.add_argument("--url", default="ws://127.0.0.1:8000", help="server, ws:// or wss:// (default %(default)s)")
    _sequence_options(s)
    s.add_argument("--objects-url", default=None,
                   help="http(s):// server to upload the mesh to when the object is missing (default: --url's)")
    s.add_argument("--fps", type=float, default=0.0,
                   help="send at this rate, frames/s; 0 = the next frame after each answer (default 0)")
    t = sub.add_parser("track", help="track a recorded sequence over HTTP: POST /register, then POST /track/binary")
    t.add_argument("--url", default="http://127.0.0.1:8000", help="server, http:// or https:// (default %(default)s)")
    t.add_argument("--track-url", default=None,
                   help="send the tracks here instead, e.g. the ingest workers' second port (--ingest-port) "
                        "(the register, upload and session delete stay on --url)")
    _sequence_options(t)
    return p


def _sequence_options(p: argparse.ArgumentParser) -> None:
    from foundationpose.demo.dataset import BUNDLED_SEQUENCE_DIR

    p.add_argument("--data", type=Path, default=BUNDLED_SEQUENCE_DIR,
                   help="sequence folder (cam_K.txt, rgb/, depth/, masks/, mesh/); default: the bundled one")
    p.add_argument("--object-id", default="demo_object", help="object id on the server (uploaded from mesh/ if absent)")
    p.add_argument("--api-key", default=os.environ.get("FP_API_KEY"), help="bearer key (default $FP_API_KEY)")
    p.add_argument("--frames", type=int, default=None,
                   help="track N frames after the register's (the sequence's first N + 1 frames; default all)")
    p.add_argument("--quiet", action="store_true", help="print only the JSON summary")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.frames is not None and args.frames < 1:
        parser.error(f"--frames: the number of frames to track after the register, at least 1 (got {args.frames}); "
                     "leave it out to track the whole sequence")
    # the first frame is the register's: --frames N tracks the N frames after it
    max_frames = None if args.frames is None else args.frames + 1
    if args.command == "track":
        summary = track_sequence(args.url, args.data, object_id=args.object_id, api_key=args.api_key,
                                 max_frames=max_frames, quiet=args.quiet, track_url=args.track_url)
    else:
        summary = asyncio.run(stream_sequence(args.url, args.data, object_id=args.object_id, api_key=args.api_key,
                                              max_frames=max_frames, fps=args.fps, quiet=args.quiet,
                                              objects_url=args.objects_url))
    print(json.dumps(summary))
    return 0 if summary["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
