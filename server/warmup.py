"""The request paths' warm-up: before ``/readyz`` answers ready, every transport serves one request in process.

:func:`warm_app` sends the GPU process's app (:attr:`ServerState.app <server.state.ServerState>`) one request per
path, through :mod:`server.asgi_call`: the app's middlewares, routes, parsers, decoders, the request flow's steps
and the pipeline, exactly as for a client's request (no socket). :func:`warm_worker` does the same in an ingest
worker, through the worker's own app: its binary track and stream (decoded into its frame ring, handed to the GPU
process's hub) and a relayed register and session delete. The frame is :func:`~foundationpose.synthetic.scenes.
synthetic_frame` at the warm-up's image size (the server's ``--max-image``), the object one the server loaded.

Requests are let in while the server is still starting by :data:`WARMING`, a context variable set only around the
warm-up's own calls (:func:`warm_task`); an ingest worker's hub connection carries it to the GPU process as the
message's ``warmup`` key (:class:`~server.ingest.worker.HubClient`). Clients cannot set it: it is no header.
Every warm-up request carries the request id ``warmup-<path>`` (the access log shows them) and is counted in the
request metrics like any other.

A path's answer must be 200, or 422 naming ``pose`` (the step ran, and the pose it started from left the working
range: random weights drift there); anything else raises :class:`WarmupError` naming the path, the status and the
error, which fails the start-up (``/readyz`` says it).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from server import codecs
from server.asgi_call import AppAnswer, WebSocketCall, call_http
from server.client import depth_mm, frame_message, register_message, start_message, track_body

__all__ = ["APP_PATHS", "WARMING", "WORKER_PATHS", "WarmupError", "warm_app", "warm_frame_hw", "warm_task",
           "warm_worker", "warming"]

T = TypeVar("T")

# Set (True) only in the context of the server's own warm-up requests: such a request is served while the server is
# still starting (ServerState.require_ready). Never derived from anything a client sends.
WARMING: contextvars.ContextVar[bool] = contextvars.ContextVar("fp_warming", default=False)

# the paths warm_app runs, in order (the names of /readyz's warmup_paths_ms and of fp_warmup_seconds)
APP_PATHS = ("register_png", "register_binary", "track_png", "track_raw", "track_binary", "track_sessions",
             "stream", "session_delete")
# the paths warm_worker runs in each ingest worker (reported as ingest_<name>)
WORKER_PATHS = ("relayed_register", "track_binary", "stream", "relayed_delete")

_BINARY = ("content-type", "application/octet-stream")
_BYTES_PER_PIXEL = 8  # the largest warm-up body: a binary register (rgb 3 + uint16 depth 2 + mask 1) or raw track


class WarmupError(RuntimeError):
    """A warm-up request was not answered as a client's would be (see the module docstring)."""


def warming() -> bool:
    """Whether the running code serves one of the server's own warm-up requests."""
    return WARMING.get()


def warm_task(coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """``coro`` as a task of the running loop in a context where :data:`WARMING` is set (its own copy: the
    caller's context is left as it was)."""
    ctx = contextvars.copy_context()
    ctx.run(WARMING.set, True)
    return ctx.run(asyncio.get_running_loop().create_task, coro)


def warm_frame_hw(max_image_hw: tuple[int, int], max_upload_bytes: int) -> tuple[int, int]:
    """The warm-up frame's (H, W): the largest image the server takes (``--max-image``), scaled down (aspect kept)
    only where its largest body would not fit the upload limit, which refuses such frames from clients too."""
    h, w = int(max_image_hw[0]), int(max_image_hw[1])
    budget = max(1, max_upload_bytes - (1 << 16))  # room for the header and the multipart framing
    if h * w * _BYTES_PER_PIXEL <= budget:
        return h, w
    scale = (budget / (h * w * _BYTES_PER_PIXEL)) ** 0.5
    return max(8, int(h * scale)), max(8, int(w * scale))


@dataclass
class _Frame:
    """The warm-up's frame, as each transport sends it."""

    rgb: np.ndarray
    depth_mm: np.ndarray
    mask: np.ndarray
    K: np.ndarray

    @classmethod
    def of(cls, hw: tuple[int, int]) -> _Frame:
        from foundationpose.synthetic.scenes import synthetic_frame

        frame = synthetic_frame(int(hw[0]), int(hw[1]))
        return cls(frame.rgb, depth_mm(frame.depth_m), (frame.mask > 0).astype(np.uint8), frame.K)

    @property
    def K_json(self) -> str:
        return json.dumps(np.asarray(self.K, dtype=np.float64).tolist())


class _Client:
    """The warm-up's requests to one app, each timed into ``paths`` (ms of its first request)."""

    def __init__(self, app: Callable[..., Any], api_key: str | None, paths: dict[str, float], prefix: str = "") -> None:
        self.app, self.paths, self.prefix = app, paths, prefix
        self._auth = [("authorization", f"Bearer {api_key}")] if api_key else []

    def headers(self, name: str, *extra: tuple[str, str]) -> list[tuple[str, str]]:
        return [*self._auth, ("x-request-id", f"warmup-{self.prefix}{name}"), *extra]

    async def timed(self, name: str, call: Awaitable[T]) -> T:
        started = time.perf_counter()
        result = await call
        self.paths[self.prefix + name] = round((time.perf_counter() - started) * 1e3, 1)
        return result

    async def http(self, name: str, method: str, path: str, body: bytes = b"",
                   content_type: tuple[str, str] | None = None) -> dict[str, Any]:
        extra = (content_type,) if content_type else ()
        answer = await self.timed(name, call_http(self.app, method, path, headers=self.headers(name, *extra),
                                                  body=body))
        return _checked(self.prefix + name, answer)

    async def form(self, name: str, path: str, fields: dict[str, str], files: dict[str, bytes]) -> dict[str, Any]:
        body, content_type = _multipart(fields, files)
        return await self.http(name, "POST", path, body, ("content-type", content_type))

    async def stream(self, name: str, messages: list[bytes]) -> list[dict[str, Any]]:
        """One connection to ``WS /track/stream``: each message sent after the answer to the one before."""
        async def run() -> list[dict[str, Any]]:
            answers = []
            async with WebSocketCall(self.app, "/track/stream", headers=self.headers(name)) as ws:
                for message in messages:
                    await ws.send_bytes(message)
                    text = await ws.receive_text()
                    if text is None:
                        raise WarmupError(f"{self.prefix}{name}: the stream closed (code {ws.close_code}) "
                                          "before its answer")
                    answers.append(_checked_stream(self.prefix + name, json.loads(text)))
            return answers
        return await self.timed(name, run())


async def warm_app(app: Callable[..., Any], object_id: str, hw: tuple[int, int],
                   api_key: str | None) -> dict[str, float]:
    """Run each of :data:`APP_PATHS` once through ``app`` (the GPU process's): registers of ``object_id`` with PNG
    images and in a binary body, tracks of their sessions with PNG and raw images, in a binary body and several
    sessions in one request, a stream (a start from the first register's pose, then a frame: its register message
is the binary register's container and parser), then the sessions deleted. Returns ms per path;
    :class:`WarmupError` when a path fails. Call it in a :func:`warm_task`."""
    frame = _Frame.of(hw)
    paths: dict[str, float] = {}
    client = _Client(app, api_key, paths)
    rgb_png, depth_png = codecs.encode_rgb_png(frame.rgb), codecs.encode_depth_png_mm(frame.depth_mm / 1000.0)
    png = {"rgb": rgb_png, "depth": depth_png}
    sessions: list[str] = []
    failed = True
    try:
        first = await client.form("register_png", "/register", {"object_id": object_id, "K": frame.K_json},
                                  {**png, "mask": codecs.encode_mask_png(frame.mask)})
        sessions.append(first["session_id"])
        second = await client.http("register_binary", "POST", "/register/binary",
                                   register_message(object_id, frame.K, frame.rgb, frame.depth_mm, frame.mask),
                                   _BINARY)
        sessions.append(second["session_id"])
        await client.form("track_png", "/track", {"session_id": sessions[0]}, png)
        h, w = frame.depth_mm.shape
        await client.form("track_raw", "/track", {"session_id": sessions[0], "rgb_shape": f"{h},{w},3",
                                                  "depth_shape": f"{h},{w}", "depth_dtype": "uint16"},
                          {"rgb": frame.rgb.tobytes(), "depth": frame.depth_mm.tobytes()})
        await client.http("track_binary", "POST", "/track/binary",
                          track_body(frame.rgb, frame.depth_mm, session_id=sessions[1]), _BINARY)
        await client.form("track_sessions", "/track/sessions", {"session_ids": ",".join(sessions)}, png)
        await client.stream("stream", [start_message(object_id, frame.K, np.asarray(first["pose"])),
                                       frame_message(1, frame.rgb, frame.depth_mm)])
        failed = False
    finally:  # even after a failure: no session of the warm-up is left behind
        for session_id in sessions:
            try:
                await client.http("session_delete", "DELETE", f"/sessions/{session_id}")
            except WarmupError:
                if not failed:  # else the failure that got here is the one to report
                    raise
    return paths


async def warm_worker(app: Callable[..., Any], object_id: str, hw: tuple[int, int],
                      api_key: str | None) -> dict[str, float]:
    """Run each of :data:`WORKER_PATHS` once through an ingest worker's app (``app``: its routes): a register
    relayed to the GPU process, a binary track of its session and a stream (start from the register's pose, then a
    frame) served by the worker (decoded into its ring), and the session's delete, relayed. Returns ms per path;
    :class:`WarmupError` when a path fails. Call it in a :func:`warm_task`."""
    frame = _Frame.of(hw)
    paths: dict[str, float] = {}
    client = _Client(app, api_key, paths, prefix=f"{secrets.token_hex(2)}-")
    registered = await client.http("relayed_register", "POST", "/register/binary",
                                   register_message(object_id, frame.K, frame.rgb, frame.depth_mm, frame.mask),
                                   _BINARY)
    session_id = registered["session_id"]
    try:
        await client.http("track_binary", "POST", "/track/binary",
                          track_body(frame.rgb, frame.depth_mm, session_id=session_id), _BINARY)
        await client.stream("stream", [start_message(object_id, frame.K, np.asarray(registered["pose"])),
                                       frame_message(1, frame.rgb, frame.depth_mm)])
    finally:
        await client.http("relayed_delete", "DELETE", f"/sessions/{session_id}")
    return {name.split("-", 1)[1]: ms for name, ms in paths.items()}


def _error_of(body: Any) -> dict[str, Any]:
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else {}


def _ran(status: int, error: dict[str, Any]) -> bool:
    """200, or a 422 naming ``pose``: the step ran and the start pose was outside the working range."""
    return status == 200 or (status == 422 and error.get("field") == "pose")


def _checked(name: str, answer: AppAnswer) -> dict[str, Any]:
    try:
        body = json.loads(answer.body) if answer.body else {}
    except ValueError:
        body = {}
    error = _error_of(body)
    if not _ran(answer.status, error):
        detail = f"{error.get('type')}: {error.get('message')}" if error else answer.body[:200].decode("utf-8",
                                                                                                        "replace")
        raise WarmupError(f"warm-up path {name}: answered {answer.status} {detail}")
    return body


def _checked_stream(name: str, answer: dict[str, Any]) -> dict[str, Any]:
    if answer.get("type") == "error":
        error = _error_of(answer)
        status = 422 if error.get("field") == "pose" else 500
        if not _ran(status, error):
            raise WarmupError(f"warm-up path {name}: the stream answered {error.get('type')}: {error.get('message')}")
    return answer


def _multipart(fields: dict[str, str], files: dict[str, bytes]) -> tuple[bytes, str]:
    """A ``multipart/form-data`` body of ``fields`` and ``files`` (each part's file name is its field's) and its
    content type."""
    boundary = f"fp-warmup-{secrets.token_hex(12)}"
    out: list[bytes] = []
    for name, value in fields.items():
        out.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode())
    for name, data in files.items():
        out.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{name}"\r\n'
                   "Content-Type: application/octet-stream\r\n\r\n".encode())
        out.append(bytes(data))
        out.append(b"\r\n")
    out.append(f"--{boundary}--\r\n".encode())
    return b"".join(out), f"multipart/form-data; boundary={boundary}"
