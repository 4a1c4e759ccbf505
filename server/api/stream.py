"""``WS /track/stream`` (the protocol: :mod:`server.flow.stream`). The server never negotiates
``permessage-deflate`` (:func:`uvicorn_ws_options`; clients should not offer it either, see
:data:`server.client.STREAM_CONNECT_OPTIONS`): zlib on a 640x480 frame's raw pixels (1.5 MB) costs the client tens
of ms per frame and the server's event loop the inflate, outside every phase in ``timings_ms``, to save bandwidth
that loopback and LAN links do not need. Messages up to the upload limit reach the stream, which answers a larger
one with its own error (uvicorn's default cap, 16 MiB, would close the connection below a 20 MiB limit)."""

from __future__ import annotations

import secrets
from typing import Any

from fastapi import APIRouter, WebSocket

from server.flow.stream import ENDPOINT, SessionStream, Stream, run_stream

__all__ = ["router", "stream_of", "uvicorn_ws_options"]

router = APIRouter(tags=["pose"])

_WS_FRAMING_BYTES = 1 << 16  # room above the limit, so a message just over it is answered, not cut


def uvicorn_ws_options(max_message_bytes: int) -> dict[str, Any]:
    """The uvicorn settings of every server of this app (python -m server, the ingest workers, the tests' live
    servers) whose streams accept messages of up to ``max_message_bytes`` (the server's upload limit)."""
    return {"ws_per_message_deflate": False, "ws_max_size": int(max_message_bytes) + _WS_FRAMING_BYTES}


def stream_of(websocket: Any, handler: Any, stream_id: str, host: Any) -> Stream:
    """A :class:`~server.flow.stream.Stream` of an accepted connection, with ``host``'s limits and counters."""
    cfg = host.config
    return Stream(websocket, handler, stream_id, max_message_bytes=cfg.max_upload_bytes, idle_s=cfg.stream_idle_s,
                  metrics=host.metrics, counters=host.streams)


@router.websocket(ENDPOINT)
async def track_stream(websocket: WebSocket) -> None:
    host = websocket.app.state.fp
    await websocket.accept()
    stream_id = secrets.token_hex(4)
    await run_stream(stream_of(websocket, SessionStream(host, stream_id), stream_id, host))
