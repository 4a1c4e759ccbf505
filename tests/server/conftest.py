"""Shared fixtures: one tiny estimator per test session, one warmed-up app, synthetic frames."""

from __future__ import annotations

from collections.abc import Iterator

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
