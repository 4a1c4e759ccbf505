"""The package's public API is a list we pin: adding or removing a name is a deliberate change."""

from __future__ import annotations

import subprocess
import sys

import foundationpose

PUBLIC = [
    "EstimatorConfig",
    "InputError",
    "InputLimits",
    "ObjectModel",
    "PoseError",
    "PoseEstimator",
    "PoseService",
    "RegisterRequest",
    "RegisterResult",
    "RenderError",
    "RuntimeConfig",
    "ServiceConfig",
    "TrackRequest",
    "TrackResult",
    "Tracker",
    "UnknownObjectError",
    "UnknownSessionError",
    "WeightsError",
    "load_object",
    "register_request",
    "track_request",
]


def test_all_is_pinned_and_sorted() -> None:
    assert foundationpose.__all__ == PUBLIC
    assert PUBLIC == sorted(PUBLIC, key=str)


def test_every_public_name_resolves_to_its_home_module() -> None:
    from foundationpose.estimator import PoseEstimator
    from foundationpose.service import PoseService

    for name in PUBLIC:
        assert getattr(foundationpose, name) is not None, name
    assert foundationpose.PoseEstimator is PoseEstimator
    assert foundationpose.PoseService is PoseService


def test_unknown_name_raises_attribute_error() -> None:
    try:
        foundationpose.not_a_name  # noqa: B018
    except AttributeError as exc:
        assert "not_a_name" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_importing_errors_does_not_import_torch() -> None:
    # CLIs import foundationpose.errors before parsing arguments; --help must stay instant.
    code = "import sys, foundationpose.errors; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
