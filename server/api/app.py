"""The FastAPI app of a host: the routes of ``python -m server`` and of the Ray Serve ingress, declared once.

:func:`build_api` builds the FastAPI app of a :class:`~server.flow.steps.Host` (reached by the routes as
``app.state.fp``): the routes (:mod:`.ops`, :mod:`.objects`, :mod:`.pose`, :mod:`.stream`), the middlewares
(request context, API key, body limit, receive timing), the error handlers and the corrected OpenAPI schema
(:mod:`.docs`). What differs between the two servers is their host, not their routes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline
from starlette.middleware import Middleware

from server.api import objects, ops, pose, stream
from server.api.docs import finish_openapi
from server.auth import DOCS_ASSETS_PREFIX, AuthMiddleware
from server.errors import install_error_handlers, method_table
from server.middleware import BodyLimitMiddleware, RequestContextMiddleware, RouteTemplates
from server.phases import ReceiveTimingMiddleware

__all__ = ["build_api", "route_templates"]

_ROUTERS = (ops.router, objects.router, pose.router, stream.router)


def route_templates(routes: Sequence[Any]) -> RouteTemplates:
    """(regex, template) of every route, to label requests refused before routing (401, 413) in metrics."""
    templates = [(route.path_regex, route.path) for route in routes if hasattr(route, "path_regex")]
    templates += [(re.compile(f"^{re.escape(p)}$"), p) for p in ("/openapi.json", "/docs", "/redoc")]
    return tuple(templates)


def build_api(host: Any, *, title: str, description: str, lifespan: Callable[[FastAPI], Any] | None = None,
              outer: Sequence[Middleware] = ()) -> FastAPI:
    """The app of ``host`` (its ``config`` says: the API key, docs on or off, body limit, Retry-After).

    lifespan: the app's start-up/shutdown context. outer: middlewares around everything (outermost first).
    """
    cfg = host.config
    all_routes = [route for router in _ROUTERS for route in router.routes]
    settings: dict[str, Any] = dict(
        title=title, version="0.1.0", description=description, lifespan=lifespan,
        middleware=[
            *outer,
            Middleware(RequestContextMiddleware, metrics=host.metrics, retry_after_s=cfg.retry_after_s,
                       templates=route_templates(all_routes)),
            Middleware(AuthMiddleware, api_key=cfg.api_key, docs=cfg.docs),
            Middleware(BodyLimitMiddleware, max_bytes=cfg.max_upload_bytes),
            Middleware(ReceiveTimingMiddleware),
        ],
    )
    if cfg.docs:  # Swagger UI / ReDoc assets served from the fastapi-offline package, never a CDN
        app = FastAPIOffline(static_url=DOCS_ASSETS_PREFIX.rstrip("/"),
                             swagger_ui_parameters={"persistAuthorization": True}, **settings)
    else:
        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, **settings)
    app.state.fp = host
    install_error_handlers(app, retry_after_s=cfg.retry_after_s, methods=method_table(all_routes))
    for router in _ROUTERS:
        app.include_router(router)
    finish_openapi(app, api_key=cfg.api_key is not None)
    return app
