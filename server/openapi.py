"""Make the OpenAPI schema and the method answers tell the truth about the API.

* ``POST /track`` takes **either** ``session_id`` **or** the stateless ``pose`` + ``object_id``: stated in the
  request body's schema (JSON Schema ``not``/``anyOf``), not only in prose.
* A method a path does not serve answers 405 with an ``Allow`` header listing every method of that path
  (Starlette lists only the methods of the first route that matched the path, e.g. ``POST`` for ``/objects``).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from starlette.routing import Match

__all__ = ["allowed_methods", "document_track_exclusions"]

# (field, field) pairs a /track request must not carry together
TRACK_EXCLUSIVE = (("session_id", "pose"), ("session_id", "object_id"))


def allowed_methods(app: Any, scope: dict) -> list[str]:
    """Every method some route of ``app`` serves at the path of ``scope`` (sorted; empty if none)."""
    methods: set[str] = set()
    for route in getattr(app, "routes", ()):
        route_methods = getattr(route, "methods", None)
        if not route_methods:
            continue
        match, _ = route.matches({**scope, "method": next(iter(route_methods))})
        if match is Match.FULL:
            methods |= set(route_methods)
    return sorted(methods)


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
