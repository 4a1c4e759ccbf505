"""``python -m server.serve``: the server's flags (``python -m server --help``) plus the scale-out flags.

    python -m server.serve --objects DIR --replicas 2 --num-gpus 0.5     # two replicas sharing one GPU
    python -m server.serve --objects DIR --replicas 2 --device cpu --tiny  # a quick try on CPU

Starts (or joins, with ``--ray-address`` / ``RAY_ADDRESS``) a Ray instance, runs the Serve application
with its HTTP proxy on ``--host``/``--port``, and serves until SIGINT/SIGTERM. Like ``python -m server``,
``--help`` imports neither torch nor ray.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from server.cli import build_parser, config_from_namespace

if TYPE_CHECKING:
    from server.serve.settings import ServeSettings

__all__ = ["TINY_SETTINGS", "build_serve_parser", "main", "settings_from_args"]

log = logging.getLogger(__name__)

TINY_SETTINGS = {"hypotheses": 4, "register_iterations": 1, "track_iterations": 1}


def build_serve_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    env = os.environ if environ is None else environ
    p = build_parser(env)
    p.prog = "python -m server.serve"
    p.description = ("FoundationPose HTTP service on Ray Serve: the flags of 'python -m server', plus how many pose "
                     "replicas and what each holds.")
    g = p.add_argument_group("Ray Serve")
    add = g.add_argument
    add("--replicas", type=int, default=int(env.get("FP_REPLICAS", 1)),
        help="pose replicas, each with its own PoseService (FP_REPLICAS; default 1)")
    add("--num-gpus", type=float, default=None,
        help="GPUs per pose replica; 0.5 puts two replicas on one GPU; 0 = CPU (default: 1 when this machine has "
             "a CUDA GPU and --device is not cpu, else 0)")
    add("--num-cpus", type=float, default=1.0, help="CPUs Ray reserves per pose replica (default 1)")
    add("--ingress-num-cpus", type=float, default=1.0, help="CPUs Ray reserves for the ingress (default 1)")
    add("--max-ongoing-requests", type=int, default=64,
        help="requests one pose replica works on at once; keep >= --track-max-batch (default 64)")
    add("--max-queued-requests", type=int, default=256,
        help="requests queued for the pose replicas before 503 + Retry-After; -1 = no bound (default 256)")
    add("--retry-attempts", type=int, default=3, help="tries of a pose call whose replica dies (default 3)")
    add("--torch-threads", type=int, default=None, help="torch intra-op threads per replica (default torch's)")
    add("--metrics-interval-s", type=float, default=2.0, help="how often replicas publish metrics (default 2)")
    add("--app-name", default="foundationpose", help="Serve application name (default foundationpose)")
    add("--tiny", action="store_true",
        help="4 hypotheses, 1 register and 1 track iteration: a quick try (with random weights poses are meaningless)")
    add("--ray-address", default=None,
        help="join this Ray cluster (e.g. auto, or ray://host:10001); default: RAY_ADDRESS, else start a local one")
    return p


def settings_from_args(argv: Sequence[str] | None = None,
                       environ: Mapping[str, str] | None = None) -> tuple[ServeSettings, argparse.Namespace]:
    """(ServeSettings, parsed args); exits with status 2 on bad values."""
    parser = build_serve_parser(environ)
    args = parser.parse_args(argv)
    if args.tiny:
        for name, value in TINY_SETTINGS.items():
            setattr(args, name, value)
    config = config_from_namespace(parser, args)
    from server.serve.settings import ServeSettings  # after parsing: imports torch

    num_gpus = args.num_gpus
    if num_gpus is None:
        num_gpus = 1.0 if config.device != "cpu" and _has_cuda() else 0.0
    try:
        settings = ServeSettings(
            server=config, replicas=args.replicas, num_gpus=num_gpus, num_cpus=args.num_cpus,
            ingress_num_cpus=args.ingress_num_cpus, max_ongoing_requests=args.max_ongoing_requests,
            max_queued_requests=args.max_queued_requests, retry_attempts=args.retry_attempts,
            torch_threads=args.torch_threads, metrics_interval_s=args.metrics_interval_s, app_name=args.app_name,
            switch_interval_ms=args.switch_interval_ms,
        )
    except ValueError as exc:
        parser.error(str(exc))
    return settings, args


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: Sequence[str] | None = None) -> int:
    settings, args = settings_from_args(argv)
    level = str(args.log_level).upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = settings.server
    if cfg.api_key is None and cfg.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s without an API key: anyone who can reach it can use it", cfg.host)
    if cfg.settings_note:
        log.warning("%s", cfg.settings_note)
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
    ray.init(address=args.ray_address, include_dashboard=False)
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
