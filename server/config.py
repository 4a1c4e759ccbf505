"""The server's settings: one frozen value object, built by the CLI (flags and ``FP_*`` variables) or by tests."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from foundationpose.estimator import EstimatorConfig
from foundationpose.runtime import RuntimeConfig
from foundationpose.service import ServiceConfig
from server.limits import ObjectLimits
from server.loop_watch import LOOP_BEAT_S

__all__ = ["ServerConfig", "parse_image_size"]

_SIZE_RE = re.compile(r"^\s*(\d{1,5})\s*[xX]\s*(\d{1,5})\s*$")


def parse_image_size(text: str) -> tuple[int, int]:
    """``"1920x1080"`` (width x height, pixels) -> ``(1080, 1920)`` as (H, W)."""
    match = _SIZE_RE.match(text)
    if match is None:
        raise ValueError(f"image size must read WIDTHxHEIGHT in pixels, e.g. 1920x1080; got {text!r}")
    width, height = int(match.group(1)), int(match.group(2))
    if width < 2 or height < 1:
        raise ValueError(f"image size must be at least 2x1 pixels; got {text!r}")
    return height, width


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    """Everything ``python -m server`` can be told; defaults are the documented ones.

    objects_dir: meshes loaded at start (``<id>/`` folders or ``<id>.obj|.ply|.glb`` files) and where
        ``POST /objects`` stores uploads (``<id>/`` only).
    host, port: where uvicorn listens. device: ``auto`` | ``cpu`` | ``cuda[:i]``.
    backend: ``torch`` | ``onnxruntime`` | ``tensorrt``. precision: ``auto`` | ``fp32`` | ``fp16`` | ``bf16``.
    renderer: ``auto`` | ``cpu`` | ``nvdiffrast``. weights: weights root (None = deterministic random weights).
    api_key: when set, every route but ``/healthz`` needs ``Authorization: Bearer <key>`` (hidden in repr).
    max_upload_bytes: largest request body (413 above it).
    session_ttl_s: idle seconds before a tracking session expires. max_sessions: live sessions at most;
        at the cap the least recently used idle session is evicted (503 when every one is busy).
    sweep_interval_s: how often expired sessions are removed in the background.
    submit_timeout_s: how long a request may wait for room in the pipeline before 503 + Retry-After.
    request_timeout_s: longest wait for a pose before 504; also the service deadline of the request (dropped
        at its next stage boundary once passed). retry_after_s: the Retry-After value on 503.
    warmup: run one register and one track on a synthetic frame before reporting ready.
    estimator: the algorithm's settings (hypotheses, iterations, the poses' working range).
    service: the lanes' sizing; ``service.max_image_hw`` is also the largest image the server decodes.
    warmup_timeout_s: the warm-up's own deadline (not the request timeout; 0 = none). A warm-up that
        misses it leaves the server ``failed``; ``POST /readyz/retry`` waits for it again.
    shutdown_timeout_s: how long shutdown waits for in-flight work and the pipeline threads; queued work
        is cancelled (the threads are daemons: a stuck one cannot keep the process alive).
    trust_weights_file: allow checkpoints that need full unpickling (runs code from the file).
    docs: serve ``/docs`` and ``/redoc`` (assets bundled, no CDN) and ``/openapi.json``; public even with
        an API key (the pages' API calls need the key: the Authorize button).
    settings_note: a line shown in the log and ``/readyz`` (e.g. why a small CPU config was chosen).
    object_limits: mesh, texture, object-count and memory limits (:class:`server.limits.ObjectLimits`).
    track_capacity: track requests admitted at once over all sessions (running + waiting); 503 above it.
    register_capacity: registers admitted at once (decoding, waiting for a pipeline slot, running); 503 + Retry-After
        above it, before the body is decoded. 0 = twice ``frames_in_flight``.
    track_latency_budget_s: while the track lane is saturated and its recent latency is above this, new
        tracks get 503 + Retry-After (0 = no latency bound, only ``track_capacity``).
    session_waiting: track requests of one session that may wait behind its running one; 429 above it.
    stream_idle_s: a ``/track/stream`` connection with no message for this long is closed.
    decode_threads: threads of the server's decode pool, in which a request's depth image is decoded while
        its worker thread decodes the rgb (the codecs release the GIL); 0 = decode both in the request's thread.
    prepare_track: after a register (or a stateless track, a stream start) of an object at an image size not seen
        yet, build (on CUDA: capture) its track steps for that size in a background thread
        (:mod:`server.track_prepare`), so that its first tracks do not pay for the captures.

    ingest_workers: processes that serve ``POST /track/binary`` on a second port (``ingest_port``, on ``host``), each
        receiving, parsing and decoding under its own GIL and handing the frame to this process through shared
        memory (:mod:`server.ingest`); 0 = none (the main port serves every route either way).
    ingest_port: the track port of the ingest workers (0: any free port, logged; the CLI's default is ``port`` + 1).
    ingest_slots: frames one ingest worker may have in this process at once; a request beyond gets 503.
    ingest_submit_in_loop: the ingest workers' tracks are validated and submitted on this process's event loop
        instead of in a worker thread each, when their frames lie in a page-locked ring (no decode, no staging copy
        left: :func:`server.pose_flow.run_submit`; an inline step only for a request alone in the process). On by
        default: on the H200, 64 binary clients through 8 workers tracked 970 tracks/s (p99 118 ms) with it, 821-867
        from worker threads on a host as slow (session 10); in-process, 64 coroutine sessions: 2,714 vs 2,480
        frames/s with a submit pool.
    ingest_decode_inline: the ingest workers copy raw frames (no image codec) into their ring on their event loop
        instead of a worker thread each (a ~1 ms copy and range check; encoded images still decode in a thread). On by
        default: the thread's two hops cost more, most under load, where a worker's decode thread waits for the GIL
        behind its busy loop (on 2 CPU cores, 16 clients: the decode phase 6.0 -> 1.8 ms; one client 0.71 -> 0.43).
    ingest_balance: the GPU process accepts the track port's connections and hands each to the ingest worker with
        the fewest open ones (:mod:`server.ingest.dispatch`), instead of every worker accepting on the shared socket,
        where the kernel spreads long-lived connections unevenly (on the H200 under 64 clients one of 8 workers used
        0.7-0.9 of a core while another used 0.06-0.3).
    gc_freeze: when start-up is done, collect once and freeze what is left (``gc.freeze``): later full collections
        of Python's garbage collector skip the ~270k+ start-up objects instead of stopping every thread for ~150 ms
        or more (:mod:`server.gc_pauses`). Process-wide: turn it off when embedding the app in a process of your own.
    loop_stall_s: when the event loop (of this process or of an ingest worker) runs no timer for this long, log a
        warning with its thread's stack, once per stall (:mod:`server.loop_watch`; ``fp_event_loop_*`` in
        ``/metrics``); 0 turns the watch off.
    compile_cache: the folder of the ``torch.compile`` artifact files (:mod:`foundationpose.compile_cache`; None: the
        library's default folder): loaded before the networks compile, written after the first start, so the next
        start on a fresh machine skips most of the compile. Unpickled: only files this server wrote.

    :meth:`from_settings` builds one from flat settings (what the CLI and tests have).
    """

    objects_dir: Path
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "auto"
    backend: str = "torch"
    precision: str = "auto"
    renderer: str = "auto"
    weights: Path | None = None
    api_key: str | None = field(default=None, repr=False)
    max_upload_bytes: int = 20 * 1024 * 1024
    session_ttl_s: float = 300.0
    max_sessions: int = 1024
    sweep_interval_s: float = 30.0
    submit_timeout_s: float = 0.05
    request_timeout_s: float = 60.0
    retry_after_s: int = 1
    warmup: bool = True
    track_capacity: int = 256
    register_capacity: int = 0  # 0: twice the register frames in flight
    track_latency_budget_s: float = 2.0
    session_waiting: int = 1
    stream_idle_s: float = 60.0
    decode_threads: int = 8
    prepare_track: bool = True
    ingest_workers: int = 0
    ingest_port: int = 0
    ingest_slots: int = 32
    ingest_submit_in_loop: bool = True
    ingest_decode_inline: bool = True
    ingest_balance: bool = True
    gc_freeze: bool = True
    loop_stall_s: float = 2.0
    compile_cache: Path | None = None
    estimator: EstimatorConfig = EstimatorConfig()
    service: ServiceConfig = ServiceConfig()
    warmup_timeout_s: float = 600.0
    shutdown_timeout_s: float = 5.0
    trust_weights_file: bool = False
    docs: bool = True
    settings_note: str | None = None
    object_limits: ObjectLimits = field(default_factory=ObjectLimits)

    @property
    def track_latency_budget_ms(self) -> float | None:
        """The track admission's latency budget in ms (None: no latency bound)."""
        return self.track_latency_budget_s * 1e3 if self.track_latency_budget_s > 0 else None

    def __post_init__(self) -> None:
        object.__setattr__(self, "objects_dir", Path(self.objects_dir))
        if self.weights is not None:
            object.__setattr__(self, "weights", Path(self.weights))
        if self.compile_cache is not None:
            object.__setattr__(self, "compile_cache", Path(self.compile_cache))
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty (leave it unset to disable authentication)")
        positive = ("max_upload_bytes", "session_ttl_s", "max_sessions", "sweep_interval_s",
                    "request_timeout_s", "retry_after_s", "track_capacity", "stream_idle_s")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.register_capacity < 0:
            raise ValueError(f"register_capacity must be >= 0 (0 = twice frames_in_flight), got {self.register_capacity!r}")
        for name in ("warmup_timeout_s", "shutdown_timeout_s", "track_latency_budget_s", "loop_stall_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.ingest_workers < 0 or self.ingest_slots < 1 or not 0 <= self.ingest_port < 65536:
            raise ValueError(f"ingest: workers >= 0, slots >= 1, port in 0..65535; got {self.ingest_workers!r}, "
                             f"{self.ingest_slots!r}, {self.ingest_port!r}")
        if self.ingest_workers and self.ingest_port == self.port:
            raise ValueError(f"ingest_port must differ from port ({self.port})")
        if 0 < self.loop_stall_s <= LOOP_BEAT_S:
            raise ValueError(f"loop_stall_s must be 0 (off) or above {LOOP_BEAT_S:g} s (the watch's beat), "
                             f"got {self.loop_stall_s!r}")
        if self.decode_threads < 0:
            raise ValueError(f"decode_threads must be >= 0, got {self.decode_threads!r}")
        if self.session_waiting < 0:
            raise ValueError(f"session_waiting must be >= 0, got {self.session_waiting!r}")
        if self.submit_timeout_s < 0:
            raise ValueError(f"submit_timeout_s must be >= 0, got {self.submit_timeout_s!r}")
        if not isinstance(self.estimator, EstimatorConfig) or not isinstance(self.service, ServiceConfig):
            raise TypeError("estimator and service must be an EstimatorConfig and a ServiceConfig")
        h, w = self.service.max_image_hw
        if h < 1 or w < 2:
            raise ValueError(f"max_image_hw must be at least (1, 2), got {self.service.max_image_hw!r}")

    def runtime(self) -> RuntimeConfig:
        """How the estimator runs (the library's defaults but for what these settings name)."""
        extra = {} if self.compile_cache is None else {"compile_cache": self.compile_cache}
        return RuntimeConfig(device=self.device, weights=self.weights, backend=self.backend, precision=self.precision,
                             renderer=self.renderer, trust_weights_file=self.trust_weights_file, **extra)

    @property
    def max_image_hw(self) -> tuple[int, int]:
        """Largest (H, W) image accepted (the service's pool size)."""
        return self.service.max_image_hw

    @classmethod
    def from_settings(cls, **settings: Any) -> ServerConfig:
        """Flat settings -> config: each name goes to the field of that name of this class,
        :class:`EstimatorConfig` or :class:`ServiceConfig` (e.g. ``num_hypotheses``, ``frames_in_flight``)."""
        parts: dict[type, dict[str, Any]] = {EstimatorConfig: {}, ServiceConfig: {}, cls: {}}
        for name, value in settings.items():
            owner = next((c for c in (cls, EstimatorConfig, ServiceConfig)
                          if name in {f.name for f in fields(c)} and name not in ("estimator", "service")), None)
            if owner is None:
                raise TypeError(f"unknown setting {name!r}")
            parts[owner][name] = value
        return cls(**parts[cls], estimator=EstimatorConfig(**parts[EstimatorConfig]),
                   service=ServiceConfig(**parts[ServiceConfig]))
