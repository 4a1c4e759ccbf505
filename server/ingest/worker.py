"""One ingest worker process: connections of the server's port, in its own interpreter (its own GIL).

``POST /track/binary``: it receives the HTTP request (uvicorn: uvloop + httptools), checks the Bearer key, parses the
body with the request flow's parser (:mod:`server.flow.inputs`) and decodes the frame straight into a slot of its
:class:`~deploy_core.memory.ring.FrameRing` (:mod:`server.ingest.relay`), then hands the typed request to the GPU
process (:mod:`server.ingest.hub`) as a few hundred bytes and sends back the answer it gets, byte for byte. Errors
it finds itself (401, 413, 415, 422, a full ring: 503) are the main port's answers, from the same middlewares and
parsers. ``WS /track/stream`` runs here too (:class:`~server.ingest.relay.RelayStream`). Every other request (registers, objects, sessions, ``/healthz``,
``/metrics``, the documentation) is relayed whole (:class:`RelayedHttp`): the GPU process's app answers it as if it
had received it itself. Every answer names the worker that received the request
(:data:`~server.ingest.protocol.WORKER_HEADER`).

Warm-up: when the GPU process asks (``warm``), the worker runs its paths once through its own app
(:func:`server.warmup.warm_worker`: a relayed register, its binary track and stream, a relayed delete) and reports
``warmed`` with their times (or the error); the server is ready only once every worker is warm.

Started by :class:`server.ingest.workers.IngestWorkers` (``python -m server.ingest.worker``), never by hand: it
serves the connections the GPU process accepted and passed to it (``--channel-fd``:
:class:`server.ingest.dispatch.ConnectionReceiver`), and exits when the GPU process goes away.
Torch-free: a worker costs ~60 MB of memory and starts in about a second.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import re
import secrets
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from deploy_core.memory.ring import FrameRing
from server.api.bodies import read_binary_body
from server.api.stream import uvicorn_ws_options
from server.auth import AuthMiddleware
from server.errors import OverloadedError, error_response, request_id_of
from server.flow import inputs
from server.flow.stream import ENDPOINT as STREAM_ENDPOINT
from server.flow.stream import Stream, run_stream
from server.gc_pauses import freeze_startup_objects
from server.ingest.dispatch import ConnectionReceiver
from server.ingest.protocol import WORKER_HEADER, ProtocolError, pack, read_message
from server.ingest.relay import RelayStream, relay_input
from server.loop_watch import LoopWatch
from server.metrics import Metrics, StreamCounters
from server.middleware import BodyLimitMiddleware, RequestContextMiddleware
from server.phases import Phases, ReceiveTimingMiddleware
from server.warmup import WARMING, warm_task, warm_worker

__all__ = ["OWN_ROUTES", "HubClient", "RelayedHttp", "WorkerSettings", "build_app", "main"]

log = logging.getLogger(__name__)

# the labels of requests answered before routing (401, 413), as the main port's middleware has them
_ROUTE_TEMPLATES = tuple((re.compile(f"^{re.escape(p)}$"), p) for p in ("/track/binary", "/track/stream"))
OWN_ROUTES = (("http", "/track/binary", "POST"), ("websocket", STREAM_ENDPOINT, None))  # served here, not relayed
_HUB_GRACE_S = 30.0  # beyond the GPU process's own request timeout (it answers 504 itself) before giving up


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """What one worker needs of the server's configuration."""

    hub_path: Path
    max_image_hw: tuple[int, int]
    slots: int = 32
    max_upload_bytes: int = 20 * 1024 * 1024
    retry_after_s: int = 1
    request_timeout_s: float = 60.0
    stream_idle_s: float = 60.0
    graceful_s: float = 5.0  # uvicorn's graceful shutdown: requests in progress are answered within it
    api_key: str | None = None


class HubClient:
    """The worker's connection to the GPU process: one request at a time per id, answers matched by id."""

    def __init__(self) -> None:
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._reader_task: asyncio.Task | None = None
        self.closed = asyncio.Event()
        self.track_ms = 0.0  # the GPU process's latest measured track service time (each answer carries it)
        # called with the GPU process's {"op": "warm", ...} (the worker's app runs its warm-up then)
        self.on_warm: Callable[[dict[str, Any]], None] | None = None

    async def connect(self, path: Path, ring: FrameRing) -> None:
        """Connect and introduce ``ring``; RuntimeError when the GPU process refuses it."""
        self._reader, self._writer = await asyncio.open_unix_connection(str(path))
        self._writer.write(pack({"op": "hello", "pid": os.getpid(), "ring": str(ring.path), "slots": ring.slots,
                                 "max_hw": list(ring.max_hw)}))
        await self._writer.drain()
        message = await read_message(self._reader)
        if message is None or message[0].get("op") != "ready":
            reason = "connection closed" if message is None else message[0].get("reason", message[0])
            raise RuntimeError(f"the GPU process refused this ingest worker: {reason}")
        self.track_ms = float(message[0].get("track_ms", 0.0))
        self._reader_task = asyncio.create_task(self._read_answers())

    async def send(self, header: dict[str, Any], body: bytes = b"") -> asyncio.Future:
        """Send one request (``body``: a relayed request's bytes); the future gets its (answer header, body), or
        ConnectionError when the GPU process is gone. The future settles exactly when the GPU process is done with
        the request's slot. A request of this worker's warm-up (:data:`server.warmup.WARMING` set) is sent with
        ``"warmup": true``."""
        if self.closed.is_set() or self._writer is None:
            raise ConnectionError("the GPU process is gone")
        request_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        marked = {**header, "id": request_id, "warmup": True} if WARMING.get() else {**header, "id": request_id}
        self._writer.write(pack(marked, body))
        await self._writer.drain()
        return future

    def notify(self, header: dict[str, Any]) -> None:
        """Send a message that has no answer (a stream's end); nothing when the GPU process is gone."""
        if not self.closed.is_set() and self._writer is not None:
            self._writer.write(pack(header))

    async def _read_answers(self) -> None:
        assert self._reader is not None
        try:
            while True:
                message = await read_message(self._reader)
                if message is None:
                    break
                header, body = message
                if header.get("op") == "warm":
                    if self.on_warm is not None:
                        self.on_warm(header)
                    continue
                self.track_ms = float(header.get("track_ms", self.track_ms))
                future = self._pending.pop(int(header.get("id", -1)), None)
                if future is not None and not future.done():
                    future.set_result((header, body))
        except (ProtocolError, ConnectionError) as exc:
            log.error("ingest worker %d: the GPU process's connection broke: %s", os.getpid(), exc)
        finally:
            self.closed.set()
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(ConnectionError("the GPU process is gone"))
            self._pending.clear()

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._reader_task is not None:
            await asyncio.gather(self._reader_task, return_exceptions=True)


def build_app(settings: WorkerSettings, ring: FrameRing, hub: HubClient, *,
              on_hub_closed: Any = None, background: Callable[[], Awaitable[None]] | None = None,
              loop_watch: LoopWatch | None = None) -> _Routes:
    """The worker's ASGI app (its own routes, :data:`OWN_ROUTES`, and :class:`RelayedHttp` for the rest); the hub
    connection opens in its lifespan (a refusal ends the worker). ``background``:
    a coroutine function run as a task while the app lives (after the hub connection), cancelled at shutdown.
    loop_watch: watches the worker's event loop while the app lives; its counters go to the GPU process with the
    worker's answer counts."""

    async def track_binary(request: Request) -> Response:
        data = await read_binary_body(request)
        request_id = request_id_of(request)
        phases = Phases.for_request(request.scope, request_id)  # receive, then parse from here
        track = inputs.track_of_body(data)  # the main port's parse: its refusals, word for word
        phases.lap("parse")
        try:
            answer, body = await relay_input(hub, ring, {"op": "track", "request_id": request_id}, track,
                                             settings.max_image_hw, phases,
                                             timeout_s=settings.request_timeout_s + _HUB_GRACE_S)
        except ConnectionError as exc:
            raise _unreachable(settings.retry_after_s) from exc
        headers = {str(k): str(v) for k, v in answer.get("headers", ())}
        return Response(body, status_code=int(answer["status"]), headers=headers,
                        media_type=answer.get("media_type", "application/json"))

    metrics = Metrics()  # the worker's own counters; the GPU process's /metrics counts what it answered
    streams = StreamCounters()

    async def track_stream(websocket: WebSocket) -> None:
        await websocket.accept()
        stream_id = secrets.token_hex(4)
        handler = RelayStream(hub, ring, stream_id, max_image_hw=settings.max_image_hw,
                              answer_timeout_s=settings.request_timeout_s + _HUB_GRACE_S)
        await run_stream(Stream(websocket, handler, stream_id, max_message_bytes=settings.max_upload_bytes,
                                idle_s=settings.stream_idle_s, metrics=metrics, counters=streams))

    @asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        try:
            await hub.connect(settings.hub_path, ring)
        finally:
            ring.unlink()  # the GPU process has mapped it (or refused it): no file is left behind either way
        if loop_watch is not None:
            loop_watch.start()
        watcher = asyncio.create_task(_watch(hub, on_hub_closed))
        reporter = asyncio.create_task(_report(hub, metrics, streams, loop_watch))
        extra = asyncio.create_task(background()) if background is not None else None
        try:
            yield
        finally:
            watcher.cancel()
            reporter.cancel()
            if extra is not None:
                extra.cancel()
            if loop_watch is not None:
                loop_watch.stop()
            hub.notify(_stats(metrics, streams, loop_watch))  # the last ones
            await hub.close()

    own = Starlette(
        routes=[Route("/track/binary", track_binary, methods=["POST"]), WebSocketRoute(STREAM_ENDPOINT, track_stream)],
        middleware=[
            Middleware(RequestContextMiddleware, metrics=metrics, retry_after_s=settings.retry_after_s,
                       templates=_ROUTE_TEMPLATES),
            Middleware(AuthMiddleware, api_key=settings.api_key, docs=False),
            Middleware(BodyLimitMiddleware, max_bytes=settings.max_upload_bytes),
            Middleware(ReceiveTimingMiddleware),
        ],
        lifespan=lifespan,
    )
    routes = _Routes(own, RelayedHttp(hub, max_body_bytes=settings.max_upload_bytes,
                                      timeout_s=settings.request_timeout_s + _HUB_GRACE_S,
                                      retry_after_s=settings.retry_after_s))
    warming: set[asyncio.Task] = set()

    def on_warm(header: dict[str, Any]) -> None:
        task = warm_task(_warm_up(routes, hub, header, settings.api_key))
        warming.add(task)
        task.add_done_callback(warming.discard)

    hub.on_warm = on_warm
    return routes


async def _warm_up(app: _Routes, hub: HubClient, header: dict[str, Any], api_key: str | None) -> None:
    """Run this worker's paths once (:func:`server.warmup.warm_worker`) as the GPU process asked, then report
    ``warmed`` with their times, or the error."""
    try:
        hw = (int(header["hw"][0]), int(header["hw"][1]))
        paths = await warm_worker(app, str(header["object_id"]), hw, api_key)
    except Exception as exc:  # noqa: BLE001 - reported to the GPU process, which fails its start-up with it
        log.error("ingest worker %d: warm-up failed: %s: %s", os.getpid(), type(exc).__name__, exc)
        hub.notify({"op": "warmed", "error": f"{type(exc).__name__}: {exc}"})
        return
    log.info("ingest worker %d warm: %s", os.getpid(), ", ".join(f"{k} {v:.0f} ms" for k, v in paths.items()))
    hub.notify({"op": "warmed", "paths": paths})


def _unreachable(retry_after_s: int) -> OverloadedError:
    """The refusal of a request this worker cannot hand to the GPU process (gone, or no answer in time)."""
    return OverloadedError("the GPU process is not reachable from this ingest worker",
                           retry_after_ms=retry_after_s * 1e3)


class _Routes:
    """The worker's ASGI app: :data:`OWN_ROUTES` (and the lifespan) to ``own``, every other request to ``relayed``;
    every HTTP answer names this process in :data:`~server.ingest.protocol.WORKER_HEADER`."""

    def __init__(self, own: Starlette, relayed: RelayedHttp) -> None:
        self.own, self.relayed = own, relayed
        self._named = (WORKER_HEADER.lower().encode("latin-1"), str(os.getpid()).encode("latin-1"))

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        kind = scope["type"]
        own = kind == "lifespan" or (kind, scope.get("path"), scope.get("method")) in OWN_ROUTES
        app = self.own if own else self.relayed
        if kind != "http":
            await app(scope, receive, send)
            return

        async def named(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self._named]}
            await send(message)

        await app(scope, receive, named)


class RelayedHttp:
    """Relays a request the worker does not serve to the GPU process's app (``{"op": "http"}``: method, path, query,
    headers and client, the body as the message's body) and sends its answer back as it came. The GPU process's
    middlewares give it its request id, check its key and its body's size, count it and log it, as for a request it
    received itself (the worker's own metrics do not count it). A body over ``max_body_bytes`` is not read further:
    the part read (one byte over) goes on, so the GPU process answers its 413. A WebSocket on another path is closed as the app closes one it has no route for.
    When the GPU process cannot be reached: 503 (:func:`~server.errors.error_response`)."""

    def __init__(self, hub: HubClient, *, max_body_bytes: int, timeout_s: float, retry_after_s: int) -> None:
        self.hub, self.max_body_bytes = hub, max_body_bytes
        self.timeout_s, self.retry_after_s = timeout_s, retry_after_s

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1000, "reason": ""})
            return
        body = await self._body(receive)
        if body is None:  # the client went away inside its body: nobody to answer, nothing for the app
            log.info("ingest worker %d: the client of %s %s went away before its body ended", os.getpid(),
                     scope["method"], scope["path"])
            return
        header = {"op": "http", "method": scope["method"], "path": scope["path"],
                  "raw_path": (scope.get("raw_path") or b"").decode("latin-1"),
                  "query": scope.get("query_string", b"").decode("latin-1"),
                  "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in scope.get("headers", ())],
                  "client": list(scope["client"]) if scope.get("client") else None}
        try:
            answered = await self.hub.send(header, body)
            answer, content = await asyncio.wait_for(answered, self.timeout_s)
        except (ConnectionError, TimeoutError) as exc:
            refusal = error_response(_unreachable(self.retry_after_s), request_id_of(scope),
                                     retry_after_s=self.retry_after_s)
            await refusal(scope, receive, send)
            if isinstance(exc, TimeoutError):
                log.warning("ingest worker %d: no answer to %s %s in %.0f s", os.getpid(), scope["method"],
                            scope["path"], self.timeout_s)
            return
        await send({"type": "http.response.start", "status": int(answer["status"]),
                    "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in answer["headers"]]})
        await send({"type": "http.response.body", "body": content})

    async def _body(self, receive: Callable) -> bytes | None:
        """The request's body, up to one byte over the limit; None when the client leaves before its end."""
        chunks, size = [], 0
        while size <= self.max_body_bytes:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            chunks.append(chunk)
            size += len(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)[:self.max_body_bytes + 1]


_REPORT_S = 1.0  # how often a worker sends its answer counts to the GPU process's /metrics


def _stats(metrics: Metrics, streams: StreamCounters, loop_watch: LoopWatch | None) -> dict[str, Any]:
    stats = {"op": "stats", "requests": metrics.request_counts(),
             "streams": [streams.open, streams.received, streams.skipped]}
    if loop_watch is not None:
        stats["loop"] = loop_watch.snapshot().as_list()
    return stats


async def _report(hub: HubClient, metrics: Metrics, streams: StreamCounters, loop_watch: LoopWatch | None) -> None:
    """Send this worker's answer, stream and event-loop counts (cumulative) to the GPU process about once a
    second."""
    while not hub.closed.is_set():
        await asyncio.sleep(_REPORT_S)
        hub.notify(_stats(metrics, streams, loop_watch))


async def _watch(hub: HubClient, on_closed: Any) -> None:
    await hub.closed.wait()
    log.warning("ingest worker %d: the GPU process went away; stopping", os.getpid())
    if on_closed is not None:
        on_closed()


def _parse_hw(text: str) -> tuple[int, int]:
    w, _, h = text.lower().partition("x")
    return int(h), int(w)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m server.ingest.worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--hub", type=Path, required=True, help="the GPU process's ingest socket")
    p.add_argument("--channel-fd", type=int, required=True,
                   help="the inherited Unix socket over which the GPU process passes accepted connections")
    p.add_argument("--max-image", type=_parse_hw, required=True, help="WxH, the server's largest image")
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--max-upload-bytes", type=int, default=20 * 1024 * 1024)
    p.add_argument("--retry-after-s", type=int, default=1)
    p.add_argument("--request-timeout-s", type=float, default=60.0)
    p.add_argument("--stream-idle-s", type=float, default=60.0)
    p.add_argument("--graceful-s", type=float, default=5.0)
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--loop-stall-s", type=float, default=2.0,
                   help="log the event loop's stack when it runs no timer for this long (0: off; default 2)")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s ingest[{os.getpid()}] %(name)s: %(message)s")
    settings = WorkerSettings(hub_path=args.hub, max_image_hw=args.max_image, slots=args.slots,
                              max_upload_bytes=args.max_upload_bytes, retry_after_s=args.retry_after_s,
                              request_timeout_s=args.request_timeout_s, stream_idle_s=args.stream_idle_s,
                              graceful_s=args.graceful_s, api_key=os.environ.get("FP_API_KEY") or None)
    import uvicorn

    ring = FrameRing.create(settings.slots, settings.max_image_hw)
    hub = HubClient()
    server: uvicorn.Server | None = None

    def stop() -> None:
        if server is not None:
            server.should_exit = True

    async def after_start() -> None:
        """Once uvicorn has started: freeze the start-up's objects (:mod:`server.gc_pauses`), then serve the
        connections the GPU process passes (--channel-fd) until the app's lifespan ends."""
        while not server.started:
            if server.should_exit:
                return
            await asyncio.sleep(0.01)
        freeze_startup_objects()
        receiver = ConnectionReceiver(args.channel_fd, uvicorn_protocol_factory(server),
                                      lambda: len(server.server_state.connections))
        receiver.start()
        try:
            await asyncio.Event().wait()  # until the app's lifespan ends (cancelled)
        finally:
            receiver.stop()

    watch = LoopWatch(args.loop_stall_s, name=f"ingest worker {os.getpid()}") if args.loop_stall_s > 0 else None
    app = build_app(settings, ring, hub, on_hub_closed=stop, background=after_start, loop_watch=watch)
    config = uvicorn.Config(app, log_level=args.log_level.lower(), access_log=False, lifespan="on",
                            timeout_graceful_shutdown=max(1, round(settings.graceful_s)), **uvicorn_ws_options(settings.max_upload_bytes))
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[])  # every connection comes from the GPU process, over --channel-fd
    finally:
        ring.unlink()
    return 0 if server.started else 1


def uvicorn_protocol_factory(server: Any) -> Callable[[], asyncio.Protocol]:
    """What uvicorn's ``Server.startup`` builds a listening socket's connections with (uvicorn 0.34-0.55: the HTTP
    protocol class of the loaded config, with the server's state and the lifespan's state), for connections accepted
    elsewhere. Valid from the server's lifespan start-up on (its config is loaded and its lifespan made by then)."""
    config = server.config

    def create_protocol() -> asyncio.Protocol:
        return config.http_protocol_class(config=config, server_state=server.server_state,
                                          app_state=server.lifespan.state)
    return create_protocol


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
