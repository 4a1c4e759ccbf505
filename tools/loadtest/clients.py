"""The load test's clients: one loop per client (HTTP: register, tracks, delete; a stream: one connection per
session), each request timed and counted, refusals waited out as the server asks."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from foundationpose.synthetic.scenes import SyntheticFrame, synthetic_frame
from server import codecs
from server.phases import accounted_ms
from tools.raw_http import RawHttpError

from .stats import Stats

__all__ = ["HTTP_CLIENTS", "MODES", "OBJECT_ID", "RETRY_CAP_S", "RETRY_JITTER", "SCENES", "SCENE_OBJECT_IDS",
           "StreamSession", "Uploads", "is_diverged", "retry_wait_s", "scene_frame"]


MODES = ("http-png", "http-raw", "http-binary", "stream", "stream-deflate")


HTTP_CLIENTS = ("raw", "httpx")  # what sends the http-binary tracks (see run_load)


OBJECT_ID = "loadtest_block"
# --scene: what the frames show. synthetic: a slab in front of a plane (any size; no object's weights recognise it,
# so with trained weights every session is lost); bundled: the bundled demo sequence's first frame (640x480), whose
# object is the one `python -m foundationpose.train` trains on by default, uploaded as its own object
SCENES = ("synthetic", "bundled")
SCENE_OBJECT_IDS = {"synthetic": OBJECT_ID, "bundled": "loadtest_bundled"}


@functools.lru_cache(maxsize=4)
def scene_frame(scene: str, height: int, width: int) -> SyntheticFrame:
    """The frame every client sends (rgb, depth in metres, the register mask and K), read-only and made once per
    process (the command line's check, the run's and the clients' encoders share it). ValueError when ``scene`` is
    unknown or the bundled frame is asked for at another size."""
    if scene == "synthetic":
        return _read_only(synthetic_frame(height, width))
    if scene != "bundled":
        raise ValueError(f"scene must be one of {SCENES}, got {scene!r}")
    from foundationpose.demo.dataset import BUNDLED_SEQUENCE_DIR, RecordedSequence

    sequence = RecordedSequence(BUNDLED_SEQUENCE_DIR)
    first = sequence.read(0)
    if first.depth.shape != (height, width):
        h, w = first.depth.shape
        raise ValueError(f"the bundled scene's frames are {w}x{h}; got --image {width}x{height}")
    assert first.mask is not None, "the bundled sequence has masks"
    return _read_only(SyntheticFrame(rgb=first.rgb, depth_m=first.depth, mask=first.mask, K=sequence.K))


def _read_only(frame: SyntheticFrame) -> SyntheticFrame:
    """``frame`` with its arrays marked read-only: a cached frame is shared by every caller in the process."""
    for array in (frame.rgb, frame.depth_m, frame.mask, frame.K):
        array.flags.writeable = False
    return frame


RETRY_CAP_S = 10.0  # the longest wait for a Retry-After: a server asking for more is waited on this long, then asked again


RETRY_JITTER = 0.1  # waits are the server's Retry-After times 1 + U(0, this): clients refused together come back spread


class Uploads:
    """The synthetic frame, encoded once per process: PNG parts, raw parts and stream messages."""

    def __init__(self, height: int, width: int, fragment_bytes: int = 0, scene: str = "synthetic") -> None:
        """fragment_bytes: stream messages go out as WebSocket fragments of this size (0: each in one frame);
        scene: what the frame shows (:func:`scene_frame`)."""
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

        frame = scene_frame(scene, height, width)
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
            if stateless and tr.status_code < 400:
                stats.stateless_tracks += 1
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
