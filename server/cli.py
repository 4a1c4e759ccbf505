"""``python -m server``: read the settings (flags and ``FP_*`` variables, and the keys of the ``--config`` TOML
file, generated from :class:`~server.config.ServerConfig`'s fields) and run the app on uvicorn.

Precedence of an option: command-line flag > environment variable > default; a settings-file key has the file as
its only way in. ``--help`` lists every option, by group; it is instant: this module imports neither torch nor
FastAPI before the flags are parsed.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from server.config import ServerConfig
from server.options import ConfigFileError, add_settings, read_config_file, settings_of_namespace

__all__ = ["SWITCH_INTERVAL_S", "build_parser", "config_from_args", "config_of", "main", "settings_of_args"]

log = logging.getLogger(__name__)

_SERVER_EXTRA = "install the server extra: pip install 'foundationpose-deploy[server]'"
# The GIL switch interval of a server process (Python's default is 5 ms): a pipeline thread back from a CUDA call waits
# at most this long for the GIL while the event loop runs.
SWITCH_INTERVAL_S = 0.0005
DESCRIPTION = ("FoundationPose HTTP service (register / track 6D poses from RGB-D). Every option can also be set "
               "with the FP_* variable shown in its help; the rarer settings are keys of the --config file.")
EPILOG = ("On a CPU the defaults are a small config (16 hypotheses, 2 register iterations; the log and /readyz say "
          "so); pass --hypotheses 252 --register-iterations 5 for the full one. Quick start: "
          "python -m server --objects ./objects --device cpu")


def build_parser(environ: Mapping[str, str] | None = None, *, classes: Sequence[type] = (ServerConfig,),
                 prog: str = "python -m server", description: str = DESCRIPTION,
                 epilog: str = EPILOG) -> argparse.ArgumentParser:
    """The parser of ``classes``' options and ``--config`` (``python -m server.serve`` adds its own class), defaults
    from ``environ`` (default: this process's environment). It accepts exactly the options its help lists: no
    abbreviations (``--obj`` for ``--objects``)."""
    env = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog, allow_abbrev=False)
    parser.set_defaults(settings_classes=tuple(classes))
    add_settings(parser, classes, env)
    return parser


def settings_of_args(parser: argparse.ArgumentParser, args: argparse.Namespace,
                     cls: type) -> dict[str, Any]:
    """``cls``'s settings of parsed ``args``: its options, and its keys in the ``--config`` file when one is given;
    ``parser.error`` (exit 2) on a file that cannot be read or holds an unknown key or a value of the wrong type."""
    settings = settings_of_namespace(cls, args)
    if args.config is not None:
        try:
            settings.update(read_config_file(args.config, args.settings_classes)[cls])
        except ConfigFileError as exc:
            parser.error(str(exc))
    return settings


def config_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig of parsed ``args`` (and the ``--config`` file); ``parser.error`` (exit 2) on a missing or
    bad value."""
    if args.objects_dir is None:
        parser.error("--objects DIR (or FP_OBJECTS) is required")
    settings = settings_of_args(parser, args, ServerConfig)
    try:
        return ServerConfig(**settings)
    except ValueError as exc:
        parser.error(str(exc))
    raise AssertionError("unreachable")  # parser.error exits


def config_from_args(argv: Sequence[str] | None = None,
                     environ: Mapping[str, str] | None = None) -> tuple[ServerConfig, str]:
    """(ServerConfig, its log level) from flags and environment; exits with status 2 on bad values."""
    parser = build_parser(environ)
    config = config_of(parser, parser.parse_args(argv))
    return config, config.log_level


def missing_server_packages() -> str | None:
    """What is missing of the server extra, checked before anything imports it: None, or the missing package
    (``'fastapi'``) or the missing dependency of one (``'opentelemetry' (needed by 'fastapi')``)."""
    import importlib

    for module in ("fastapi", "uvicorn", "multipart", "fastapi_offline", "orjson"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            gone = (exc.name or module).split(".")[0]
            return repr(module) if gone == module else f"{gone!r} (needed by {module!r})"
    return None


def start_process(config: ServerConfig) -> None:
    """What a server process sets up for itself: its log (one line per request, no uvicorn access log), its GIL
    switch interval, the per-stage timing log, and warnings about the configuration."""
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    from deploy_core.timing import configure_timing_log_from_env

    configure_timing_log_from_env()
    if config.api_key is None and config.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s without an API key: anyone who can reach it can use it", config.host)
    if config.settings_note:
        log.warning("%s", config.settings_note)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # --help answers here, before any heavy import
    missing = missing_server_packages()
    if missing is not None:
        print(f"python -m server: the package {missing} is missing: {_SERVER_EXTRA}", file=sys.stderr)
        return 2
    config = config_of(parser, args)
    start_process(config)
    import uvicorn

    from server.api.stream import uvicorn_ws_options
    from server.app import create_app
    from server.ingest.worker import uvicorn_protocol_factory
    from server.state import workers_take_the_port

    app = create_app(config, owns_process=True)
    # uvicorn handles SIGTERM / SIGINT itself, then raises the signal again once it has shut down, which would kill
    # the process with it (status -15). A requested stop that shut down cleanly is a success: the re-raised signal
    # lands in this handler instead and the exit status is 0.
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: received.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        # Graceful shutdown waits shutdown_timeout_s for requests in flight; the lifespan then cancels queued work.
        # The access log is the server's own (one line per request with its id: server.middleware), not uvicorn's.
        # With ingest workers on the port (the default on CUDA) they accept its connections and this process binds
        # nothing: uvicorn runs the app's lifespan, the workers relay what they do not serve themselves.
        # A connection no worker can take (every worker given up, or every channel full) is served here, by uvicorn.
        server = uvicorn.Server(uvicorn.Config(
            app, host=config.host, port=config.port, log_level=config.log_level.lower(), workers=1, access_log=False,
            timeout_graceful_shutdown=max(1, round(config.shutdown_timeout_s)),
            **uvicorn_ws_options(config.max_upload_bytes)))
        if workers_take_the_port(config):
            app.state.fp.local_protocol = uvicorn_protocol_factory(server)
        server.run(sockets=[] if workers_take_the_port(config) else None)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        log.info("stopped by %s", signal.Signals(received[0]).name)
    _exit_now_if_stages_are_stuck()
    return 0


def _exit_now_if_stages_are_stuck() -> None:
    """End the process at once when pipeline threads are still inside a stage call after shutdown.

    They are daemons, but interpreter finalisation under a running torch kernel aborts the process
    (``terminate called without an active exception``, status -6). Shutdown has already failed their
    packages and released everything that matters, so skip finalisation: flush and ``os._exit(0)``.
    """
    import threading

    stuck = [t.name for t in threading.enumerate() if t.daemon and t.is_alive() and t.name.startswith("fp-")]
    if not stuck:
        return
    log.warning("exiting with %d pipeline threads still inside a stage call: %s", len(stuck), ", ".join(stuck))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
