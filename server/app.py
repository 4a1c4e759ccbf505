"""The FastAPI application factory: routes, middlewares, error handlers and the start-up/shutdown lifespan."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline
from starlette.middleware import Middleware

from foundationpose.estimator import PoseEstimator
from foundationpose.service import PoseService
from server import routes_objects, routes_ops, routes_pose, routes_stream
from server.auth import DOCS_ASSETS_PREFIX, PUBLIC_PATHS, AuthMiddleware
from server.config import ServerConfig
from server.errors import install_error_handlers
from server.middleware import BodyLimitMiddleware, RequestContextMiddleware, RouteTemplates
from server.openapi import document_track_exclusions, method_table
from server.phases import ReceiveTimingMiddleware
from server.state import ServerState

__all__ = ["create_app"]

API_DESCRIPTION = """
6D pose of known objects from RGB-D frames (FoundationPose): register an object in a first frame, then
track it frame to frame.

Conventions: `rgb` is read as **RGB** order; depth PNGs are 16-bit **millimetres**, depth `.npy` files
float32 **metres**; `K` is a 3x3 pinhole matrix in pixels; poses are 4x4 `cam_from_mesh` (mesh file
frame to OpenCV camera frame, metres). Errors read
`{"error": {"type", "field", "message", "request_id"}}`; a 503 carries `Retry-After`.

With an API key these pages stay reachable; to try the routes from here press **Authorize** and paste the key.
"""


def create_app(
    config: ServerConfig,
    *,
    estimator: PoseEstimator | None = None,
    service: PoseService | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> FastAPI:
    """Build the app. Networks load in the background when the lifespan starts (see ``ServerState``).

    estimator: an already built estimator (tests pass a tiny one); a ``PoseService`` is built on it at
        start and closed at shutdown. service: an already built service (the caller closes it).
    clock: the sessions' clock (seconds; tests inject a fake one).
    The state is reachable as ``app.state.fp`` (e.g. ``app.state.fp.wait_ready(timeout)``).
    """
    state = ServerState(config, estimator=estimator, service=service, clock=clock)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    settings: dict[str, Any] = dict(
        title="FoundationPose service",
        version="0.1.0",
        description=API_DESCRIPTION,
        lifespan=lifespan,
        middleware=[
            Middleware(RequestContextMiddleware, metrics=state.metrics, retry_after_s=config.retry_after_s,
                       templates=_route_templates()),
            Middleware(AuthMiddleware, api_key=config.api_key, docs=config.docs),
            Middleware(BodyLimitMiddleware, max_bytes=config.max_upload_bytes),
            Middleware(ReceiveTimingMiddleware),
        ],
    )
    if config.docs:  # Swagger UI / ReDoc assets served from the fastapi-offline package, never a CDN
        app = FastAPIOffline(static_url=DOCS_ASSETS_PREFIX.rstrip("/"),
                             swagger_ui_parameters={"persistAuthorization": True}, **settings)
    else:
        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, **settings)
    app.state.fp = state
    install_error_handlers(app, retry_after_s=config.retry_after_s, methods=method_table(_routes()))
    app.include_router(routes_ops.router)
    app.include_router(routes_objects.router)
    app.include_router(routes_pose.router)
    app.include_router(routes_stream.router)
    document_track_exclusions(app)
    if config.api_key is not None:
        _document_bearer_auth(app)
    return app


def _routes() -> list:
    return [*routes_ops.router.routes, *routes_objects.router.routes, *routes_pose.router.routes]


def _route_templates() -> RouteTemplates:
    """(regex, template) of every route, to label requests refused before routing (401, 413) in metrics."""
    templates = [(route.path_regex, route.path) for route in _routes() if hasattr(route, "path_regex")]
    templates += [(re.compile(f"^{re.escape(p)}$"), p) for p in ("/openapi.json", "/docs", "/redoc")]
    return tuple(templates)


def _document_bearer_auth(app: FastAPI) -> None:
    """Declare the bearer scheme in the OpenAPI schema (the check itself is ``AuthMiddleware``)."""
    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = default_openapi()
        schema.setdefault("components", {}).setdefault("securitySchemes", {})["bearer"] = {
            "type": "http", "scheme": "bearer",
            "description": "The server's API key (--api-key / FP_API_KEY). In /docs: Authorize, paste the key."}
        for path, operations in schema.get("paths", {}).items():
            if path in PUBLIC_PATHS:
                continue
            for operation in operations.values():
                operation["security"] = [{"bearer": []}]
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
