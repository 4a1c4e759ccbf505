"""Shared fixtures: one tiny estimator per test session, one warmed-up app, synthetic frames."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from foundationpose.estimator import EstimatorConfig, PoseEstimator
from foundationpose.synthetic.scenes import synthetic_frame
from server import create_app
from tests.server._helpers import (
    FRAME_HW,
    TINY,
    Encoded,
    FakeClock,
    assert_ready,
    encode,
    local_ray_serve,
    tiny_config,
    write_objects_dir,
)


@pytest.fixture(scope="session")
def tiny_estimator() -> PoseEstimator:
    """Random weights, 4 hypotheses, 1 iteration: the compute path at test speed (poses meaningless)."""
    return PoseEstimator.create(device="cpu", weights=None, renderer="cpu", config=EstimatorConfig(**TINY))


@pytest.fixture(scope="session")
def enc() -> Encoded:
    return encode(synthetic_frame(*FRAME_HW, seed=1))


@pytest.fixture(scope="session")
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(scope="session")
def app_client(tiny_estimator, tmp_path_factory, clock) -> Iterator[TestClient]:
    """The main app (warm-up on, no API key), started once for every API test."""
    objects_dir = write_objects_dir(tmp_path_factory.mktemp("objects"))
    app = create_app(tiny_config(objects_dir), estimator=tiny_estimator, clock=clock)
    with TestClient(app) as client:
        assert_ready(app.state.fp, "the shared API-test app (warm-up on)")
        yield client


@pytest.fixture
def client(app_client) -> TestClient:
    return app_client


# The modules that run Ray Serve applications: they share one Ray and Serve (``ray_serve``), and run one after the
# other at the end of tests/server, so Ray starts once and runs beside no other test.
SERVE_MODULES = ("conformance/test_conformance_serve.py", "test_serve.py")


def pytest_collection_modifyitems(config, items) -> None:
    here = Path(__file__).parent
    order = {here / name: rank for rank, name in enumerate(SERVE_MODULES)}
    serve_items = [item for item in items if item.path in order]
    if not serve_items:
        return
    rest = [item for item in items if item.path not in order]
    in_here = [i for i, item in enumerate(rest) if here in item.path.parents]
    at = in_here[-1] + 1 if in_here else len(rest)
    serve_items.sort(key=lambda item: order[item.path])  # stable: each module keeps its own order
    items[:] = [*rest[:at], *serve_items, *rest[at:]]


@pytest.fixture(scope="package")
def ray_serve() -> Iterator[str]:
    """One local Ray (2 CPUs) with Serve's proxy for every Serve test module of tests/server (each runs its own
    application on it and deletes it after its last test): the proxy's URL. Shut down after tests/server's tests."""
    with local_ray_serve() as url:
        yield url
