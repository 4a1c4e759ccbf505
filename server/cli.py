"""``python -m server``: parse flags (each also read from an ``FP_*`` environment variable) and run uvicorn.

Precedence: command-line flag > environment variable > default. Run ``python -m server --help``.

``--help`` is instant: this module imports neither torch nor FastAPI before the flags are parsed.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from foundationpose.validate import MAX_TRANSLATION_M  # numpy only: --help stays free of torch

if TYPE_CHECKING:
    from server.config import ServerConfig

__all__ = ["CPU_DEFAULTS", "ENV_VARS", "build_parser", "config_from_args", "config_from_namespace", "main"]

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
    "track_batches_in_flight": "FP_TRACK_BATCHES_IN_FLIGHT",
    "track_capacity": "FP_TRACK_CAPACITY",
    "register_capacity": "FP_REGISTER_CAPACITY",
    "track_latency_budget_s": "FP_TRACK_LATENCY_BUDGET_S",
    "decode_threads": "FP_DECODE_THREADS",
    "prepare_track": "FP_PREPARE_TRACK",
    "ingest_workers": "FP_INGEST_WORKERS",
    "ingest_port": "FP_INGEST_PORT",
    "ingest_slots": "FP_INGEST_SLOTS",
    "ingest_submit_in_loop": "FP_INGEST_SUBMIT_IN_LOOP",
    "ingest_decode_inline": "FP_INGEST_DECODE_INLINE",
    "ingest_balance": "FP_INGEST_BALANCE",
    "gc_freeze": "FP_GC_FREEZE",
    "loop_stall_s": "FP_LOOP_STALL_S",
    "compile_cache": "FP_COMPILE_CACHE",
    "switch_interval_ms": "FP_SWITCH_INTERVAL_MS",
    "track_max_graphs": "FP_TRACK_MAX_GRAPHS",
    "warmup": "FP_WARMUP",
    "warmup_timeout_s": "FP_WARMUP_TIMEOUT_S",
    "shutdown_timeout_s": "FP_SHUTDOWN_TIMEOUT_S",
    "trust_weights_file": "FP_TRUST_WEIGHTS_FILE",
    "max_mesh_faces": "FP_MAX_MESH_FACES",
    "max_mesh_vertices": "FP_MAX_MESH_VERTICES",
    "max_register_cost": "FP_MAX_REGISTER_COST",
    "max_texture_side": "FP_MAX_TEXTURE_SIDE",
    "max_objects": "FP_MAX_OBJECTS",
    "max_objects_mb": "FP_MAX_OBJECTS_MB",
    "docs": "FP_DOCS",
    "log_level": "FP_LOG_LEVEL",
}
# Algorithm size when the flags are not given: the full settings on CUDA; on a CPU a size that answers
# a register in seconds (the full 252 x 5 takes minutes per frame there).
FULL_DEFAULTS = {"hypotheses": None, "register_iterations": 5}
CPU_DEFAULTS = {"hypotheses": 16, "register_iterations": 2}
_SERVER_EXTRA = "install the server extra: pip install 'foundationpose-deploy[server]'"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _env_bool(value: str) -> bool:
    if value.strip().lower() in _TRUE:
        return True
    if value.strip().lower() in _FALSE:
        return False
    raise ValueError(f"expected 1/0/true/false, got {value!r}")


def frames_in_flight(value: str, *, renderer: str, backend: str) -> int:
    """``--frames-in-flight``: an int >= 1, or "auto": 4 where registers can be captured (the triton renderer and
    the torch backend, the same rule as ``EstimatorConfig.register_graphs=None`` on CUDA), else 2."""
    if value.strip().lower() == "auto":
        return 4 if renderer == "triton" and backend == "torch" else 2
    try:
        frames = int(value)
    except ValueError:
        raise ValueError(f"--frames-in-flight must be 'auto' or an integer >= 1, got {value!r}") from None
    if frames < 1:
        raise ValueError(f"--frames-in-flight must be 'auto' or an integer >= 1, got {frames}")
    return frames


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    env = os.environ if environ is None else environ

    def default(dest: str, fallback):
        return env.get(ENV_VARS[dest], fallback)

    p = argparse.ArgumentParser(
        prog="python -m server",
        description="FoundationPose HTTP service (register / track 6D poses from RGB-D). "
                    "Every option can also be set with the FP_* variable shown in its help.",
        epilog="On a CPU the defaults are a small config (16 hypotheses, 2 register iterations; the log and "
               "/readyz say so); pass --hypotheses 252 --register-iterations 5 for the full one. Quick start: "
               "python -m server --objects ./objects --device cpu",
    )
    add = p.add_argument

    def switch(flag: str, on: bool, text: str) -> None:
        """An on/off flag (``--x`` / ``--no-x``) whose default comes from its FP_ variable, else ``on``."""
        add(flag, default=_env_bool(default(flag[2:].replace("-", "_"), "1" if on else "0")),
            action=argparse.BooleanOptionalAction, help=text)
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
    add("--renderer", default=default("renderer", "auto"), choices=("auto", "cpu", "nvdiffrast", "triton"),
        help="render backend (FP_RENDERER; default auto = nvdiffrast on CUDA, else cpu)")
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
        help="register hypotheses (FP_HYPOTHESES; default: the full grid, 252, on CUDA; 16 on a CPU)")
    add("--register-iterations", default=default("register_iterations", None), type=int,
        help="refine iterations on register (FP_REGISTER_ITERATIONS; default 5 on CUDA, 2 on a CPU)")
    add("--track-iterations", default=default("track_iterations", 2), type=int,
        help="refine iterations on track (FP_TRACK_ITERATIONS; default 2)")
    add("--max-translation-m", default=default("max_translation_m", MAX_TRANSLATION_M), type=float,
        help="working range: track poses farther than this from the camera (metres) are refused with 422 "
             f"(FP_MAX_TRANSLATION_M; default {MAX_TRANSLATION_M:g})")
    add("--submit-timeout-s", default=default("submit_timeout_s", 0.05), type=float,
        help="wait for room in the pipeline before answering 503 + Retry-After (FP_SUBMIT_TIMEOUT_S; default 0.05)")
    add("--request-timeout-s", default=default("request_timeout_s", 60.0), type=float,
        help="longest wait for a pose before 504 (FP_REQUEST_TIMEOUT_S; default 60)")
    add("--frames-in-flight", default=default("frames_in_flight", "auto"),
        help="register frames in the pipeline at once; auto = 4 where registers are captured as CUDA graphs "
             "(--renderer triton, the torch backend: a slot then holds one frame; 4 answered 8 registers/s beside 64 "
             "track clients on the H200 where 2 answered 4.3), else 2 (a slot also holds its 252 hypotheses' "
             "network inputs, ~0.3 GiB) (FP_FRAMES_IN_FLIGHT; default auto)")
    add("--track-max-batch", default=default("track_max_batch", 16), type=int,
        help="track requests merged into one batch (FP_TRACK_MAX_BATCH; default 16)")
    add("--track-batches-in-flight", default=default("track_batches_in_flight", 3), type=int,
        help="track batches in the lane at once: while one waits for the GPU or its results, the next is "
             "submitted (FP_TRACK_BATCHES_IN_FLIGHT; default 3)")
    add("--track-capacity", default=default("track_capacity", 256), type=int,
        help="track requests admitted at once over all sessions, 503 + Retry-After above; one session may have "
             "one running and one waiting, 429 above (FP_TRACK_CAPACITY; default 256)")
    add("--register-capacity", default=default("register_capacity", 0), type=int,
        help="registers admitted at once (decoding, waiting, running), 503 + Retry-After above, before the body is "
             "decoded (FP_REGISTER_CAPACITY; default 0 = twice --frames-in-flight)")
    add("--track-latency-budget-s", default=default("track_latency_budget_s", 2.0), type=float,
        help="while the track lane is saturated and its recent latency is above this, new tracks get 503 + "
             "Retry-After (FP_TRACK_LATENCY_BUDGET_S; default 2; 0 = only --track-capacity bounds)")
    add("--decode-threads", default=default("decode_threads", 8), type=int,
        help="threads that decode a request's depth image while its rgb is decoded (FP_DECODE_THREADS; "
             "default 8; 0 = one after the other)")
    switch("--prepare-track", True,
           "after the first register of an object at an image size, capture its track steps for that size in a "
           "background thread instead of on its first track batches (graphed lanes; FP_PREPARE_TRACK; default on)")
    add("--ingest-workers", default=default("ingest_workers", 0), type=int,
        help="processes serving POST /track/binary on --ingest-port, each receiving, parsing and decoding under its "
             "own GIL and handing frames to this process through shared memory (FP_INGEST_WORKERS; default 0: "
             "none; the main port serves every route either way)")
    add("--ingest-port", default=default("ingest_port", None), type=int,
        help="the ingest workers' track port (FP_INGEST_PORT; default --port + 1; 0: any free port, logged)")
    add("--ingest-slots", default=default("ingest_slots", 32), type=int,
        help="frames one ingest worker may have in the GPU process at once (2.5 MB of shared memory each at "
             "640x480); beyond: 503 with the track lane's measured service time as Retry-After "
             "(FP_INGEST_SLOTS; default 32)")
    switch("--ingest-submit-in-loop", True,
           "the ingest workers' tracks are validated and submitted on the GPU process's event loop instead of a "
           "worker thread each, when their frames lie in a page-locked ring (no decode, no staging copy left; "
           "FP_INGEST_SUBMIT_IN_LOOP; default on)")
    switch("--ingest-decode-inline", True,
           "the ingest workers copy raw frames into their ring on their event loop instead of a worker thread each "
           "(encoded images still decode in a thread; FP_INGEST_DECODE_INLINE; default on)")
    switch("--ingest-balance", True,
           "the GPU process accepts the track port's connections and hands each to the ingest worker with the fewest "
           "open connections, instead of every worker accepting on one socket, which spreads long-lived connections "
           "unevenly (FP_INGEST_BALANCE; default on)")
    switch("--gc-freeze", True,
           "when start-up is done, freeze the objects it built (gc.freeze) so that Python's full garbage collections "
           "no longer walk them, stopping every thread for ~150 ms or more (FP_GC_FREEZE; default on)")
    add("--loop-stall-s", default=default("loop_stall_s", 2.0), type=float,
        help="when an event loop (this process's or an ingest worker's) runs no timer for this long, log a warning "
             "with its stack, once per stall; 0: off (FP_LOOP_STALL_S; default 2)")
    add("--compile-cache", default=default("compile_cache", None),
        help="the folder of the torch.compile artifact files: loaded before the networks compile, written after "
             "the first start, so the next start is warm (same torch, Triton and GPU model; unpickled: only files "
             "this server wrote; FP_COMPILE_CACHE; default ~/.cache/foundationpose/compile)")
    add("--switch-interval-ms", default=default("switch_interval_ms", 0.5), type=float,
        help="this process's sys.setswitchinterval: how long a thread holding the GIL runs before one waiting "
             "for it (a lane thread back from a CUDA call) may take it. 0.5 ms served 925 tracks/s at 64 clients "
             "on the H200 against 774 with Python's 5 ms, p99 110 vs 422 ms (FP_SWITCH_INTERVAL_MS; default 0.5)")
    add("--track-max-graphs", default=default("track_max_graphs", 128), type=int,
        help="captured track steps kept, one per (object, image size, batch size); the least recently used is "
             "dropped beyond it (FP_TRACK_MAX_GRAPHS; default 128: ~12 objects at one size with the fine ladder)")
    add("--warmup", default=_env_bool(default("warmup", "1")), action=argparse.BooleanOptionalAction,
        help="run a synthetic register + track before reporting ready (FP_WARMUP; default on)")
    add("--warmup-timeout-s", default=default("warmup_timeout_s", 600.0), type=float,
        help="deadline of the warm-up, separate from the request timeout; 0 = none. Past it /readyz says "
             "failed and POST /readyz/retry waits again (FP_WARMUP_TIMEOUT_S; default 600)")
    add("--shutdown-timeout-s", default=default("shutdown_timeout_s", 5.0), type=float,
        help="on SIGTERM/Ctrl-C: wait this long for requests in flight, then cancel queued work "
             "(FP_SHUTDOWN_TIMEOUT_S; default 5)")
    add("--trust-weights-file", default=_env_bool(default("trust_weights_file", "0")),
        action=argparse.BooleanOptionalAction,
        help="allow checkpoints that need full unpickling: this RUNS CODE from the file, use only for files "
             "you trust; plain tensor checkpoints (the official ones) never need it (FP_TRUST_WEIGHTS_FILE; default off)")
    add("--max-mesh-faces", default=default("max_mesh_faces", 200_000), type=int,
        help="uploaded meshes with more faces answer 413, unless uploaded with simplify=true "
             "(FP_MAX_MESH_FACES; default 200000)")
    add("--max-mesh-vertices", default=default("max_mesh_vertices", 200_000), type=int,
        help="uploaded meshes with more vertices answer 413 (FP_MAX_MESH_VERTICES; default 200000)")
    add("--max-register-cost", default=default("max_register_cost", None), type=int,
        help="refuse uploads (413) whose faces x hypotheses x (register iterations + 1) exceeds this; default: "
             "what the device renders in half of --request-timeout-s (FP_MAX_REGISTER_COST)")
    add("--max-texture-side", default=default("max_texture_side", 2048), type=int,
        help="textures (uploaded or embedded in GLB/OBJ) are downscaled to this many pixels per side "
             "(FP_MAX_TEXTURE_SIDE; default 2048)")
    add("--max-objects", default=default("max_objects", 256), type=int,
        help="loaded objects at most; uploads answer 507 beyond (FP_MAX_OBJECTS; default 256)")
    add("--max-objects-mb", default=default("max_objects_mb", 4096.0), type=float,
        help="memory of the loaded objects (meshes, textures, tensors) in MiB at most; uploads answer 507 "
             "beyond (FP_MAX_OBJECTS_MB; default 4096)")
    add("--docs", default=_env_bool(default("docs", "1")), action=argparse.BooleanOptionalAction,
        help="serve /docs and /redoc (bundled assets, work offline) and /openapi.json; public even with an "
             "API key, whose API calls need the key (Authorize button) (FP_DOCS; default on)")
    add("--log-level", default=default("log_level", "INFO"), help="logging level (FP_LOG_LEVEL; default INFO)")
    return p


def _is_cpu(device: str) -> bool:
    """Whether ``device`` means the CPU (``auto``: no CUDA; imports torch only then)."""
    if device == "auto":
        import torch

        return not torch.cuda.is_available()
    return device == "cpu"


def _algorithm_size(args: argparse.Namespace) -> tuple[int | None, int, str | None]:
    """(hypotheses, register iterations, note) with the device's defaults for what was not given."""
    hypotheses = int(args.hypotheses) if args.hypotheses not in (None, "") else None
    iterations = int(args.register_iterations) if args.register_iterations not in (None, "") else None
    if hypotheses is not None and iterations is not None:
        return hypotheses, iterations, None
    cpu = _is_cpu(str(args.device))
    defaults = CPU_DEFAULTS if cpu else FULL_DEFAULTS
    note = None
    if cpu:
        note = ("CPU: small default config (hypotheses {}, register iterations {}); pass --hypotheses 252 "
                "--register-iterations 5 for the full one (minutes per register on a CPU)").format(
                    hypotheses if hypotheses is not None else defaults["hypotheses"],
                    iterations if iterations is not None else defaults["register_iterations"])
    return (hypotheses if hypotheses is not None else defaults["hypotheses"],
            iterations if iterations is not None else defaults["register_iterations"], note)


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
    switch_ms = getattr(args, "switch_interval_ms", None)  # absent from parsers that do not add it
    if switch_ms is not None and not 0 < switch_ms <= 1000:
        parser.error(f"--switch-interval-ms must be in (0, 1000], got {switch_ms:g}")
    from server.config import ServerConfig, parse_image_size  # after parsing: imports torch
    from server.limits import ObjectLimits

    try:
        hypotheses, register_iterations, note = _algorithm_size(args)
        limits = ObjectLimits(
            max_faces=int(args.max_mesh_faces), max_vertices=int(args.max_mesh_vertices),
            max_register_cost=int(args.max_register_cost) if args.max_register_cost not in (None, "") else None,
            max_texture_side=int(args.max_texture_side), max_objects=int(args.max_objects),
            max_total_bytes=int(float(args.max_objects_mb) * 1024 * 1024),
        )
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
            num_hypotheses=hypotheses,
            register_iterations=register_iterations,
            track_iterations=int(args.track_iterations),
            max_translation_m=float(args.max_translation_m),
            submit_timeout_s=float(args.submit_timeout_s),
            request_timeout_s=float(args.request_timeout_s),
            frames_in_flight=frames_in_flight(str(args.frames_in_flight), renderer=args.renderer, backend=args.backend),
            track_max_batch=int(args.track_max_batch),
            track_batches_in_flight=int(args.track_batches_in_flight),
            track_capacity=int(args.track_capacity),
            register_capacity=int(args.register_capacity),
            track_latency_budget_s=float(args.track_latency_budget_s),
            decode_threads=int(args.decode_threads),
            prepare_track=bool(args.prepare_track),
            ingest_workers=int(args.ingest_workers),
            ingest_port=int(args.port) + 1 if args.ingest_port in (None, "") else int(args.ingest_port),
            ingest_slots=int(args.ingest_slots),
            ingest_submit_in_loop=bool(args.ingest_submit_in_loop),
            ingest_decode_inline=bool(args.ingest_decode_inline),
            ingest_balance=bool(args.ingest_balance),
            gc_freeze=bool(args.gc_freeze),
            loop_stall_s=float(args.loop_stall_s),
            compile_cache=Path(args.compile_cache) if args.compile_cache else None,
            track_max_graphs=int(args.track_max_graphs),
            warmup=bool(args.warmup),
            warmup_timeout_s=float(args.warmup_timeout_s),
            shutdown_timeout_s=float(args.shutdown_timeout_s),
            trust_weights_file=bool(args.trust_weights_file),
            docs=bool(args.docs),
            settings_note=note,
            object_limits=limits,
        )
    except ValueError as exc:
        parser.error(str(exc))
    return config


def _missing_server_packages() -> str | None:
    """The first missing package of the server extra, or None (checked before anything imports them)."""
    import importlib

    for module in ("fastapi", "uvicorn", "multipart", "fastapi_offline", "orjson"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError:
            return module
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args, _ = build_parser().parse_known_args(argv)  # --help answers here, before any heavy import
    missing = _missing_server_packages()
    if missing is not None:
        print(f"python -m server: the package {missing!r} is missing: {_SERVER_EXTRA}", file=sys.stderr)
        return 2
    config, level = config_from_args(argv)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.setswitchinterval(args.switch_interval_ms / 1e3)  # process-wide: the process's entry point sets it
    log.info("GIL switch interval %.3g ms", sys.getswitchinterval() * 1e3)
    from deploy_core.timing import configure_timing_log_from_env

    configure_timing_log_from_env()
    if config.api_key is None and config.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s without an API key: anyone who can reach it can use it", config.host)
    if config.settings_note:
        log.warning("%s", config.settings_note)
    import uvicorn

    from server.app import create_app
    from server.routes_stream import UVICORN_WS_OPTIONS

    app = create_app(config)
    # uvicorn handles SIGTERM / SIGINT itself, then raises the signal again once it has shut down, which
    # would kill the process with it (status -15). A requested stop that shut down cleanly is a success:
    # the re-raised signal lands in this handler instead and the exit status is 0.
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: received.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        # Graceful shutdown waits shutdown_timeout_s for requests in flight; the lifespan then cancels queued work.
        uvicorn.run(app, host=config.host, port=config.port, log_level=level.lower(), workers=1,
                    timeout_graceful_shutdown=max(1, round(config.shutdown_timeout_s)), **UVICORN_WS_OPTIONS)
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
