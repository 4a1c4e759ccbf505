"""Fixtures for every deploy_core test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.deploy_core.test_pipeline_support import fp_threads


@pytest.fixture(autouse=True)
def no_stage_thread_left() -> Iterator[None]:
    """Every test must leave no ``fp-`` thread running (whoever starts a stage thread joins it)."""
    before = set(fp_threads())
    yield
    left = sorted(set(fp_threads()) - before)  # only this test's threads: one leak fails one test
    assert left == [], f"fp- threads left running: {left}"
