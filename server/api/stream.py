"""``WS /track/stream`` (the protocol: :mod:`server.flow.stream`). The server never negotiates
``permessage-deflate`` (:data:`UVICORN_WS_OPTIONS`; clients should not offer it either, see
:data:`server.client.STREAM_CONNECT_OPTIONS`): zlib on a 640x480 frame's raw pixels (1.5 MB) costs the client tens
of ms per frame and the server's event loop the inflate, outside every phase in ``timings_ms``, to save bandwidth
that loopback and LAN links do not need."""

from __future__ import annotations

import secrets
from typing import Any

from fastapi import APIRouter, WebSocket

from server.flow.stream import ENDPOINT, SessionStream, Stream, run_stream

__all__ = ["UVICORN_WS_OPTIONS", "router", "stream_of"]

router = APIRouter(tags=["pose"])

# uvicorn settings of every server of this app (python -m server, the ingest workers, the tests' live servers)
UVICORN_WS_OPTIONS: dict[str, Any] = {"ws_per_message_deflate": False}


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
