"""docs/api.md and docs/operations.md stay true to the code: what the code declares must be in them.

* every route of the app (the OpenAPI schema's paths and methods, and the WebSocket route) has a row in api.md's
  route table;
* every error type a route can answer (the exception classes of ``server.errors`` and the types its ``classify``
  writes) and every HTTP status it declares (the schema's, the error classes') is in api.md's error table;
* the stream's message types and close codes are in api.md;
* every option of ``python -m server --help`` and ``python -m server.serve --help`` and every key of their
  ``--config`` file (taken from the settings' declarations) has a row in operations.md, with its default when that
  is one word;
* every Prometheus family the server writes is in operations.md;
* every relative link of README.md and docs/*.md resolves to a file (and a heading, for an ``#anchor``).
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
API = DOCS / "api.md"
OPERATIONS = DOCS / "operations.md"
METHODS = ("get", "post", "put", "patch", "delete")
# Exception classes of server.errors that no client ever sees as a ``type``: the base of the others, and the wrapper
# that forwards another process's classified error unchanged.
NOT_ANSWER_TYPES = {"ServerError", "ForwardedError"}


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.lstrip().startswith("|")]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """The single-process app (not started: its routes and schema need no networks)."""
    from server.app import create_app
    from server.config import ServerConfig

    return create_app(ServerConfig(objects_dir=tmp_path_factory.mktemp("objects"), device="cpu"))


def _all_routes(routes) -> list:
    """The app's routes, those of its included routers too (FastAPI wraps them differently by version)."""
    out = []
    for route in routes:
        inner = getattr(getattr(route, "original_router", None), "routes", None) or getattr(route, "routes", None)
        out.extend(_all_routes(inner) if inner is not None else [route])
    return out


# -- api.md ------------------------------------------------------------------------------------------------------
def test_every_route_has_a_row_in_the_route_table(app) -> None:
    schema = app.openapi()
    routes = [(method.upper(), path) for path, operations in schema["paths"].items()
              for method in operations if method in METHODS]
    websockets = [r.path for r in _all_routes(app.routes) if type(r).__name__.endswith("WebSocketRoute")]
    assert len(routes) >= 10 and websockets == ["/track/stream"], (routes, websockets)
    rows = _table_rows(_text(API))
    missing = [f"{method} {path}" for method, path in routes + [("WS", p) for p in websockets]
               if not any(f"`{method}`" in row and f"`{path}`" in row for row in rows)]
    assert not missing, f"docs/api.md's route table lacks {missing}"


def _error_type_names() -> set[str]:
    """The exception classes of server.errors and the ``type`` strings its ``classify`` writes."""
    import server.errors as errors

    names = {name for name, value in vars(errors).items()
             if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == errors.__name__}
    tree = ast.parse(_text(ROOT / "server" / "errors.py"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "ErrorInfo" and len(node.args) >= 2:
            if isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                names.add(node.args[1].value)
        # ``if isinstance(exc, X): return ErrorInfo(..., type(exc).__name__, ...)``: X's own name is a type too
        test = node.test if isinstance(node, ast.If) else None
        if isinstance(test, ast.Call) and getattr(test.func, "id", None) == "isinstance" \
                and isinstance(test.args[1], ast.Name) and "type(exc).__name__" in ast.unparse(node):
            names.add(test.args[1].id)
    return names - NOT_ANSWER_TYPES


def test_every_error_type_is_documented() -> None:
    names = _error_type_names()
    assert {"InputError", "SessionBusyError", "HTTPError", "InternalError"} <= names, names
    text = _text(API)
    missing = sorted(name for name in names if f"`{name}`" not in text)
    assert not missing, f"docs/api.md does not name the error types {missing}"


def test_every_error_status_has_a_row_in_the_error_table(app) -> None:
    import server.errors as errors

    statuses = {int(code) for operations in app.openapi()["paths"].values() for method, operation in operations.items()
                if method in METHODS for code in operation["responses"] if int(code) >= 400}
    statuses |= {cls.status for cls in vars(errors).values()
                 if isinstance(cls, type) and issubclass(cls, errors.ServerError)}
    assert {401, 404, 409, 413, 415, 422, 429, 500, 503, 504, 507} <= statuses, statuses
    rows = _table_rows(_text(API))
    missing = sorted(s for s in statuses if not any(re.match(rf"\|\s*{s}\s*\|", row) for row in rows))
    assert not missing, f"docs/api.md's error table has no row for the statuses {missing}"


def test_the_stream_protocol_is_documented() -> None:
    import server.flow.stream as stream

    tree = ast.parse(_text(ROOT / "server" / "flow" / "stream.py"))
    answers = {value.value for node in ast.walk(tree) if isinstance(node, ast.Dict)
               for key, value in zip(node.keys, node.values, strict=True)
               if isinstance(key, ast.Constant) and key.value == "type" and isinstance(value, ast.Constant)}
    assert answers == {"registered", "started", "pose", "error"}, answers
    text = _text(API)
    rows = _table_rows(text)
    kinds = set(stream.STREAM_LABELS)  # the client's message types
    missing = [kind for kind in sorted(kinds | answers) if not any(row.startswith(f"| `{kind}` |") for row in rows)]
    assert not missing, f"docs/api.md's stream tables lack the messages {missing}"
    codes = {getattr(stream, name) for name in stream.__all__ if name.startswith("CLOSE_")}
    missing_codes = sorted(code for code in codes if not any(re.match(rf"\|\s*{code}\s*\|", row) for row in rows))
    assert not missing_codes, f"docs/api.md's close codes lack {missing_codes}"


# -- operations.md -----------------------------------------------------------------------------------------------
def _declared_settings() -> list[tuple[str, dataclasses.Field]]:
    """(name, field) of every setting of ``python -m server`` and ``python -m server.serve``, from the declarations:
    an option's name is its flag (``--max-upload-mb``), a settings-file key's its own (``max_sessions``)."""
    from server.config import ServerConfig
    from server.options import flag_name
    from server.serve.settings import ServeSettings

    return [(f.name if f.metadata["option"]["in_file"] else flag_name(f), f)
            for cls in (ServerConfig, ServeSettings) for f in dataclasses.fields(cls) if "option" in f.metadata]


def test_the_declarations_are_what_help_lists() -> None:
    from server.cli import build_parser
    from server.config import ServerConfig
    from server.serve.settings import ServeSettings

    options = {name for name, _ in _declared_settings() if name.startswith("--")}
    keys = {name for name, _ in _declared_settings() if not name.startswith("--")}
    assert {"--objects", "--max-upload-mb", "--replicas"} <= options and {"max_sessions", "num_cpus"} <= keys
    parser = build_parser({}, classes=(ServerConfig, ServeSettings))
    listed = {flag for action in parser._actions for flag in action.option_strings
              if flag.startswith("--") and not flag.startswith("--no-")}
    assert listed == options | {"--help", "--config"}


def test_every_setting_has_a_row_with_its_default() -> None:
    from server.options import default_text

    rows = _table_rows(_text(OPERATIONS))
    missing, wrong = [], []
    for name, field in _declared_settings():
        row = next((r for r in rows if re.match(rf"\|\s*`{re.escape(name)}[ `]", r)), None)
        default = " ".join(default_text(field).split())
        if row is None:
            missing.append(name)
        elif " " not in default and default not in row:
            wrong.append(f"{name} (default {default})")
    assert not missing, f"docs/operations.md has no table row for the settings {missing}"
    assert not wrong, f"docs/operations.md's setting rows lack the defaults of {wrong}"


def _metric_families() -> set[str]:
    """The names of every Prometheus family the server's code writes (its ``Family`` literals and the families
    :func:`server.loop_watch.loop_families` makes of each prefix it is given)."""
    from server.loop_watch import LOOP_BEAT_S, LoopStats, loop_families

    names, prefixes = set(), set()
    for path in (ROOT / "server").rglob("*.py"):
        for node in ast.walk(ast.parse(_text(path))):
            if not isinstance(node, ast.Call):
                continue
            func = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            strings = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if func == "Family" and strings and strings[0].startswith("fp_"):
                names.add(strings[0])
            elif func == "loop_families":
                prefixes.update(s for s in strings if s.startswith("fp_"))
    for prefix in prefixes:
        names.update(f.name for f in loop_families(LoopStats.empty(), prefix, "a loop", LOOP_BEAT_S, 2.0))
    return names


def test_every_metric_family_is_documented() -> None:
    names = _metric_families()
    assert {"fp_http_requests_total", "fp_pipeline_stage_seconds", "fp_event_loop_lag_seconds",
            "fp_ingest_event_loop_stalled", "fp_serve_retries_total"} <= names, names
    text = _text(OPERATIONS)
    missing = sorted(name for name in names if f"`{name}`" not in text)
    assert not missing, f"docs/operations.md does not list the metric families {missing}"


# -- links -------------------------------------------------------------------------------------------------------
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", _text(path), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", text, re.M)}


MARKDOWN = sorted(DOCS.glob("*.md")) + [ROOT / "README.md"]


@pytest.mark.parametrize("page", MARKDOWN, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path) -> None:
    text = re.sub(r"```.*?```", "", _text(page), flags=re.S)
    broken = []
    for match in LINK.finditer(text):
        target = match.group(1) or match.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        path = (page.parent / file_part).resolve() if file_part else page
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"


def test_the_link_check_sees_links_and_anchors() -> None:
    found = [m.group(1) or m.group(2) for m in LINK.finditer("see [a](x.md#b-c) and ![img](p.png) ok")]
    assert found == ["x.md#b-c", "p.png"]
    assert _slug("Stream (`WS /track/stream`)") == "stream-ws-trackstream"
    assert _slug("Ingest workers (many clients over HTTP)") == "ingest-workers-many-clients-over-http"
