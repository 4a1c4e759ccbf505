"""Make the OpenAPI schema and the method answers tell the truth about the API.

* ``POST /track`` takes **either** ``session_id`` **or** the stateless ``pose`` + ``object_id``: stated in the
  request body's schema (JSON Schema ``not``/``anyOf``), not only in prose.
* A method a path does not serve answers 405 with an ``Allow`` header listing every method of that path
  (Starlette lists only the methods of the first route that matched the path, e.g. ``POST`` for ``/objects``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI

__all__ = ["MethodTable", "allow_header", "document_track_exclusions", "method_table"]

# (field, field) pairs a /track request must not carry together
TRACK_EXCLUSIVE = (("session_id", "pose"), ("session_id", "object_id"))


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


def document_track_exclusions(app: FastAPI) -> None:
    """Add the ``session_id`` exclusions to the schema of ``POST /track``'s multipart body."""
    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = default_openapi()
        content = schema["paths"]["/track"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
        ref = content.get("$ref", "")
        body = schema["components"]["schemas"][ref.rsplit("/", 1)[-1]] if ref else content
        body["not"] = {"anyOf": [{"required": list(pair)} for pair in TRACK_EXCLUSIVE]}
        body["description"] = ("Either session_id, or (stateless) pose, object_id and K; session_id excludes "
                               "pose and object_id.")
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
