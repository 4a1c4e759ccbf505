"""The OpenAPI schema says what the server enforces: a bounded schemathesis run against a live tiny server (every
operation, schema-valid and schema-invalid requests) finds no 5xx and no answer the schema does not describe. The
server runs once without an API key and once with one the fuzzer does not send (every route but /healthz and the
docs then answers 401, which the schema must say)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed (pip install -e '.[dev]')")

from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis import checks  # noqa: E402

from server import create_app  # noqa: E402
from tests.server._helpers import live_uvicorn, tiny_config, write_objects_dir  # noqa: E402

# 25 requests per operation and server (11 paths, 16 operations, plus a probe of each other method): a few seconds
MAX_EXAMPLES = 25
CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
          checks.response_schema_conformance, checks.response_headers_conformance, checks.negative_data_rejection]


@pytest.fixture(scope="module", params=[None, "fuzz-key"], ids=["open", "keyed"])
def live(request, tiny_estimator, tmp_path_factory) -> Iterator[str]:
    config = tiny_config(write_objects_dir(tmp_path_factory.mktemp("fuzz_objects")), warmup=False,
                         api_key=request.param)
    app = create_app(config, estimator=tiny_estimator)
    with live_uvicorn(app) as address:
        yield f"http://{address}"


@pytest.fixture(scope="module")
def api_schema(live: str):
    return schemathesis.openapi.from_url(f"{live}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@pytest.mark.slow
def test_the_schema_describes_every_answer(case, live):
    case.call_and_validate(base_url=live, checks=CHECKS, timeout=60)
