"""A lean HTTP/1.1 keep-alive client for the load generator's track requests (issue 11: a load generator that is not
the bottleneck).

``httpx`` costs ~2 ms of client CPU per ``POST /track/binary`` of a 640x480 frame (1.5 MB): in a closed loop of
64 clients that CPU is inside every round trip and queues the 8 clients a load process runs. This client writes
the request line, the headers and the body to one keep-alive connection and reads a ``Content-Length`` answer,
nothing more: ~0.6 ms per request on the same machine. One :class:`RawHttpClient` is one connection with one
request at a time (a closed-loop client's own), opened on first use and again after the server closed it.

It answers what the load generator reads of an ``httpx.Response``: ``status_code``, ``headers`` (lower-case names),
``text`` and ``json()``. Loopback ``http://`` only; bodies are ``bytes``; an answer without ``Content-Length``
(chunked) is a :class:`RawHttpError`, as is every transport failure.

A kept-alive connection the server closed while it was idle (uvicorn closes one after 5 s without a request) fails
the next request before a byte of its answer arrives: that request is sent again, once, on a new connection, as
HTTP clients do (the server never read it). Any other failure is the request's.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

__all__ = ["RawHttpClient", "RawHttpError", "RawResponse"]

_MAX_HEAD_BYTES = 64 * 1024


class RawHttpError(Exception):
    """The request got no complete answer (connection refused or closed, a malformed or chunked answer)."""


class _StaleConnection(Exception):
    """A reused connection failed before any byte of the answer: the server had closed it."""


@dataclass(frozen=True, slots=True)
class RawResponse:
    status_code: int
    headers: dict[str, str]  # lower-case names; a repeated header keeps its last value
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.content)


class RawHttpClient:
    """One keep-alive connection to ``base_url`` (``http://host:port``); ``headers`` go with every request."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None, timeout: float = 120.0) -> None:
        url = urlsplit(base_url)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"RawHttpClient takes an http://host:port URL, got {base_url!r}")
        self.host, self.port = url.hostname, url.port or 80
        self.timeout = timeout
        self._fixed = "".join(f"{k}: {v}\r\n" for k, v in {"Host": f"{self.host}:{self.port}", **(headers or {})}.items())
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, *, content: bytes = b"",
                      headers: dict[str, str] | None = None) -> RawResponse:
        for attempt in (1, 2):
            try:
                return await asyncio.wait_for(self._exchange(method, path, content, headers or {}), self.timeout)
            except _StaleConnection as exc:
                await self.aclose()
                if attempt == 2:  # a new connection cannot be stale: not reached
                    raise RawHttpError(f"{method} {path}: {exc.__cause__!r}") from exc
            except (OSError, EOFError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError,
                    asyncio.TimeoutError) as exc:
                await self.aclose()
                raise RawHttpError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        raise AssertionError("unreachable")

    async def _exchange(self, method: str, path: str, content: bytes, headers: dict[str, str]) -> RawResponse:
        reused = self._writer is not None and not self._writer.is_closing()
        if not reused:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port, limit=_MAX_HEAD_BYTES)
        reader, writer = self._reader, self._writer
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        head = f"{method} {path} HTTP/1.1\r\n{self._fixed}{extra}Content-Length: {len(content)}\r\n\r\n"
        try:
            writer.write(head.encode("latin-1"))
            if content:
                writer.write(content)
            await writer.drain()
            answer_head = await reader.readuntil(b"\r\n\r\n")
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            nothing_read = not isinstance(exc, asyncio.IncompleteReadError) or not exc.partial
            if reused and nothing_read:
                raise _StaleConnection() from exc
            raise
        status, answer_headers = _parse_head(answer_head)
        if "content-length" not in answer_headers:
            raise ValueError(f"answer {status} without Content-Length (chunked answers are not read by this client)")
        body = await reader.readexactly(int(answer_headers["content-length"]))
        if answer_headers.get("connection", "").lower() == "close":
            await self.aclose()
        return RawResponse(status, answer_headers, body)

    async def aclose(self) -> None:
        writer, self._reader, self._writer = self._writer, None, None
        if writer is not None:
            writer.close()
            try:
                await writer.wait_closed()
            except OSError:
                pass


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    """(status, {lower-case name: value}) of an answer's status line and headers; ValueError when malformed."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise ValueError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:]:
        if line:
            name, sep, value = line.partition(":")
            if not sep:
                raise ValueError(f"malformed header line {line[:80]!r}")
            headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers
