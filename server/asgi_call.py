"""Calling an ASGI app in process, without a socket: one HTTP request (:func:`call_http`) or one WebSocket
connection (:class:`WebSocketCall`).

The ingest hub answers the requests its workers relay with :func:`call_http` on the GPU process's app, and the
start-up's warm-up (:mod:`server.warmup`) sends its requests through the app (and a worker through its own) with
both: the request goes through the app's middlewares, routes and handlers exactly as one received by uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["AppAnswer", "WebSocketCall", "WebSocketRefused", "call_http"]


@dataclass(frozen=True, slots=True)
class AppAnswer:
    """What the app answered: status, headers (latin-1 text pairs, as sent) and the whole body."""

    status: int
    headers: list[list[str]]
    body: bytes

    def header(self, name: str) -> str | None:
        """The first header called ``name`` (any case), or None."""
        lowered = name.lower()
        return next((v for k, v in self.headers if k.lower() == lowered), None)


async def call_http(app: Callable[..., Any], method: str, path: str, *, headers: Sequence[tuple[str, str]] = (),
                    body: bytes = b"", query: str = "", raw_path: str | None = None,
                    client: Sequence[Any] | None = None) -> AppAnswer:
    """One HTTP request through ``app``; its answer once the body's last part is sent. The request body arrives in
    one ``http.request`` message; after the answer the app's ``receive`` says the client disconnected. An exception
    the app raises after (or instead of) answering propagates (the answer so far is lost)."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path,
             "raw_path": (raw_path if raw_path is not None else path).encode("latin-1", "replace"),
             "query_string": query.encode("latin-1"), "root_path": "",
             "headers": [(k.encode("latin-1").lower(), v.encode("latin-1")) for k, v in headers],
             "client": tuple(client) if client else None, "server": None}
    answered = asyncio.Event()
    body_sent = False
    status, answer_headers, chunks = 500, [], []

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await answered.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status, answer_headers
        if message["type"] == "http.response.start":
            status = int(message["status"])
            answer_headers = [[k.decode("latin-1"), v.decode("latin-1")] for k, v in message.get("headers", ())]
        elif message["type"] == "http.response.body":
            chunks.append(bytes(message.get("body", b"")))
            if not message.get("more_body", False):
                answered.set()

    try:
        await app(scope, receive, send)
    finally:
        answered.set()
    return AppAnswer(status, answer_headers, b"".join(chunks))


class WebSocketRefused(Exception):
    """The app closed the WebSocket before accepting it (e.g. a wrong API key); ``code`` is its close code."""

    def __init__(self, code: int, reason: str = "") -> None:
        super().__init__(f"the WebSocket was refused: {code} {reason}".rstrip())
        self.code, self.reason = code, reason


class WebSocketCall:
    """One WebSocket connection to ``app`` at ``path``, in process: ``async with WebSocketCall(app, path) as ws``
    connects (:class:`WebSocketRefused` unless the app accepts), :meth:`send_bytes` sends a binary message,
    :meth:`receive_text` waits for the app's next text message (None once the app closed the connection), and
    leaving the block disconnects and waits for the app's handler to end."""

    def __init__(self, app: Callable[..., Any], path: str, *, headers: Sequence[tuple[str, str]] = ()) -> None:
        self.app, self.path = app, path
        self._headers = [(k.encode("latin-1").lower(), v.encode("latin-1")) for k, v in headers]
        self._incoming: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._outgoing: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.close_code: int | None = None

    async def __aenter__(self) -> WebSocketCall:
        scope = {"type": "websocket", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "scheme": "ws", "path": self.path, "raw_path": self.path.encode("latin-1"), "query_string": b"",
                 "root_path": "", "headers": self._headers, "client": None, "server": None, "subprotocols": []}
        await self._incoming.put({"type": "websocket.connect"})
        self._task = asyncio.create_task(self._run(scope))
        first = await self._outgoing.get()
        if first["type"] != "websocket.accept":
            await self._finish()
            raise WebSocketRefused(int(first.get("code", 1000)), str(first.get("reason", "")))
        return self

    async def _run(self, scope: dict[str, Any]) -> None:
        try:
            await self.app(scope, self._incoming.get, self._outgoing.put)
        finally:
            await self._outgoing.put({"type": "websocket.close", "code": 1006, "reason": "the handler ended"})

    async def send_bytes(self, data: bytes) -> None:
        await self._incoming.put({"type": "websocket.receive", "bytes": data})

    async def receive_text(self) -> str | None:
        """The app's next text message; None once it closed the connection (its code in :attr:`close_code`)."""
        if self.close_code is not None:
            return None
        message = await self._outgoing.get()
        if message["type"] == "websocket.close":
            self.close_code = int(message.get("code", 1000))
            return None
        return message.get("text") if message.get("text") is not None else bytes(message["bytes"]).decode()

    async def __aexit__(self, *exc_info: object) -> None:
        await self._finish()

    async def _finish(self) -> None:
        await self._incoming.put({"type": "websocket.disconnect", "code": 1000})
        if self._task is not None:
            with contextlib.suppress(Exception):
                await self._task
