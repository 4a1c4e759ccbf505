"""HTTP service for FoundationPose: ``create_app(ServerConfig(...))`` or ``python -m server --objects DIR``.

Routes (:mod:`server.api`, declared once for this server and the Ray Serve ingress): ``POST /objects``,
``GET /objects``, ``DELETE /objects/{id}``, ``POST /register`` (and ``/register/binary``), ``POST /track`` (and
``/track/binary``), ``WS /track/stream``, ``GET|DELETE /sessions/{id}``, ``GET /healthz``, ``GET /readyz``,
``POST /readyz/retry``, ``GET /metrics``. Every request goes through one request flow (:mod:`server.flow`).

Names resolve lazily, so ``python -m server --help`` imports neither torch nor FastAPI.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["ServerConfig", "create_app"]

_HOME = {"ServerConfig": "server.config", "create_app": "server.app"}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'server' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from server.app import create_app
    from server.config import ServerConfig
