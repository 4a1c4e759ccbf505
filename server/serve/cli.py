"""``python -m server.serve``: the server's settings (``python -m server --help``) plus the scale-out ones.

    python -m server.serve --objects DIR --replicas 2 --num-gpus 0.5     # two replicas sharing one GPU
    python -m server.serve --objects DIR --replicas 2 --device cpu --tiny  # a quick try on CPU

Starts (or joins, with the settings file's ``ray_address`` or ``RAY_ADDRESS``) a Ray instance, runs the Serve
application with its HTTP proxy on ``--host``/``--port``, and serves until SIGINT/SIGTERM. Like ``python -m server``,
``--help`` imports neither torch nor ray.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from collections.abc import Sequence

from server.cli import start_process
from server.serve.cluster import init_ray
from server.serve.settings import settings_from_args

__all__ = ["main"]

log = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None) -> int:
    settings = settings_from_args(argv)
    cfg = settings.server
    start_process(cfg)
    import ray
    from ray import serve

    from server.serve.app import build_app

    # Handlers first: a signal during start-up stops right after it. A handler only records the signal: it runs in
    # this thread between any two bytecodes, so one that took a lock (Event.set) could wait on a lock this very
    # thread holds (inside Event.wait) and hang the shutdown.
    received: list[int] = []

    def record_stop_signals() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, _frame: received.append(signum))

    record_stop_signals()
    init_ray(settings.ray_address, include_dashboard=False)
    record_stop_signals()  # again: ray.init installs its own SIGTERM handler, which aborts the process (status 134)
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    serve.run(build_app(settings), name=settings.app_name, route_prefix=settings.route_prefix, blocking=False)
    log.info("serving %d pose replicas (%g GPU each) on http://%s:%d", settings.replicas, settings.num_gpus,
             cfg.host, cfg.port)
    while not received:
        time.sleep(0.2)  # the handler runs during the sleep; the loop sees it within 0.2 s
    log.info("shutting down (%s)", signal.Signals(received[0]).name)
    serve.delete(settings.app_name)
    serve.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
