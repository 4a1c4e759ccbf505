"""The messages between an ingest worker and the GPU process, over one Unix stream socket per worker.

Every message is ``uint32 header length, uint32 body length`` (little-endian), a UTF-8 JSON header, then the body
bytes. The frames of the requests a worker serves itself never travel here: they are in the worker's
:class:`~deploy_core.memory.ring.FrameRing`; a relayed request's body does.

worker -> GPU process::

    {"op": "hello", "pid", "ring", "slots", "max_hw"}                   first message; answered {"op": "ready"}
    {"op": "track", "id", "request_id", "input", "slot", "hw",          one POST /track/binary: its typed input
     "depth_in_range", "mask", "phases"}                                (server.flow.wire), its frame in slot
    {"op": "stream", "id", "stream", "frame", "input", "slot"?, "hw"?,  one message of a WS /track/stream: a
     "depth_in_range"?, "mask"?, "phases"}                              register, start or frame (images in slot)
    {"op": "end", "stream"}                                             the stream's connection ended (no answer)
    {"op": "http", "id", "method", "path", "raw_path", "query",         any other request, relayed whole (its body
     "headers", "client"}                                                is the message's body)
    {"op": "stats", "requests": [[endpoint, method, status, n], ...],   the worker's answer and stream counts so far
     "streams": [open, received, skipped], "loop"?}                     (about once a second; no answer)
    {"op": "warmed", "paths": {name: ms}}  or  {"op": "warmed", "error"} the worker's warm-up ran (no answer)

A ``track``, ``stream`` or ``http`` message of the worker's own warm-up carries ``"warmup": true``: the GPU process
serves it while it is still starting (:mod:`server.warmup`).

GPU process -> worker::

    {"op": "ready", "track_ms"}  or  {"op": "refused", "reason"}        the answer to hello
    {"op": "answer", "id", "status", "headers": [[name, value], ...],   + the HTTP body to send back, as is (a track:
     "media_type"?, "track_ms"}                                          its media type; relayed: every header)
    {"op": "answer", "id", "track_ms", "ok": true, "body", "timings"}    a stream message's answer, or
    {"op": "answer", "id", "track_ms", "ok": false, "status",           its error with the stream's judgement
     "closing": [code, reason] or null, "error"}                        (closing: how the stream must end, if it must)
    {"op": "warm", "object_id", "hw": [H, W]}                           run the worker's warm-up with this object and
                                                                         frame size, then report ``warmed``

``track_ms``: the track lane's measured service time, which a worker answers as ``Retry-After`` when its ring is
full (every refusal's wait comes from a measured time of the lane it waits for).
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

from server import jsonio

__all__ = ["MAX_BODY_BYTES", "MAX_HEADER_BYTES", "WORKER_HEADER", "ProtocolError", "pack", "read_message"]

_PREFIX = struct.Struct("<II")
MAX_HEADER_BYTES = 1 << 20  # a track header is a few hundred bytes
MAX_BODY_BYTES = 64 << 20  # answers are small JSON, relayed requests at most the upload limit (the hub's own bound)
WORKER_HEADER = "X-Ingest-Worker"  # on every HTTP answer sent through an ingest worker: its process id


class ProtocolError(Exception):
    """A malformed message: the connection is closed."""


def pack(header: dict[str, Any], body: bytes = b"") -> bytes:
    """One message: the prefix, the JSON header and the body."""
    head = jsonio.dumps(header)
    return b"".join((_PREFIX.pack(len(head), len(body)), head, body))


async def read_message(reader: asyncio.StreamReader,
                       max_body_bytes: int = MAX_BODY_BYTES) -> tuple[dict[str, Any], bytes] | None:
    """The next (header, body), or None at a clean end of the stream; ProtocolError on garbage, a cut message or
    a body over ``max_body_bytes``."""
    try:
        prefix = await reader.readexactly(_PREFIX.size)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise ProtocolError("connection closed inside a message prefix") from exc
        return None
    head_len, body_len = _PREFIX.unpack(prefix)
    if head_len > MAX_HEADER_BYTES or body_len > max_body_bytes:
        raise ProtocolError(f"message too large: header {head_len} bytes, body {body_len} bytes")
    try:
        rest = await reader.readexactly(head_len + body_len)  # one read: the header and the body
    except asyncio.IncompleteReadError as exc:
        raise ProtocolError("connection closed inside a message") from exc
    head, body = (rest[:head_len], rest[head_len:]) if body_len else (rest, b"")
    try:
        header = jsonio.loads(head)
    except ValueError as exc:
        raise ProtocolError(f"header is not JSON: {exc}") from exc
    if not isinstance(header, dict) or not isinstance(header.get("op"), str):
        raise ProtocolError("header must be a JSON object with an 'op'")
    return header, body
