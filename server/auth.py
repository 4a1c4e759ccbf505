"""Optional API key: ``Authorization: Bearer <key>`` on every route but ``/healthz`` and the docs.

The check is an ASGI middleware, so it also covers unknown paths and runs before any body is read.
The documentation (``/docs``, ``/redoc``, their assets and ``/openapi.json``) is public unless the
server runs with ``--no-docs``: a browser cannot send the header, and the schema holds no secret
(it does tell which routes exist: turn the docs off where that matters).
Keys are compared in constant time (``hmac.compare_digest`` of SHA-256 digests, so not even the
key's length leaks).
"""

from __future__ import annotations

import hashlib
import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import AuthError

__all__ = ["AuthMiddleware", "DOCS_ASSETS_PREFIX", "DOCS_PATHS", "PUBLIC_PATHS", "bearer_token", "is_public", "key_matches"]

PUBLIC_PATHS = frozenset({"/healthz"})
# The API documentation: pages, their bundled assets and the schema they read. Public so that a browser
# (which cannot send the bearer header) can open /docs; the API calls made from the page still need
# the key (Swagger UI's Authorize button). ``--no-docs`` removes them altogether.
DOCS_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
DOCS_ASSETS_PREFIX = "/docs-assets/"


def is_public(path: str, docs: bool) -> bool:
    """True for paths served without the API key (``docs``: the documentation is enabled)."""
    return path in PUBLIC_PATHS or (docs and (path in DOCS_PATHS or path.startswith(DOCS_ASSETS_PREFIX)))


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value, else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def key_matches(token: str | None, api_key: str) -> bool:
    """Constant-time comparison of a presented token with the configured key."""
    if token is None:
        return False
    presented = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
    expected = hashlib.sha256(api_key.encode("utf-8")).digest()
    return hmac.compare_digest(presented, expected)


class AuthMiddleware:
    """Raise :class:`AuthError` (401, answered by the request-context middleware) without a valid key.

    WebSocket upgrades need the same header; a refused one is answered 401 before the upgrade (or, where
    the server lacks the ASGI denial-response extension, closed with 1008 = policy violation).
    """

    def __init__(self, app: ASGIApp, api_key: str | None, docs: bool = False) -> None:
        self.app = app
        self.api_key = api_key
        self.docs = docs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and self.api_key is not None and not is_public(scope.get("path", ""), self.docs):
            header = None
            for name, value in scope.get("headers", ()):
                if name == b"authorization":
                    header = value.decode("latin-1")
                    break
            token = bearer_token(header)
            if not key_matches(token, self.api_key):
                message = "missing API key: send 'Authorization: Bearer <key>'" if token is None else "invalid API key"
                if scope["type"] == "websocket":
                    await _deny_websocket(scope, receive, send, message)
                    return
                raise AuthError(message)
        await self.app(scope, receive, send)


async def _deny_websocket(scope: Scope, receive: Receive, send: Send, message: str) -> None:
    await receive()  # websocket.connect
    if "websocket.http.response" in scope.get("extensions", {}):
        body = json.dumps({"error": {"type": "AuthError", "message": message, "request_id": "-"}}).encode("utf-8")
        await send({"type": "websocket.http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": 1008, "reason": message})
