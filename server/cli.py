"""``python -m server``: parse flags (each also read from an ``FP_*`` environment variable) and run uvicorn.

Precedence: command-line flag > environment variable > default. Run ``python -m server --help``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from foundationpose.validate import MAX_TRANSLATION_M
from server.config import ServerConfig, parse_image_size

__all__ = ["ENV_VARS", "build_parser", "config_from_args", "config_from_namespace", "main"]

log = logging.getLogger(__name__)

# flag -> environment variable (documented in --help and the report)
ENV_VARS = {
    "objects": "FP_OBJECTS",
    "host": "FP_HOST",
    "port": "FP_PORT",
    "device": "FP_DEVICE",
    "backend": "FP_BACKEND",
    "precision": "FP_PRECISION",
    "renderer": "FP_RENDERER",
    "weights": "FP_WEIGHTS",
    "api_key": "FP_API_KEY",
    "max_upload_mb": "FP_MAX_UPLOAD_MB",
    "max_image": "FP_MAX_IMAGE",
    "session_ttl_s": "FP_SESSION_TTL_S",
    "max_sessions": "FP_MAX_SESSIONS",
    "hypotheses": "FP_HYPOTHESES",
    "register_iterations": "FP_REGISTER_ITERATIONS",
    "track_iterations": "FP_TRACK_ITERATIONS",
    "max_translation_m": "FP_MAX_TRANSLATION_M",
    "submit_timeout_s": "FP_SUBMIT_TIMEOUT_S",
    "request_timeout_s": "FP_REQUEST_TIMEOUT_S",
    "frames_in_flight": "FP_FRAMES_IN_FLIGHT",
    "track_max_batch": "FP_TRACK_MAX_BATCH",
    "warmup": "FP_WARMUP",
    "log_level": "FP_LOG_LEVEL",
}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _env_bool(value: str) -> bool:
    if value.strip().lower() in _TRUE:
        return True
    if value.strip().lower() in _FALSE:
        return False
    raise ValueError(f"expected 1/0/true/false, got {value!r}")


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    env = os.environ if environ is None else environ

    def default(dest: str, fallback):
        return env.get(ENV_VARS[dest], fallback)

    p = argparse.ArgumentParser(
        prog="python -m server",
        description="FoundationPose HTTP service (register / track 6D poses from RGB-D). "
                    "Every option can also be set with the FP_* variable shown in its help.",
    )
    add = p.add_argument
    add("--objects", default=default("objects", None), type=Path,
        help="objects directory: <id>/ folders or <id>.obj|.ply|.glb files, loaded at start; uploads are stored "
             "here (FP_OBJECTS; required)")
    add("--host", default=default("host", "127.0.0.1"),
        help="listen address (FP_HOST; default 127.0.0.1; binding elsewhere without --api-key logs a warning)")
    add("--port", default=default("port", 8000), type=int, help="listen port (FP_PORT; default 8000)")
    add("--device", default=default("device", "auto"), help="auto | cpu | cuda[:i] (FP_DEVICE; default auto)")
    add("--backend", default=default("backend", "torch"), choices=("torch", "onnxruntime", "tensorrt"),
        help="inference backend (FP_BACKEND; default torch)")
    add("--precision", default=default("precision", "auto"), choices=("auto", "fp32", "fp16", "bf16"),
        help="network precision; auto = fp16 on CUDA, fp32 on CPU (FP_PRECISION; default auto)")
    add("--renderer", default=default("renderer", "auto"), choices=("auto", "cpu", "nvdiffrast"),
        help="render backend (FP_RENDERER; default auto)")
    add("--weights", default=default("weights", None), type=Path,
        help="weights root (official layout); unset = deterministic RANDOM weights, poses meaningless (FP_WEIGHTS)")
    add("--api-key", default=default("api_key", None),
        help="require 'Authorization: Bearer KEY' on every route but /healthz (FP_API_KEY; prefer the variable: "
             "flags are visible in the process list)")
    add("--max-upload-mb", default=default("max_upload_mb", 20.0), type=float,
        help="largest request body in MiB, 413 above (FP_MAX_UPLOAD_MB; default 20)")
    add("--max-image", default=default("max_image", "1920x1080"),
        help="largest image WIDTHxHEIGHT in pixels, 413 above (FP_MAX_IMAGE; default 1920x1080)")
    add("--session-ttl-s", default=default("session_ttl_s", 300.0), type=float,
        help="idle seconds before a tracking session expires (FP_SESSION_TTL_S; default 300)")
    add("--max-sessions", default=default("max_sessions", 1024), type=int,
        help="live sessions at most; the least recently used idle one is evicted at the cap "
             "(FP_MAX_SESSIONS; default 1024)")
    add("--hypotheses", default=default("hypotheses", None), type=int,
        help="register hypotheses (FP_HYPOTHESES; default: the full grid, 252)")
    add("--register-iterations", default=default("register_iterations", 5), type=int,
        help="refine iterations on register (FP_REGISTER_ITERATIONS; default 5)")
    add("--track-iterations", default=default("track_iterations", 2), type=int,
        help="refine iterations on track (FP_TRACK_ITERATIONS; default 2)")
    add("--max-translation-m", default=default("max_translation_m", MAX_TRANSLATION_M), type=float,
        help="working range: track poses farther than this from the camera (metres) are refused with 422 "
             f"(FP_MAX_TRANSLATION_M; default {MAX_TRANSLATION_M:g})")
    add("--submit-timeout-s", default=default("submit_timeout_s", 0.05), type=float,
        help="wait for room in the pipeline before answering 503 + Retry-After (FP_SUBMIT_TIMEOUT_S; default 0.05)")
    add("--request-timeout-s", default=default("request_timeout_s", 60.0), type=float,
        help="longest wait for a pose before 504 (FP_REQUEST_TIMEOUT_S; default 60)")
    add("--frames-in-flight", default=default("frames_in_flight", 2), type=int,
        help="register frames in the pipeline at once (FP_FRAMES_IN_FLIGHT; default 2)")
    add("--track-max-batch", default=default("track_max_batch", 16), type=int,
        help="track requests merged into one batch (FP_TRACK_MAX_BATCH; default 16)")
    add("--warmup", default=_env_bool(default("warmup", "1")), action=argparse.BooleanOptionalAction,
        help="run a synthetic register + track before reporting ready (FP_WARMUP; default on)")
    add("--log-level", default=default("log_level", "INFO"), help="logging level (FP_LOG_LEVEL; default INFO)")
    return p


def config_from_args(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> tuple[ServerConfig, str]:
    """(ServerConfig, log level) from flags and environment; exits with status 2 on bad values."""
    parser = build_parser(environ)
    args = parser.parse_args(argv)
    return config_from_namespace(parser, args), str(args.log_level).upper()


def config_from_namespace(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig of parsed ``args`` (of :func:`build_parser`, maybe with more flags added by the
    caller, e.g. ``python -m server.serve``); ``parser.error`` (exit 2) on bad values."""
    if args.objects is None:
        parser.error("--objects DIR (or FP_OBJECTS) is required")
    try:
        config = ServerConfig.from_settings(
            objects_dir=Path(args.objects),
            host=args.host,
            port=int(args.port),
            device=args.device,
            backend=args.backend,
            precision=args.precision,
            renderer=args.renderer,
            weights=Path(args.weights) if args.weights else None,
            api_key=args.api_key or None,
            max_upload_bytes=int(float(args.max_upload_mb) * 1024 * 1024),
            max_image_hw=parse_image_size(str(args.max_image)),
            session_ttl_s=float(args.session_ttl_s),
            max_sessions=int(args.max_sessions),
            num_hypotheses=int(args.hypotheses) if args.hypotheses not in (None, "") else None,
            register_iterations=int(args.register_iterations),
            track_iterations=int(args.track_iterations),
            max_translation_m=float(args.max_translation_m),
            submit_timeout_s=float(args.submit_timeout_s),
            request_timeout_s=float(args.request_timeout_s),
            frames_in_flight=int(args.frames_in_flight),
            track_max_batch=int(args.track_max_batch),
            warmup=bool(args.warmup),
        )
    except ValueError as exc:
        parser.error(str(exc))
    return config


def main(argv: Sequence[str] | None = None) -> int:
    config, level = config_from_args(argv)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from deploy_core.timing import configure_timing_log_from_env

    configure_timing_log_from_env()
    if config.api_key is None and config.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s without an API key: anyone who can reach it can use it", config.host)
    import uvicorn

    from server.app import create_app

    app = create_app(config)
    uvicorn.run(app, host=config.host, port=config.port, log_level=level.lower(), workers=1,
                timeout_graceful_shutdown=int(config.request_timeout_s))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
