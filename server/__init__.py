"""HTTP service for FoundationPose: ``create_app(ServerConfig(...))`` or ``python -m server --objects DIR``.

Routes: ``POST /objects``, ``GET /objects``, ``DELETE /objects/{id}``, ``POST /register``, ``POST /track``,
``GET|DELETE /sessions/{id}``, ``GET /healthz``, ``GET /readyz``, ``GET /metrics``.
"""

from server.app import create_app
from server.config import ServerConfig

__all__ = ["ServerConfig", "create_app"]
