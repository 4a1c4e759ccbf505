"""Errors the server raises itself, and the one table that turns any exception into an HTTP answer.

::

    ServerError                       raised by the HTTP layer
    ├─ AuthError            401       no or wrong ``Authorization: Bearer <key>``
    ├─ NotReadyError        503       engines still loading / warming up (Retry-After)
    ├─ ConflictError        409       an object id that is already taken
    ├─ ObjectStoreFullError 507       the object count or memory cap is reached (delete objects first)
    ├─ RequestTimeoutError  504       no pose within ``request_timeout_s``
    ├─ PoseDivergedError    500       the pipeline returned a non-finite pose (session unchanged)
    ├─ OverloadedError      503       a lane's admission is full (Retry-After from measured service times)
    │  └─ SessionBusyError  429       this session already has a request running and one waiting
    └─ PayloadTooLargeError 413       body above ``max_upload_bytes`` (also an HTTPException, so
                                      FastAPI's form parser lets it through)
    ImageTooLargeError(CapacityError) 413  image above ``max_image_hw`` (carries ``.field``)
    SessionLimitError(BusyError)      503  the session cap is reached and every session is busy
    ForwardedError                    any  an error classified in another process (a Ray Serve
                                           replica), answered exactly as it was classified there

Everything else is mapped in :func:`classify` (the only place): ``InputTooLargeError`` -> 413,
``InputError`` -> 422 (as is a multipart body FastAPI cannot parse, which it answers 400),
``CapacityError`` -> 413, unknown object / session -> 404, ``BusyError`` -> 503 + Retry-After,
``NonFinitePoseError`` (the library's non-finite pose) -> 500 ``PoseDivergedError`` with its message (the
input was valid: nothing the client can fix), ``DeadlineError`` (the request passed its deadline inside the
service) -> 504 ``RequestTimeoutError``,
``ClosedError`` / ``BrokenPipelineError`` -> 503, anything unexpected -> 500 with the request id
and no detail (the traceback goes to the server log). Every error body reads::

    {"error": {"type": "InputError", "field": "depth", "message": "...", "request_id": "..."}}
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from deploy_core.errors import BrokenPipelineError, BusyError, CapacityError, ClosedError, DeadlineError
from foundationpose.errors import (
    InputError,
    InputTooLargeError,
    NonFinitePoseError,
    UnknownObjectError,
    UnknownSessionError,
)
from server.fields import EXPECTED

__all__ = [
    "CLIENT_GONE",
    "AuthError",
    "ConflictError",
    "ErrorInfo",
    "ForwardedError",
    "ImageTooLargeError",
    "NotReadyError",
    "ObjectStoreFullError",
    "OverloadedError",
    "PayloadTooLargeError",
    "PoseDivergedError",
    "RequestTimeoutError",
    "ServerError",
    "SessionBusyError",
    "SessionLimitError",
    "UnsupportedMediaTypeError",
    "allow_header",
    "classify",
    "client_gone",
    "error_object",
    "error_response",
    "install_error_handlers",
    "method_table",
    "request_id_of",
]

log = logging.getLogger(__name__)

CLIENT_GONE = 499  # the status counted for a request whose client went away before its answer (nginx's)


class ServerError(Exception):
    """Base of the errors raised by the HTTP layer; ``status`` is the HTTP status it maps to."""

    status = 500

    def __init__(self, message: str, *, field: str | None = None) -> None:
        # Not super(): with a second base (Starlette's HTTPException, whose first argument is the
        # status code in older releases) the MRO would hand it the message.
        Exception.__init__(self, message)
        self.field = field


class AuthError(ServerError):
    """The request carries no API key, or the wrong one."""

    status = 401


class NotReadyError(ServerError):
    """The server is still loading networks and objects, or shutting down; retry later."""

    status = 503


class ConflictError(ServerError):
    """The resource already exists (e.g. an object id); delete it first."""

    status = 409


class ObjectStoreFullError(ServerError):
    """The server holds as many objects (or as much object memory) as it is configured for."""

    status = 507


class RequestTimeoutError(ServerError):
    """No result within the server's request timeout; the work may still finish and is discarded."""

    status = 504


class UnsupportedMediaTypeError(ServerError):
    """The body's Content-Type is not one the endpoint reads (e.g. a multipart form sent to /track/binary)."""

    status = 415


class PoseDivergedError(ServerError):
    """The pipeline produced a pose with NaN or inf entries; session state was not changed."""

    status = 500


class OverloadedError(ServerError):
    """Admission refused the request: the lane has no room now. Retry after ``retry_after_ms``.

    ``retry_after_ms`` is an estimate from the lane's measured service time; the answer carries it as
    ``Retry-After`` (whole seconds, rounded up: the header cannot say less) and ``Retry-After-Ms``.
    """

    status = 503

    def __init__(self, message: str, *, retry_after_ms: float, field: str | None = None) -> None:
        super().__init__(message, field=field)
        self.retry_after_ms = max(0.0, float(retry_after_ms))

    @property
    def headers(self) -> tuple[tuple[str, str], ...]:
        seconds = max(1, math.ceil(self.retry_after_ms / 1e3))
        return (("Retry-After", str(seconds)), ("Retry-After-Ms", str(max(1, math.ceil(self.retry_after_ms)))))


class SessionBusyError(OverloadedError):
    """The session has a track running and one waiting already: slow down (or stream, newest frame wins)."""

    status = 429


class PayloadTooLargeError(ServerError, StarletteHTTPException):
    """The request body is larger than ``max_upload_bytes``."""

    status = 413

    def __init__(self, message: str) -> None:
        ServerError.__init__(self, message, field="body")
        StarletteHTTPException.__init__(self, status_code=413, detail=message)

    def __str__(self) -> str:
        return str(self.detail)


class ImageTooLargeError(CapacityError):
    """An uploaded image has more pixels than the server's ``max_image_hw`` (checked from its header)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class SessionLimitError(BusyError):
    """A new session is needed, the session cap is reached and every session has a request in progress."""


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    """How one exception is answered: status, ``type`` and ``message`` of the body, extra headers."""

    status: int
    type: str
    message: str
    field: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    internal: bool = False  # unexpected: log with traceback, hide the message


class ForwardedError(Exception):
    """An error already classified elsewhere (``info`` from :func:`classify` in a pose replica's process).

    Typed errors do not all survive pickling (``InputError`` takes four arguments), so a replica
    sends the plain :class:`ErrorInfo` and the ingress raises this to answer it unchanged.
    """

    def __init__(self, info: ErrorInfo) -> None:
        super().__init__(info.message)
        self.info = info

    def __reduce__(self):  # picklable whatever ``args`` holds
        return (ForwardedError, (self.info,))


def _validation_info(exc: RequestValidationError) -> ErrorInfo:
    """FastAPI's own checks (required fields, id patterns) in the ``<field>: expected X; got Y`` form."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(part) for part in first.get("loc", ()) if part not in ("body", "query", "path", "header")]
    field = loc[-1] if loc else None
    kind = first.get("type")
    expected = EXPECTED.get(field or "")
    if kind == "missing":  # FastAPI also reports an empty form field (K="") as missing
        message = f"{field}: expected {expected or 'a value'}; got nothing (the field is missing or empty)"
    elif kind == "string_pattern_mismatch" and expected is not None:
        message = f"{field}: expected {expected}; got {str(first.get('input'))[:80]!r}"
    else:
        msg = str(first.get("msg", "invalid request"))
        message = f"{field}: {msg}" if field else msg
    return ErrorInfo(422, "InputError", message, field)


def classify(exc: BaseException, *, retry_after_s: int = 1) -> ErrorInfo:
    """The single mapping from exception to HTTP answer (see the module docstring)."""
    retry = (("Retry-After", str(retry_after_s)),)
    if client_gone(exc):
        return ErrorInfo(CLIENT_GONE, "ClientDisconnected", "the client went away before the answer", None)
    if isinstance(exc, ForwardedError):
        return exc.info
    if isinstance(exc, InputTooLargeError):
        return ErrorInfo(413, "InputTooLargeError", str(exc), exc.field)
    if isinstance(exc, InputError):
        return ErrorInfo(422, "InputError", str(exc), exc.field)
    if isinstance(exc, PayloadTooLargeError):
        return ErrorInfo(413, "PayloadTooLargeError", str(exc), "body")
    if isinstance(exc, AuthError):
        return ErrorInfo(401, "AuthError", str(exc), None, (("WWW-Authenticate", "Bearer"),))
    if isinstance(exc, NotReadyError):
        return ErrorInfo(503, "NotReadyError", str(exc), None, retry)
    if isinstance(exc, OverloadedError):
        return ErrorInfo(exc.status, type(exc).__name__, str(exc), exc.field, exc.headers)
    if isinstance(exc, ServerError):
        return ErrorInfo(exc.status, type(exc).__name__, str(exc), exc.field)
    if isinstance(exc, NonFinitePoseError):
        return ErrorInfo(500, "PoseDivergedError", str(exc), None)
    if isinstance(exc, DeadlineError):
        return ErrorInfo(504, "RequestTimeoutError", f"no pose within the request timeout ({exc})", None)
    if isinstance(exc, CapacityError):
        return ErrorInfo(413, type(exc).__name__, str(exc), getattr(exc, "field", None))
    if isinstance(exc, UnknownObjectError):
        return ErrorInfo(404, "UnknownObjectError", str(exc), "object_id")
    if isinstance(exc, UnknownSessionError):
        return ErrorInfo(404, "UnknownSessionError", str(exc), "session_id")
    if isinstance(exc, SessionLimitError):
        return ErrorInfo(503, "SessionLimitError", f"{exc}; retry in {retry_after_s} s", None, retry)
    if isinstance(exc, BusyError):
        return ErrorInfo(503, "BusyError", f"the pose pipeline is full; retry in {retry_after_s} s", None, retry)
    if isinstance(exc, ClosedError):
        return ErrorInfo(503, "ClosedError", "the server is shutting down", None, retry)
    if isinstance(exc, BrokenPipelineError):
        return ErrorInfo(503, "BrokenPipelineError", "the pose pipeline failed; the server needs a restart")
    if isinstance(exc, RequestValidationError):
        return _validation_info(exc)
    if isinstance(exc, StarletteHTTPException) and exc.status_code == 400:  # FastAPI: a body it cannot parse
        return ErrorInfo(422, "InputError", f"body: expected a multipart/form-data body; got one that cannot be "
                                            f"parsed ({exc.detail})", "body")
    if isinstance(exc, StarletteHTTPException):
        headers = tuple((exc.headers or {}).items())
        return ErrorInfo(exc.status_code, "HTTPError", str(exc.detail), None, headers)
    return ErrorInfo(500, "InternalError", "internal server error", None, internal=True)


def client_gone(exc: BaseException) -> bool:
    """Whether ``exc`` is (or was caused by) the client going away mid-request: not an error of the server (FastAPI
    turns it into a 400 while it parses a form, Starlette raises ``ClientDisconnect`` reading a body)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, ClientDisconnect):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def error_object(exc: BaseException) -> dict[str, Any]:
    """The ``error`` object of an answer that carries a failure beside other results (a stream message, one session
    of a several-session track): ``type``, ``message`` (hidden for an unexpected error), ``field`` and
    ``retry_after_ms`` where they apply."""
    info = classify(exc)
    error: dict[str, Any] = {"type": info.type, "message": "internal server error (see the server log)"
                             if info.internal else info.message}
    if info.field is not None:
        error["field"] = info.field
    if isinstance(exc, OverloadedError):
        error["retry_after_ms"] = round(exc.retry_after_ms, 1)
    return error


def request_id_of(scope_or_request: Request | dict) -> str:
    scope = scope_or_request.scope if isinstance(scope_or_request, Request) else scope_or_request
    return str(scope.get("state", {}).get("request_id", "-"))


def error_response(exc: BaseException, request_id: str, *, retry_after_s: int = 1,
                   state: dict[str, Any] | None = None) -> JSONResponse:
    """JSON error answer for ``exc``; unexpected exceptions are logged here, once, with traceback. state: the
    request's scope state, where the error's (type, field) is noted for its access line
    (:func:`server.middleware.finish_request`)."""
    info = classify(exc, retry_after_s=retry_after_s)
    if state is not None:
        state["error"] = (info.type, info.field)
    if info.internal:
        log.error("request %s failed with an unexpected %s", request_id, type(exc).__name__, exc_info=exc)
        message = f"internal server error (request id {request_id}; details are in the server log)"
    else:
        if info.status >= 500:
            log.warning("request %s: %d %s: %s", request_id, info.status, info.type, info.message)
        message = info.message
    body: dict[str, object] = {"type": info.type, "message": message, "request_id": request_id}
    if info.field is not None:
        body["field"] = info.field
    headers = dict(info.headers)
    headers["X-Request-ID"] = request_id
    return _AsciiJSONResponse({"error": body}, status_code=info.status, headers=headers)


class _AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: an error message quoting client input can never carry a
    character UTF-8 cannot encode (a lone surrogate from a JSON header)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


MethodTable = tuple[tuple[re.Pattern[str], str], ...]


def method_table(routes: Iterable[Any]) -> MethodTable:
    """(path regex, ``Allow`` value) per path: the union of the methods of every route with that path."""
    by_path: dict[str, tuple[re.Pattern[str], set[str]]] = {}
    for route in routes:
        methods = getattr(route, "methods", None)
        if methods and hasattr(route, "path_regex"):
            by_path.setdefault(route.path, (route.path_regex, set()))[1].update(methods)
    return tuple((regex, ", ".join(sorted(methods))) for regex, methods in by_path.values())


def allow_header(table: MethodTable, path: str) -> str | None:
    """The ``Allow`` value for a request path (None when no route has that path)."""
    return next((allow for regex, allow in table if regex.match(path)), None)


def install_error_handlers(app, *, retry_after_s: int = 1, methods: MethodTable = ()) -> None:
    """Route every typed exception FastAPI can catch through :func:`error_response`.

    Unexpected exceptions are not registered here (Starlette would re-raise them after answering);
    the request-context middleware catches them and calls :func:`error_response` itself.
    methods: the app's :func:`method_table`; a 405 lists every method of its path from it
    (Starlette's own ``Allow`` names only the first route that matched the path).
    """

    async def handle(request: Request, exc: Exception) -> JSONResponse:
        response = error_response(exc, request_id_of(request), retry_after_s=retry_after_s,
                                  state=request.scope.setdefault("state", {}))
        allow = allow_header(methods, request.url.path) if isinstance(exc, StarletteHTTPException) \
            and exc.status_code == 405 else None
        if allow is not None:
            response.headers["Allow"] = allow
        return response

    for exc_type in (
        StarletteHTTPException,
        RequestValidationError,
        InputError,
        UnknownObjectError,
        UnknownSessionError,
        CapacityError,
        BusyError,
        ClosedError,
        BrokenPipelineError,
        ServerError,
        ForwardedError,
    ):
        app.add_exception_handler(exc_type, handle)
