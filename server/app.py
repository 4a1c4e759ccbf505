"""The single-process server's FastAPI application: the API (:mod:`server.api`) on a
:class:`~server.state.ServerState`, started and stopped by the app's lifespan."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

from foundationpose.estimator import PoseEstimator
from foundationpose.service import PoseService
from server.api.app import build_api
from server.api.docs import API_DESCRIPTION
from server.config import ServerConfig
from server.state import ServerState

__all__ = ["create_app"]


def create_app(config: ServerConfig, *, estimator: PoseEstimator | None = None, service: PoseService | None = None,
               clock: Callable[[], float] = time.monotonic, owns_process: bool = False) -> FastAPI:
    """Build the app. Networks load in the background when the lifespan starts (see ``ServerState``).

    estimator: an already built estimator (tests pass a tiny one); a ``PoseService`` is built on it at start and
        closed at shutdown. service: an already built service (the caller closes it).
    clock: the sessions' clock (seconds; tests inject a fake one).
    owns_process: the app has its process to itself (``python -m server``): see ``ServerState``.
    The state is reachable as ``app.state.fp`` (e.g. ``app.state.fp.wait_ready(timeout)``).
    """
    state = ServerState(config, estimator=estimator, service=service, clock=clock, owns_process=owns_process)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = build_api(state, title="FoundationPose service", description=API_DESCRIPTION, lifespan=lifespan)
    state.app = app
    return app
