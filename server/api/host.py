"""How a route reaches its server: the app's :class:`~server.flow.steps.Host` (``app.state.fp``)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends
from starlette.requests import HTTPConnection, Request

from server.errors import request_id_of
from server.phases import Phases

__all__ = ["HostDep", "host_of", "phases_of"]


def host_of(connection: HTTPConnection) -> Any:
    """FastAPI dependency: the host of the app serving ``connection`` (a request or a WebSocket)."""
    return connection.app.state.fp


HostDep = Annotated[Any, Depends(host_of)]


def phases_of(request: Request) -> Phases:
    """The request's stopwatch, started when its first byte arrived (:mod:`server.phases`)."""
    return Phases.for_request(request.scope, request_id_of(request))
