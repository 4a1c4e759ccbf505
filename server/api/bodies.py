"""The request bodies' media types: each pose route reads one kind of body and says so when it gets another.

``POST /register`` and ``POST /track`` read a multipart form (:class:`MultipartRoute`); their ``/binary`` twins
read the message container as ``application/octet-stream`` (:func:`read_binary_body`). Either answers 415 naming
``Content-Type`` and the twin to use, before the body is parsed (a JSON body sent to a form route would otherwise
be told that its fields are missing).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import params
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from server.errors import UnsupportedMediaTypeError

__all__ = ["BINARY_CONTENT_TYPE", "MULTIPART_CONTENT_TYPE", "MultipartRoute", "read_binary_body"]

BINARY_CONTENT_TYPE = "application/octet-stream"
MULTIPART_CONTENT_TYPE = "multipart/form-data"


def _media_type(request: Request) -> tuple[str, str]:
    """(the request's media type, lower case without parameters; what it said, for a message)."""
    content_type = request.headers.get("content-type", "")
    return content_type.split(";")[0].strip().lower(), (ascii(content_type[:60]) if content_type else "none")


async def read_binary_body(request: Request, form_path: str = "/track") -> bytes:
    """The body of a ``POST /track/binary`` or ``/register/binary``; UnsupportedMediaTypeError (415) unless it is
    application/octet-stream. form_path: the multipart twin, named in the message."""
    media_type, shown = _media_type(request)
    if media_type != BINARY_CONTENT_TYPE:
        raise UnsupportedMediaTypeError(
            f"Content-Type: expected {BINARY_CONTENT_TYPE} (multipart forms go to POST {form_path}); got {shown}",
            field="Content-Type")
    return await request.body()


class MultipartRoute(APIRoute):
    """The API's route class: a route whose body is a form (its parameters are ``Form`` / ``File``) answers any
    other Content-Type with 415 before FastAPI parses it; other routes are plain ``APIRoute`` s."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if not any(isinstance(p.field_info, params.Form) for p in self.dependant.body_params):
            return handler
        twin = f"; binary bodies go to POST {self.path}/binary" if self.path in ("/register", "/track") else ""

        async def checked(request: Request) -> Response:
            media_type, shown = _media_type(request)
            if media_type != MULTIPART_CONTENT_TYPE:
                raise UnsupportedMediaTypeError(
                    f"Content-Type: expected {MULTIPART_CONTENT_TYPE} (a form with the files as parts{twin}); "
                    f"got {shown}", field="Content-Type")
            return await handler(request)

        return checked
