"""The server's settings: one frozen value object whose fields are the command line and the settings file
(:mod:`server.options`).

Each field is declared once, with its default, help and group; ``python -m server`` generates its options and
``FP_*`` variables, and the keys of its ``--config`` file, from them; ``python -m server.serve`` reuses them and
tests build the object directly. The library's configurations are derived from it (:attr:`ServerConfig.estimator`,
:attr:`ServerConfig.service`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from foundationpose.validate import MAX_TRANSLATION_M
from server.limits import ObjectLimits
from server.loop_watch import LOOP_BEAT_S
from server.options import optional, parse_path, setting

if TYPE_CHECKING:
    from foundationpose.recovery import RecoveryConfig

__all__ = ["CPU_DEFAULTS", "ServerConfig", "parse_image_size"]

_SIZE_RE = re.compile(r"^\s*(\d{1,5})\s*[xX]\s*(\d{1,5})\s*$")
_MIB = 1024 * 1024
# Algorithm size when it is not given: the full settings on CUDA; on a CPU a size that answers a register in
# seconds (the full 252 x 5 takes minutes per frame there).
FULL_DEFAULTS = {"num_hypotheses": None, "register_iterations": 5}
CPU_DEFAULTS = {"num_hypotheses": 16, "register_iterations": 2}
INGEST_WORKERS_MAX = 8  # measured best on the H200's 16-core host: 8 workers (one per two cores)


def parse_image_size(text: str) -> tuple[int, int]:
    """``"1920x1080"`` (width x height, pixels) -> ``(1080, 1920)`` as (H, W)."""
    match = _SIZE_RE.match(text)
    if match is None:
        raise ValueError(f"image size must read WIDTHxHEIGHT in pixels, e.g. 1920x1080; got {text!r}")
    width, height = int(match.group(1)), int(match.group(2))
    if width < 2 or height < 1:
        raise ValueError(f"image size must be at least 2x1 pixels; got {text!r}")
    return height, width


def _mib(text: str) -> int:
    return int(float(text) * _MIB)


def runs_on_cpu(device: str) -> bool:
    """Whether ``device`` means the CPU (``auto``: no CUDA device here)."""
    if device == "auto":
        import torch

        return not torch.cuda.is_available()
    return device == "cpu"


def default_ingest_workers(device: str) -> int:
    """Ingest worker processes when not given: none on a CPU (the GPU process's GIL is not the bound there); on CUDA
    one per two CPU cores, at most :data:`INGEST_WORKERS_MAX`."""
    if runs_on_cpu(device):
        return 0
    return max(1, min(INGEST_WORKERS_MAX, (os.cpu_count() or 2) // 2))


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    """Everything ``python -m server`` can be told: a field is a command-line option (``--help``) or, with
    ``in_file``, a key of the settings file (``--config FILE``); see :mod:`server.options`."""

    # -- essentials
    objects_dir: Path = setting(help="objects directory: <id>/ folders or <id>.obj|.ply|.glb files, loaded at start; "
                                     "uploads are stored here", group="essentials", flag="objects",
                                parse=parse_path, metavar="DIR")
    host: str = setting("127.0.0.1", "listen address (binding elsewhere without --api-key logs a warning)",
                        group="essentials")
    port: int = setting(8000, "listen port", group="essentials")
    device: str = setting("auto", "auto | cpu | cuda[:i]", group="essentials")
    weights: Path | None = setting(None, "weights root (official layout); unset = deterministic RANDOM weights, poses "
                                         "meaningless", group="essentials", parse=optional(parse_path),
                                   metavar="DIR")
    api_key: str | None = setting(None, "require 'Authorization: Bearer KEY' on every route but /healthz and the "
                                        "API documentation (prefer the variable: flags are visible in the process "
                                        "list)", group="essentials",
                                  parse=optional(str), repr=False)
    # -- engine: how the networks run
    backend: str = setting("torch", "inference backend", group="engine",
                           choices=("torch", "onnxruntime", "tensorrt"))
    precision: str = setting("auto", "network precision; auto = fp16 on CUDA, fp32 on CPU", group="engine",
                             choices=("auto", "fp32", "fp16", "bf16"))
    renderer: str = setting("auto", "render backend; auto picks the fastest that works on the device", group="engine",
                            choices=("auto", "cpu", "nvdiffrast", "triton"))
    eager: bool = setting(False, "run register and track steps kernel by kernel instead of as captured CUDA graphs "
                                 "(slower; for debugging)", group="engine")
    compile: bool = setting(True, "torch.compile the networks on CUDA (--no-compile: faster start, slower steps)",
                            group="engine")
    compile_cache: Path | None = setting(None, "the folder of the torch.compile artifact files: read before the networks "
                                               "compile, written after the first start, so the next start is warm "
                                               "(same torch, Triton and GPU model; unpickled: only files this server "
                                               "wrote)", group="engine", parse=optional(parse_path),
                                         metavar="DIR", default_text="~/.cache/foundationpose/compile")
    trust_weights_file: bool = setting(False, "allow checkpoints that need full unpickling: this RUNS CODE from the "
                                              "file; the official ones never need it", group="engine",
                                      in_file=True)
    # -- algorithm size
    num_hypotheses: int | None = setting(None, "register hypotheses", group="algorithm", flag="hypotheses",
                                         parse=optional(int), default_text="252 on CUDA, 16 on a CPU", metavar="N")
    register_iterations: int | None = setting(None, "refine iterations on register", group="algorithm",
                                              parse=optional(int), default_text="5 on CUDA, 2 on a CPU", metavar="N")
    track_iterations: int = setting(2, "refine iterations on track", group="algorithm", metavar="N")
    max_translation_m: float = setting(MAX_TRANSLATION_M, "working range: track poses farther than this from the "
                                                          "camera (metres) are refused with 422", group="algorithm",
                                      in_file=True)
    # -- limits
    max_image_hw: tuple[int, int] = setting((1080, 1920), "largest image WIDTHxHEIGHT in pixels, 413 above",
                                            group="limits", flag="max_image", parse=parse_image_size,
                                            default_text="1920x1080", metavar="WxH")
    max_upload_bytes: int = setting(20 * _MIB, "largest request body in MiB, 413 above", group="limits",
                                    flag="max_upload_mb", parse=_mib, default_text="20")
    request_timeout_s: float = setting(60.0, "longest wait for a pose before 504", group="limits")
    # -- scaling
    ingest_workers: int | None = setting(None, "processes that accept the port's connections and serve POST "
                                               "/track/binary and WS /track/stream, each receiving and decoding "
                                               "under its own GIL (other routes are relayed to the GPU process)",
                                         group="scaling", parse=optional(int),
                                         default_text="on CUDA one per two CPU cores, at most 8; 0 on a CPU",
                                         metavar="N")
    ingest_port: int | None = setting(None, "the ingest workers' port: --port (one port for every route), or "
                                            "another one that takes the same requests (0: any free port, logged)",
                                      group="scaling", parse=optional(int), default_text="--port")
    track_max_batch: int = setting(16, "track requests merged into one batch", group="scaling",
                                   metavar="N")
    frames_in_flight: int | None = setting(None, "register frames in the pipeline at once: more answers more "
                                                 "registers per second beside tracks, with more GPU memory",
                                           group="scaling", in_file=True,
                                           default_text="4 where registers are captured (the Triton renderer, the "
                                                        "torch backend), else 2")
    ingest_slots: int = setting(32, "frames one ingest worker may have in the GPU process at once; beyond: 503. "
                                    "Each slot holds a frame of --max-image (16.6 MB of shared, page-locked memory "
                                    "at 1920x1080, 2.5 MB at 640x480)", group="scaling", in_file=True)
    # -- operations
    log_level: str = setting("INFO", "logging level", group="operations",
                             choices=("DEBUG", "INFO", "WARNING", "ERROR"), parse=str.upper)
    docs: bool = setting(True, "serve /docs and /redoc (bundled assets, work offline) and /openapi.json; public even "
                               "with an API key", group="operations")
    warmup: bool = setting(True, "run a synthetic register + track before reporting ready", group="operations",
                           in_file=True)
    warmup_timeout_s: float = setting(600.0, "deadline of the warm-up; 0 = none. Past it /readyz says failed and POST "
                                             "/readyz/retry waits again", group="operations",
                                      in_file=True)
    shutdown_timeout_s: float = setting(5.0, "on SIGTERM/Ctrl-C: wait this long for requests in flight, then cancel "
                                             "queued work", group="operations",
                                        in_file=True)
    loop_stall_s: float = setting(2.0, "when an event loop runs no timer for this long, log a warning with its stack; "
                                       "0: off", group="operations", in_file=True)
    # -- sessions and admission
    session_ttl_s: float = setting(300.0, "idle seconds before a tracking session expires", group="sessions",
                                    in_file=True)
    max_sessions: int = setting(1024, "live sessions at most; the least recently used idle one is evicted at the "
                                      "cap", group="sessions", in_file=True)
    recovery: str = setting("auto", "on: a lost session re-registers by itself on masks found in the depth of its "
                                    "next frames; off: it tracks on from its last pose until the client re-registers "
                                    "it with a mask; auto: on with --weights, off on random weights (where every "
                                    "session is lost)", group="sessions", choices=("auto", "on", "off"),
                           in_file=True)
    stream_idle_s: float = setting(60.0, "a /track/stream connection with no message for this long is closed",
                                   group="sessions", in_file=True)
    submit_timeout_s: float = setting(0.05, "wait for room in the pipeline before answering 503 + Retry-After",
                                      group="sessions", in_file=True)
    track_capacity: int = setting(256, "track requests admitted at once over all sessions, 503 above",
                                  group="sessions", in_file=True)
    register_capacity: int = setting(0, "registers admitted at once, 503 above, before the body is decoded; 0 = "
                                        "twice the register frames in flight", group="sessions",
                                 in_file=True)
    track_latency_budget_s: float = setting(2.0, "while the track lane is saturated and its recent latency is above "
                                                 "this, new tracks get 503; 0 = only track_capacity bounds",
                                            group="sessions", in_file=True)
    session_waiting: int = setting(1, "track requests of one session that may wait behind its running one; 429 "
                                      "above", group="sessions", in_file=True)
    retry_after_s: int = setting(1, "the Retry-After of a 503 without a measured estimate", group="sessions",
                                 in_file=True)
    # -- object limits
    max_mesh_faces: int = setting(200_000, "uploaded meshes with more faces answer 413, unless uploaded with "
                                           "simplify=true", group="objects", in_file=True)
    max_mesh_vertices: int = setting(200_000, "uploaded meshes with more vertices answer 413", group="objects",
                                     in_file=True)
    max_register_cost: int | None = setting(None, "refuse uploads (413) whose faces x hypotheses x (register "
                                                  "iterations + 1) exceeds this", group="objects", in_file=True,
                                            default_text="what the device renders in half of --request-timeout-s")
    max_texture_side: int = setting(2048, "textures are downscaled to this many pixels per side", group="objects",
                                    in_file=True)
    max_objects: int = setting(256, "loaded objects at most; uploads answer 507 beyond", group="objects",
                               in_file=True)
    max_objects_mb: float = setting(4096.0, "memory of the loaded objects in MiB at most; uploads answer 507 beyond",
                                    group="objects", in_file=True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "objects_dir", Path(self.objects_dir))
        for name in ("weights", "compile_cache"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, Path(getattr(self, name)))
        object.__setattr__(self, "max_image_hw", (int(self.max_image_hw[0]), int(self.max_image_hw[1])))
        if self.ingest_workers is None:
            object.__setattr__(self, "ingest_workers", default_ingest_workers(self.device))
        if self.ingest_port is None:
            object.__setattr__(self, "ingest_port", self.port)
        self._check()

    def _check(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty (leave it unset to disable authentication)")
        positive = ("max_upload_bytes", "session_ttl_s", "max_sessions", "request_timeout_s",
                    "retry_after_s", "track_capacity", "stream_idle_s", "track_iterations", "track_max_batch",
                    "max_objects_mb")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("num_hypotheses", "register_iterations", "frames_in_flight"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or unset for the device's default), got {value!r}")
        for name in ("register_capacity", "warmup_timeout_s", "shutdown_timeout_s", "track_latency_budget_s",
                     "loop_stall_s", "session_waiting", "submit_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.ingest_workers < 0 or self.ingest_slots < 1 or not 0 <= self.ingest_port < 65536:
            raise ValueError(f"ingest: workers >= 0, slots >= 1, port in 0..65535; got {self.ingest_workers!r}, "
                             f"{self.ingest_slots!r}, {self.ingest_port!r}")
        if 0 < self.loop_stall_s <= LOOP_BEAT_S:
            raise ValueError(f"loop_stall_s must be 0 (off) or above {LOOP_BEAT_S:g} s (the watch's beat), "
                             f"got {self.loop_stall_s!r}")
        h, w = self.max_image_hw
        if h < 1 or w < 2:
            raise ValueError(f"max_image_hw must be at least (1, 2), got {self.max_image_hw!r}")
        self.object_limits  # noqa: B018 - its own checks

    @classmethod
    def from_settings(cls, **settings: Any) -> ServerConfig:
        """The same as the constructor (kept for callers that build a config from a dict of settings)."""
        return cls(**settings)

    # -- derived ----------------------------------------------------------------------------------------------------
    @property
    def on_cpu(self) -> bool:
        return runs_on_cpu(self.device)

    @property
    def hypotheses(self) -> int | None:
        """Register hypotheses in use (None: the whole grid)."""
        if self.num_hypotheses is not None:
            return self.num_hypotheses
        return (CPU_DEFAULTS if self.on_cpu else FULL_DEFAULTS)["num_hypotheses"]

    @property
    def iterations(self) -> int:
        """Register iterations in use."""
        if self.register_iterations is not None:
            return self.register_iterations
        return (CPU_DEFAULTS if self.on_cpu else FULL_DEFAULTS)["register_iterations"]

    @property
    def recovery_config(self) -> RecoveryConfig | None:
        """How a lost session recovers by itself (:mod:`foundationpose.recovery`); None: it does not."""
        from foundationpose.recovery import DEFAULT_RECOVERY  # OpenCV: not for --help

        on = self.recovery == "on" or (self.recovery == "auto" and self.weights is not None)
        return DEFAULT_RECOVERY if on else None

    @property
    def register_frames(self) -> int:
        """Register frames in flight: ``frames_in_flight``, or 4 where registers are captured as one CUDA graph
        (the Triton renderer, which ``auto`` picks on CUDA, and the torch backend: a slot then holds one frame; 4
        answered 8 registers/s beside 64 track clients on the H200 where 2 answered 4.3), else 2 (a slot also holds
        252 hypotheses' network inputs, ~0.3 GiB)."""
        if self.frames_in_flight is not None:
            return self.frames_in_flight
        triton = self.renderer == "triton" or (self.renderer == "auto" and not self.on_cpu)
        return 4 if triton and self.backend == "torch" and not self.eager else 2

    @property
    def settings_note(self) -> str | None:
        """A line for the log and /readyz when the small CPU algorithm size was chosen for the user."""
        if not self.on_cpu or (self.num_hypotheses is not None and self.register_iterations is not None):
            return None
        return (f"CPU: small default config (hypotheses {self.hypotheses}, register iterations {self.iterations}); "
                "pass --hypotheses 252 --register-iterations 5 for the full one (minutes per register on a CPU)")

    @property
    def track_latency_budget_ms(self) -> float | None:
        """The track admission's latency budget in ms (None: no latency bound)."""
        return self.track_latency_budget_s * 1e3 if self.track_latency_budget_s > 0 else None

    @property
    def object_limits(self) -> ObjectLimits:
        return ObjectLimits(max_faces=self.max_mesh_faces, max_vertices=self.max_mesh_vertices,
                            max_register_cost=self.max_register_cost, max_texture_side=self.max_texture_side,
                            max_objects=self.max_objects, max_total_bytes=int(self.max_objects_mb * _MIB))

    def runtime(self) -> Any:
        """How the estimator runs: the library's :class:`~foundationpose.runtime.RuntimeConfig` (its defaults, the
        fastest measured, but for what these settings name)."""
        from foundationpose.runtime import RuntimeConfig  # torch: not before --help is answered

        extra = {} if self.compile_cache is None else {"compile_cache": self.compile_cache}
        return RuntimeConfig(device=self.device, weights=self.weights, backend=self.backend, precision=self.precision,
                             renderer=self.renderer, capture=not self.eager, compile=self.compile,
                             trust_weights_file=self.trust_weights_file, **extra)

    @property
    def estimator(self) -> Any:
        """The library's :class:`~foundationpose.estimator.EstimatorConfig` of these settings."""
        from foundationpose.estimator import EstimatorConfig

        return EstimatorConfig(num_hypotheses=self.hypotheses, register_iterations=self.iterations,
                               track_iterations=self.track_iterations, max_translation_m=self.max_translation_m)

    @property
    def service(self) -> Any:
        """The library's :class:`~foundationpose.service.ServiceConfig` of these settings (its sizing)."""
        from foundationpose.service import ServiceConfig

        return ServiceConfig(frames_in_flight=self.register_frames, track_max_batch=self.track_max_batch,
                             max_image_hw=self.max_image_hw)
