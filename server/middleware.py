"""ASGI middlewares around the app: request context (id, metrics, last-resort errors) and the body limit.

Order, outermost first: :class:`RequestContextMiddleware` -> ``AuthMiddleware`` ->
:class:`BodyLimitMiddleware` -> FastAPI's exception middleware -> the routes. Typed errors raised by
the inner middlewares, and anything the routes did not expect, end up in the request-context
middleware, which answers them through :func:`server.errors.error_response` (the one mapping).
"""

from __future__ import annotations

import builtins
import logging
import re
import secrets
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import CLIENT_GONE, PayloadTooLargeError, client_gone, error_response
from server.metrics import Metrics

__all__ = ["BodyLimitMiddleware", "RequestContextMiddleware", "RouteTemplates", "endpoint_label", "finish_request"]

log = logging.getLogger(__name__)
access_log = logging.getLogger("server.access")

_CLIENT_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


RouteTemplates = tuple[tuple[re.Pattern[str], str], ...]


def endpoint_label(scope: Scope, templates: RouteTemplates = ()) -> str:
    """The route's path template (``/sessions/{session_id}``), never the raw path (bounded label values).

    Requests answered before routing (401, 413) are matched against ``templates`` (regex, template).
    """
    route = scope.get("route")
    if route is not None and isinstance(getattr(route, "path", None), str):
        return route.path
    path = scope.get("path", "")
    for pattern, template in templates:
        if pattern.match(path):
            return template
    return "unmatched"


_GROUP = getattr(builtins, "BaseExceptionGroup", ())  # Python >= 3.11


def _unwrap(exc: BaseException) -> BaseException:
    while _GROUP and isinstance(exc, _GROUP) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


class RequestContextMiddleware:
    """Give each request an id (``X-Request-ID``, client-provided if it looks safe), count and time it, answer any
    exception that reached this far with the mapped JSON error, and log one access line (``server.access``, at
    :func:`access_level`: its id, method, route, status and time, with the error's type and field when it failed). A client that went
    away before its answer is counted with status 499 and is no error of the server."""

    def __init__(self, app: ASGIApp, metrics: Metrics, retry_after_s: int = 1, templates: RouteTemplates = ()) -> None:
        self.app = app
        self.metrics = metrics
        self.retry_after_s = retry_after_s
        self.templates = templates

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = None
        for name, value in scope.get("headers", ()):
            if name == b"x-request-id":
                candidate = value.decode("latin-1")
                request_id = candidate if _CLIENT_ID_RE.match(candidate) else None
                break
        request_id = request_id or secrets.token_hex(8)
        scope.setdefault("state", {})["request_id"] = request_id
        started = time.perf_counter()
        status = 500
        response_started = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, response_started
            if message["type"] == "http.response.start":
                response_started = True
                status = int(message["status"])
                headers = list(message.get("headers", ()))
                if not any(k.lower() == b"x-request-id" for k, _ in headers):
                    headers.append((b"x-request-id", request_id.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        self.metrics.request_started()
        try:
            await self.app(scope, receive, send_with_id)
        except BaseException as raw:
            exc = _unwrap(raw)
            if isinstance(exc, Exception) and client_gone(exc):  # nobody to answer: not the server's error
                status = CLIENT_GONE
            elif response_started or not isinstance(exc, Exception):
                log.error("request %s failed after its answer started", request_id, exc_info=raw)
                raise
            else:
                response = error_response(exc, request_id, retry_after_s=self.retry_after_s,
                                          state=scope.setdefault("state", {}))
                await response(scope, receive, send_with_id)
        finally:
            finish_request(self.metrics, request_id, scope.get("method", "?"), endpoint_label(scope, self.templates),
                           status, time.perf_counter() - started, scope.get("state", {}))


# Routes of a camera's every frame: their answered requests are logged at DEBUG, as a stream's answered frames are
# (a formatted and written line per frame was the largest single share of the GPU process's host time per track,
# docs/benchmarks.md); their refusals and errors, and every other route's requests, at INFO.
FRAME_ROUTES = frozenset({"/track", "/track/binary", "/track/sessions"})


def access_level(endpoint: str, status: int) -> int:
    """The level of a request's access line: DEBUG for an answered frame route (status < 400), else INFO."""
    return logging.DEBUG if status < 400 and endpoint in FRAME_ROUTES else logging.INFO


def finish_request(metrics: Metrics, request_id: str, method: str, endpoint: str, status: int, seconds: float,
                   state: dict) -> None:
    """A request answered: counted and timed in ``metrics``, and its access line (``server.access``, at
    :func:`access_level`: its id, method, route, status and time, with the error's type and field that
    :func:`~server.errors.error_response` noted in ``state``). Every HTTP request of the app ends here, those an
    ingest worker relayed too."""
    metrics.request_finished(endpoint, method, status, seconds)
    level = access_level(endpoint, status)
    if not access_log.isEnabledFor(level):
        return
    error = state.get("error")
    access_log.log(level, "request_id=%s method=%s endpoint=%s status=%d ms=%.1f%s", request_id, method, endpoint,
                   status, seconds * 1e3, f" error={error[0]} field={error[1]}" if error else "")


class BodyLimitMiddleware:
    """Refuse bodies over ``max_bytes``: at once from ``Content-Length``, else while streaming.

    The streamed check raises :class:`PayloadTooLargeError` from ``receive``, inside the form parser,
    so nothing beyond ``max_bytes`` (+ one chunk) is ever read.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, size: str) -> PayloadTooLargeError:
        limit_mb = self.max_bytes / (1024 * 1024)
        return PayloadTooLargeError(f"body: expected at most {self.max_bytes} bytes ({limit_mb:g} MiB); got {size}")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > self.max_bytes:
                    raise self._too_large(f"Content-Length {declared}")
                break
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large(f"more than {self.max_bytes} bytes")
            return message

        await self.app(scope, limited_receive, send)
