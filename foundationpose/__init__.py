"""FoundationPose register and track, as a library.

The public API (pinned by ``tests/foundationpose/test_public_api.py``)::

    from foundationpose import PoseEstimator, EstimatorConfig, RuntimeConfig, Tracker, load_object
    from foundationpose import PoseService, ServiceConfig          # the pipelined path
    from foundationpose import RegisterResult, TrackResult, InputError, PoseError
    from foundationpose import register_request, track_request, RegisterRequest, TrackRequest  # validated once

Layout: the algorithm (the synchronous reference path) lives in this package's top-level modules
and ``sampling/``, ``render/``, ``models/``; the pipelined service in ``service/``; the demo and what
only applications use in ``demo/``; benchmarks in ``bench/``; file-free synthetic meshes and scenes
in ``synthetic/``. Names are resolved lazily, so ``import foundationpose.errors`` (or a CLI's
``--help``) does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
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

# public name -> the module that defines it
_HOME = {
    "EstimatorConfig": "foundationpose.estimator",
    "PoseEstimator": "foundationpose.estimator",
    "RegisterResult": "foundationpose.estimator",
    "TrackResult": "foundationpose.estimator",
    "Tracker": "foundationpose.estimator",
    "ObjectModel": "foundationpose.mesh",
    "load_object": "foundationpose.mesh",
    "RuntimeConfig": "foundationpose.runtime",
    "PoseService": "foundationpose.service",
    "ServiceConfig": "foundationpose.service",
    "InputError": "foundationpose.errors",
    "PoseError": "foundationpose.errors",
    "RenderError": "foundationpose.errors",
    "UnknownObjectError": "foundationpose.errors",
    "UnknownSessionError": "foundationpose.errors",
    "WeightsError": "foundationpose.errors",
    "InputLimits": "foundationpose.validate",
    "RegisterRequest": "foundationpose.validate",
    "TrackRequest": "foundationpose.validate",
    "register_request": "foundationpose.validate",
    "track_request": "foundationpose.validate",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'foundationpose' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from foundationpose.errors import (
        InputError,
        PoseError,
        RenderError,
        UnknownObjectError,
        UnknownSessionError,
        WeightsError,
    )
    from foundationpose.estimator import EstimatorConfig, PoseEstimator, RegisterResult, Tracker, TrackResult
    from foundationpose.mesh import ObjectModel, load_object
    from foundationpose.runtime import RuntimeConfig
    from foundationpose.service import PoseService, ServiceConfig
    from foundationpose.validate import (
        InputLimits,
        RegisterRequest,
        TrackRequest,
        register_request,
        track_request,
    )
