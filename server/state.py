"""The single-process server: engines, objects, sessions and metrics, with start-up and shutdown; the
:class:`~server.flow.steps.Host` of ``python -m server``'s routes, its ingest hub and a Serve pose replica.

Start-up runs in a background (daemon) thread so that ``/healthz`` answers at once while the networks load:
build the estimator (unless injected; :meth:`ServerConfig.runtime`: the library's fastest path unless the settings
say otherwise), the :class:`~foundationpose.service.PoseService` (unless injected), load the objects directory (a
file that does not load fails the start-up, naming it), then warm up (``warmup``; under one deadline,
``warmup_timeout_s``, not the request timeout), then report ready. The warm-up's steps, each logged at INFO with its
time (``/readyz``'s ``warmup_paths_ms``, ``fp_warmup_seconds``):

1. ``pipeline``: one synthetic register + track through both lanes of the service;
2. ``objects``: where steps are captured (CUDA), every loaded object's register step and its track steps at
   ``--max-image``, each batch size replayed once; then the track steps of the group of every loaded object (at
   most :data:`~foundationpose.object_group.MAX_GROUP_OBJECTS`; beyond it the first ones, logged), which serve any
   batch mixing loaded objects (steps are keyed by the set of objects, a subset reuses its group's);
3. ``requests``: every request path once through the app (:func:`server.warmup.warm_app`: PNG, raw and binary
   registers and tracks, several sessions in one track, a stream), waiting for the track steps those registers
   scheduled; then every ingest worker runs its own paths (:func:`server.warmup.warm_worker`) and reports warm.

Until then pose and object routes answer 503 with Retry-After (``/readyz``'s reason names the step), except the
warm-up's own requests (:data:`server.warmup.WARMING`). A failed start-up (``phase == "failed"``) can be retried
with :meth:`ServerState.retry` (``POST /readyz/retry``): the steps already done are kept, and a pipeline warm-up
that missed its deadline is waited for again rather than submitted twice.

The first register of an object at an image size (and a stateless track or stream start of one; the warm-up's
own included) schedules the preparation of that object's track steps for the size in a background thread
(:mod:`server.track_prepare`): its own steps and those of the group of the loaded objects holding it (itself
first, :meth:`ServerState.track_group`), so that a batch mixing loaded objects finds a step at that size; no
request waits for it. An upload after ready schedules the same at ``--max-image`` at once (before any register of
it), so the new group is built off the request path.

Shutdown is prompt: it signals start-up to stop (the warm-up wait ends at once), waits at most
``shutdown_timeout_s`` for the start-up thread and for a track preparation still running (queued ones are
cancelled), then closes what this object created with ``abort`` (queued packages fail with ClosedError) within
``shutdown_timeout_s``; a stage still inside a long call is left behind (pipeline threads are daemons, so it
cannot keep the process alive). An injected service or estimator belongs to the caller and is left open.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import anyio
import torch

from deploy_core.memory import leftovers
from deploy_core.thread_names import name_native_thread
from engines.files import engine_files
from foundationpose.estimator import PoseEstimator
from foundationpose.mesh import ObjectModel, load_object
from foundationpose.object_group import MAX_GROUP_OBJECTS
from foundationpose.runtime import resolve_device
from foundationpose.service import PoseService
from foundationpose.synthetic.meshes import make_procedural_mesh
from foundationpose.synthetic.scenes import synthetic_frame
from server.admission import RegisterAdmission, ServiceTimes, Ticket, TrackAdmission, admit_track
from server.config import ServerConfig
from server.errors import ConflictError, NotReadyError, OverloadedError
from server.flow.backend import LocalBackend
from server.gc_pauses import GcPauses, freeze_startup_objects
from server.ingest.hub import IngestHub
from server.ingest.workers import IngestConfig, IngestWorkers
from server.limits import register_cost_budget
from server.loop_watch import LoopWatch
from server.metrics import Family, Metrics, StreamCounters
from server.objects import ObjectEntry, ObjectRegistry
from server.pipeline_metrics import server_families
from server.schemas import HealthBody, ReadyBody
from server.sessions import SessionStore
from server.stall_report import StallReport
from server.track_prepare import TrackPreparer
from server.warmup import warm_app, warm_frame_hw, warm_task, warming

__all__ = ["ServerState", "workers_take_the_port"]

log = logging.getLogger(__name__)

WARM_OBJECT_ID = "fp-warmup"  # the object of the request warm-up when the objects directory holds none
WARM_STEPS = ("pipeline", "objects", "requests")  # the warm-up's steps, in order (see the module docstring)
# a warm-up step running this long logs every thread's stack (then again each as long, three times at most)
WARMUP_STALL_S = 120.0
HUB_DIR_PREFIX = "fp-hub-"  # the ingest hub's socket folder in the temporary directory: fp-hub-<pid>-*

DECODE_THREADS = 8  # threads decoding requests' depth images while their worker threads decode the rgb
T = TypeVar("T")


def workers_take_the_port(config: ServerConfig) -> bool:
    """Whether the ingest workers accept the server's own port (``ingest_port == port``, the default with workers):
    every connection then reaches a worker, which serves ``POST /track/binary`` and ``WS /track/stream`` and relays
    any other request to this process's app, and uvicorn binds nothing here."""
    return config.ingest_workers > 0 and config.ingest_port == config.port


class ServerState:
    """Everything the routes share; lives on ``app.state.fp``.

    phase: ``starting`` -> ``ready`` (or ``failed``, with ``failure`` saying why) -> ``stopping`` -> ``stopped``.
    owns_process: the app runs in a process of its own (``python -m server``, a Serve replica): once ready, the
    start-up's objects are frozen out of Python's garbage collector (:mod:`server.gc_pauses`), which is
    process-wide and so left alone when the app is embedded.
    """

    def __init__(self, config: ServerConfig, *, estimator: PoseEstimator | None = None,
                 service: PoseService | None = None, clock: Callable[[], float] = time.monotonic,
                 owns_process: bool = False) -> None:
        self.config = config
        self.owns_process = owns_process
        self.metrics = Metrics()
        self.sessions = SessionStore(ttl_s=config.session_ttl_s, max_sessions=config.max_sessions, clock=clock,
                                     recovery=config.recovery_config)
        self.service_times = ServiceTimes(fallback_ms=config.retry_after_s * 1e3)
        self.admission = TrackAdmission(capacity=config.track_capacity, session_waiting=config.session_waiting,
                                        parallel=config.track_max_batch * config.service.track_batches_in_flight,
                                        times=self.service_times, latency_budget_ms=config.track_latency_budget_ms)
        frames = config.register_frames
        self.register_admission = RegisterAdmission(capacity=config.register_capacity or 2 * frames,
                                                    frames_in_flight=frames, times=self.service_times)
        self.streams = StreamCounters()
        self.backend = LocalBackend(self)
        # Decodes a request's depth while its worker thread decodes the rgb; the threads start on first use and end
        # at stop().
        self.decode_pool = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="fp-decode",
                                              initializer=name_native_thread)
        # Builds (captures) each object's track steps per image size before its tracks need them; its thread starts
        # on first use and ends at stop().
        self.track_preparer = TrackPreparer(self._prepare_track)
        self.service = service
        self.estimator = estimator if estimator is not None else (service.estimator if service is not None else None)
        self._owns_service = service is None
        self.objects: ObjectRegistry | None = None
        self.phase = "starting"
        self.failure: str | None = None
        self.warmup_ms: float | None = None  # the whole warm-up's time, once done
        self.warmup_paths_ms: dict[str, float] = {}  # each warm-up step and request path's time (ms), as done
        self.startup_step = "loading networks"  # what start-up is doing now (/readyz's reason while starting)
        self._warm_done: set[str] = set()  # WARM_STEPS done (kept by a retry)
        self._warm_spent_s = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._settled = threading.Event()
        self._stop_signal: Future[None] = Future()  # set once at shutdown: ends every start-up wait
        self._warmup_pending: list[Future[Any]] = []  # a warm-up past its deadline, waited for on retry
        self._startup_thread: threading.Thread | None = None
        self._startup_done: asyncio.Future[None] | None = None
        self._sweep_task: asyncio.Task[None] | None = None
        self.ingest: IngestHub | None = None  # the ingest workers' hub and processes (config.ingest_workers)
        self.app: Any = None  # the ASGI app of these routes (create_app): it answers what the ingest workers relay
        # the protocol factory of this process's own HTTP server (python -m server, when its ingest workers take its
        # port): a connection no worker can take is served with it, here
        self.local_protocol: Callable[[], asyncio.Protocol] | None = None
        self._served_here: set[asyncio.Task] = set()
        self.ingest_workers: IngestWorkers | None = None
        self._ingest_dir: str | None = None
        self.gc_pauses = GcPauses()  # installed from ready to stop()
        # the event loop's lag and stalls, from start() to stop() (config.loop_stall_s; 0: none)
        self.loop_watch = LoopWatch(config.loop_stall_s) if config.loop_stall_s > 0 else None

    # -- the host of the routes ------------------------------------------------------------------------------------
    def require_ready(self) -> None:
        """NotReadyError unless ready; the server's own warm-up requests (:func:`server.warmup.warming`) pass while
        it starts."""
        if self.phase != "ready" and not (self.phase == "starting" and warming()):
            why = {"starting": "still loading networks and objects",
                   "failed": "start-up failed (GET /readyz says why; POST /readyz/retry tries again)",
                   "stopping": "shutting down", "stopped": "shut down"}.get(self.phase, self.phase)
            raise NotReadyError(f"the server is not ready: {why}")

    def admit_register(self, endpoint: str) -> Ticket:
        """A register admission ticket (taken before the body is decoded), or the refusal (counted as shed)."""
        try:
            return self.register_admission.acquire()
        except OverloadedError:
            self.metrics.shed(endpoint, "register_full")
            raise

    def admit_track(self, endpoint: str, key: str | None) -> Ticket:
        """A track admission ticket, or the refusal (counted in ``fp_requests_shed_total``)."""
        return admit_track(self.admission, key, metrics=self.metrics, endpoint=endpoint)

    def health(self) -> tuple[HealthBody, bool]:
        failed = self.phase == "failed" or self.pipeline_state() == "broken"
        return HealthBody(status="failed" if failed else "ok", phase=self.phase), not failed

    async def readiness(self) -> tuple[ReadyBody, bool]:
        pipeline = self.pipeline_state()
        ready = self.phase == "ready" and pipeline == "ok"
        reason = None
        if not ready:
            if self.phase == "failed":
                reason = self.failure
            elif pipeline != "ok":
                reason = f"pipeline {pipeline}"
            else:
                reason = f"starting: {self.startup_step}" if self.phase == "starting" else self.phase
        return self._ready_body(ready, reason), ready

    def retry(self) -> ReadyBody:
        """Start again after a failed start-up (event loop); ConflictError unless ``phase == "failed"``."""
        if self.phase != "failed":
            raise ConflictError(f"nothing to retry: the server is {self.phase}", field=None)
        log.info("retrying start-up after: %s", self.failure)
        self.phase, self.failure = "starting", None
        self._settled.clear()
        self._begin_startup()
        return self._ready_body(False, "retrying")

    async def metrics_text(self) -> str:
        return self.metrics.render(self.metric_families())

    def object_stored(self, entry: Any) -> None:
        """An uploaded object was added: once ready, schedule its track steps and those of the group of the loaded
        objects at ``--max-image`` (:meth:`prepare_track_soon`; the warm-up prepared the old group there)."""
        if self.phase == "ready":
            self.prepare_track_soon(entry.model, tuple(self.config.max_image_hw))

    def object_deleted(self, object_id: str) -> None:
        """An object was deleted (its model's track steps are freed by the registry's ``on_drop``)."""

    def _ready_body(self, ready: bool, reason: str | None) -> ReadyBody:
        est, cfg = self.estimator, self.config
        hypotheses = self._register_hypotheses() if est is not None else cfg.hypotheses
        return ReadyBody(
            ready=ready, phase=self.phase, reason=reason, device=str(est.device) if est is not None else None,
            objects=len(self.objects or ()),
            random_weights=bool(est.networks.random_weights) if est is not None else None,
            settings={"hypotheses": hypotheses, "register_iterations": cfg.iterations,
                      "track_iterations": cfg.track_iterations},
            note=cfg.settings_note, warmup_ms=None if self.warmup_ms is None else round(self.warmup_ms, 1),
            warmup_paths_ms=dict(self.warmup_paths_ms) or None,
            ingest=self._ingest_info())

    def _ingest_info(self) -> dict[str, int] | None:
        workers, hub = self.ingest_workers, self.ingest
        if workers is None or hub is None or workers.port is None:
            return None
        return {"port": workers.port, "workers": len(workers.pids), "connected": hub.connected,
                "page_locked": hub.page_locked}

    # -- lifecycle -----------------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Begin the background start-up (returns at once); the ingest workers start now too (they answer 503 until
        the server is ready). OSError when the ingest workers' port is taken."""
        if self.config.ingest_workers > 0:
            await self._start_ingest()
        if self.loop_watch is not None:  # after what may fail: a failed start never reaches stop()
            self.loop_watch.start()
        self._begin_startup()

    async def _start_ingest(self) -> None:
        cfg = self.config
        tmp = Path(tempfile.gettempdir())
        if leftovers.remove_stale(tmp, HUB_DIR_PREFIX):  # the socket folders of servers that were killed
            log.info("ingest: removed socket folders of servers that no longer run")
        self._ingest_dir = tempfile.mkdtemp(prefix=leftovers.owned_prefix(HUB_DIR_PREFIX))
        self.ingest = IngestHub(self, Path(self._ingest_dir) / "hub.sock")
        await self.ingest.start()
        level = logging.getLevelName(min(logging.getLogger().getEffectiveLevel(), logging.WARNING))
        self.ingest_workers = IngestWorkers(
            IngestConfig(cfg.ingest_workers, host=cfg.host, port=cfg.ingest_port, slots=cfg.ingest_slots,
                         loop_stall_s=cfg.loop_stall_s, stop_timeout_s=max(1.0, cfg.shutdown_timeout_s)),
            hub_path=self.ingest.socket_path, max_image_hw=cfg.max_image_hw, api_key=cfg.api_key,
            max_upload_bytes=cfg.max_upload_bytes, retry_after_s=cfg.retry_after_s,
            request_timeout_s=cfg.request_timeout_s, stream_idle_s=cfg.stream_idle_s, log_level=str(level),
            fallback=None if self.local_protocol is None else partial(self._serve_here, asyncio.get_running_loop()))
        try:
            await anyio.to_thread.run_sync(self.ingest_workers.start)
        except BaseException:
            self.ingest_workers = None
            await self._stop_ingest()
            raise

    def _serve_here(self, loop: asyncio.AbstractEventLoop, sock: Any) -> None:
        """Serve a connection no ingest worker could take (every worker given up, or every channel full) with this
        process's own HTTP server (:attr:`local_protocol`), on its event loop; called from the dispatcher's thread."""
        async def serve() -> None:
            try:
                await loop.connect_accepted_socket(self.local_protocol, sock)
            except OSError as exc:  # the client went away meanwhile
                log.info("ingest: a connection no worker took could not be served here: %s", exc)
                sock.close()

        def start() -> None:
            sock.setblocking(False)
            task = loop.create_task(serve())
            self._served_here.add(task)
            task.add_done_callback(self._served_here.discard)

        loop.call_soon_threadsafe(start)

    async def _stop_ingest(self) -> None:
        """Workers first (SIGTERM: they finish their requests, which need the hub), then the hub."""
        if self.ingest_workers is not None:
            await anyio.to_thread.run_sync(self.ingest_workers.stop)
        if self.ingest is not None:
            await self.ingest.stop()
        if self._ingest_dir is not None:
            shutil.rmtree(self._ingest_dir, ignore_errors=True)
            self._ingest_dir = None

    def _begin_startup(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._startup_done = done

        def run() -> None:
            try:
                self._startup_blocking()
            except BaseException as exc:  # noqa: BLE001 - reported to the loop, which logs it
                error: BaseException | None = exc
            else:
                error = None
            try:
                loop.call_soon_threadsafe(self._startup_finished, done, error)
            except RuntimeError:  # the loop closed first: shutdown stopped waiting for this thread
                self._settled.set()

        # A daemon: network loading cannot be interrupted, and it must not keep a stopping process alive.
        self._startup_thread = threading.Thread(target=run, name="fp-server-startup", daemon=True)
        self._startup_thread.start()

    def _startup_finished(self, done: asyncio.Future[None], error: BaseException | None) -> None:
        if error is not None:
            if self.phase == "starting":
                self.phase = "failed"
                self.failure = f"{type(error).__name__}: {error}"
                log.error("start-up failed (POST /readyz/retry tries again): %s", self.failure,
                          exc_info=error if not isinstance(error, _StartupStopped | TimeoutError) else None)
        elif self.phase == "starting":
            if self.owns_process:  # one full collection now, none of these objects walked again
                freeze_startup_objects()
            self.gc_pauses.install()  # the collections while serving (not start-up's)
            self.phase = "ready"
            if self._sweep_task is None:
                self._sweep_task = asyncio.create_task(self.sessions.sweep_every(),
                                                       name="fp-session-sweep")
            note = self.config.settings_note
            warm = f", warm-up {self.warmup_ms:.0f} ms" if self.warmup_ms is not None else ""
            log.info("ready: %d objects, device %s%s%s", len(self.objects or ()), self.estimator.device, warm,
                     f" ({note})" if note else "")
        self._settled.set()
        if not done.done():
            done.set_result(None)

    def _check_stop(self) -> None:
        if self._stop_signal.done():
            raise _StartupStopped("the server is shutting down")

    def _startup_blocking(self) -> None:
        cfg = self.config
        if self.estimator is None:
            self.startup_step = "loading networks"
            log.info("loading networks: device=%s backend=%s precision=%s", cfg.device, cfg.backend, cfg.precision)
            self.estimator = PoseEstimator.create(runtime=cfg.runtime(), config=cfg.estimator,
                                                  engine_files=engine_files)
        self._check_stop()
        if self.service is None:
            self.service = PoseService(self.estimator, cfg.service)
        self._check_stop()
        if self.objects is None:
            self.startup_step = "loading objects"
            registry = self._make_registry()
            registry.load_all()
            if registry.load_failures:  # kept unset: a retry loads the directory again
                failed = "; ".join(f"{name}: {why}" for name, why in sorted(registry.load_failures.items()))
                raise RuntimeError(f"objects directory {registry.root}: {len(registry.load_failures)} file(s) did "
                                   f"not load ({failed}); fix or remove them, then POST /readyz/retry")
            self.objects = registry
        if cfg.warmup and self.warmup_ms is None:
            self._warm_all()

    def _warm_all(self) -> None:
        """Run the warm-up's steps not done yet (:data:`WARM_STEPS`) under one deadline (``warmup_timeout_s``, from
        this attempt's start; 0: none); ``warmup_ms`` is their time over every attempt, set once all are done."""
        limit = self.config.warmup_timeout_s
        deadline = time.monotonic() + limit if limit > 0 else None
        steps = {"pipeline": self._warm_up, "objects": self._warm_objects, "requests": self._warm_requests}
        for name in WARM_STEPS:
            if name in self._warm_done:
                continue
            self._check_stop()
            started = time.perf_counter()
            try:
                with StallReport(f"warm-up step {name!r}", WARMUP_STALL_S):
                    steps[name](deadline)
            finally:
                self._warm_spent_s += time.perf_counter() - started
            self.warmup_paths_ms[name] = round((time.perf_counter() - started) * 1e3, 1)
            self._warm_done.add(name)
        self.warmup_ms = self._warm_spent_s * 1e3
        log.info("warm-up done in %.0f ms: %s", self.warmup_ms,
                 ", ".join(f"{name} {self.warmup_paths_ms[name]:.0f} ms" for name in WARM_STEPS))

    @property
    def device(self) -> torch.device:
        """The compute device: the estimator's once it is built, else the one the configuration resolves to (also
        while the networks load); ValueError when that device cannot be had (CUDA asked for, none here)."""
        return self.estimator.device if self.estimator is not None else resolve_device(self.config.device)

    def _register_hypotheses(self) -> int:
        """Hypotheses of a register: the setting, else the estimator's rotation grid (built by then)."""
        return self.config.hypotheses or len(self.estimator.rotation_grid())

    def _make_registry(self) -> ObjectRegistry:
        cfg, est = self.config, self.estimator
        hypotheses = self._register_hypotheses()
        budget = cfg.max_register_cost
        if budget is None:
            budget = register_cost_budget(est.device.type, cfg.request_timeout_s)
        return ObjectRegistry(cfg.objects_dir, device=est.device, limits=cfg.object_limits,
                              register_shape=(hypotheses, cfg.iterations), max_register_cost=budget,
                              on_drop=self._object_dropped)

    def _object_dropped(self, model: Any) -> None:
        """A deleted or replaced object: forget its prepared sizes and free its captured track steps."""
        self.track_preparer.forget(model)
        if self.service is not None:
            self.service.forget_object(model)

    def _prepare_track(self, obj: Any, hw: tuple[int, int]) -> int:
        """The preparer's job (its thread): the service's track steps for ``obj`` at ``hw``, then those of the group
        of the loaded objects holding it (:meth:`track_group`); 0 once it is closed. Returns the steps built."""
        if self._stop_signal.done():
            return 0
        built = self.service.prepare_track(obj, hw)
        group, _ = self.track_group(obj)
        if len(group) > 1 and not self._stop_signal.done():
            built += self.service.prepare_track(group, hw)
        return built

    def track_group(self, first: Any | None = None) -> tuple[list[Any], int]:
        """``(objects, loaded)``: the loaded objects whose track steps are prepared as one group (``first`` first
        when given, then the registry's order; at most :data:`~foundationpose.object_group.MAX_GROUP_OBJECTS`) and
        how many objects are loaded (more than the group holds: batches mixing the others build their steps when
        they come)."""
        models = [e.model for e in self.objects.entries()] if self.objects is not None else []
        if first is not None:
            models = [first, *(m for m in models if m is not first)]
        return models[:MAX_GROUP_OBJECTS], len(models)

    def prepare_track_soon(self, obj: Any, hw: tuple[int, int]) -> None:
        """Schedule the preparation of ``obj``'s track steps at image size ``hw`` (H, W) once per (object, size);
        returns at once, never raises (any thread: the backend calls it when a register or track succeeds)."""
        self.track_preparer.schedule(obj, hw)

    def _await(self, future: Future[T], deadline: float | None) -> T:
        """The future's result, or _StartupStopped at shutdown, or TimeoutError past ``deadline``."""
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        wait([future, self._stop_signal], timeout=timeout, return_when=FIRST_COMPLETED)
        self._check_stop()
        if not future.done():
            raise TimeoutError(f"warm-up did not finish within {self.config.warmup_timeout_s:g} s "
                               "(warmup_timeout_s in the --config file); on a CPU pick a small config (see --help); "
                               "POST /readyz/retry waits for it again")
        return future.result()

    def _warm_up(self, deadline: float | None = None) -> None:
        """One register and one track of a synthetic frame through the service (fills caches, builds plans).

        ``deadline``: ``time.monotonic()`` seconds (None: none). A register still running at the deadline is kept
        in ``_warmup_pending`` and waited for by the next attempt (never submitted twice).
        """
        self.startup_step = "warming the pipeline lanes"
        started = time.perf_counter()
        max_h, max_w = self.config.max_image_hw
        frame = synthetic_frame(min(480, max_h), min(640, max_w))
        obj = load_object(make_procedural_mesh(), device=self.estimator.device, name="warmup")
        try:
            if not self._warmup_pending:
                self._warmup_pending = [self.service.submit_register(obj, frame.rgb, frame.depth_m, frame.mask,
                                                                     frame.K)]
            reg = self._await(self._warmup_pending[0], deadline)
            if len(self._warmup_pending) < 2:
                self._warmup_pending.append(self.service.submit_track(
                    obj, frame.rgb, frame.depth_m, frame.K, reg.cam_from_centred, prev_frame="centred"))
            self._await(self._warmup_pending[1], deadline)
        except (TimeoutError, _StartupStopped):
            raise  # still computing: a retry waits for the same futures
        except BaseException:
            self._warmup_pending = []  # failed: a retry submits afresh
            raise
        self._warmup_pending = []
        log.info("warm-up: the pipeline lanes in %.0f ms", (time.perf_counter() - started) * 1e3)

    def _warm_objects(self, deadline: float | None = None) -> None:
        """Where steps are captured (CUDA): build every loaded object's register step and its track steps (each
        batch size the track lane runs) at the largest image size (``--max-image``) before ready, and replay each
        track step once, so a client's first register and tracks at that size replay captured (and launched) steps
        instead of capturing them in the request path; then the group of every loaded object (:meth:`_warm_group`).
        An object that fails here fails the start-up, naming the object (``/readyz`` says why). ``deadline``:
        checked between objects."""
        est, service, cfg = self.estimator, self.service, self.config
        if est is None or service is None or self.objects is None or est.device.type != "cuda":
            return
        self.startup_step = "warming the objects' register and track steps"
        hw = tuple(cfg.max_image_hw)
        hypotheses = self._register_hypotheses()
        for entry in self.objects.entries():
            self._check_stop()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"warm-up did not finish within {cfg.warmup_timeout_s:g} s (warming the objects' "
                                   "steps; warmup_timeout_s in the --config file); POST /readyz/retry goes on")
            started = time.perf_counter()
            try:
                est.register_runner.prepare(entry.model, hypotheses, hw, cfg.iterations)
                built = service.prepare_track(entry.model, hw)
                service.time_track_steps(entry.model, hw, repeats=1)  # each batch size's first launch
            except Exception as exc:
                raise RuntimeError(f"warming object {entry.object_id!r} at {hw[1]}x{hw[0]} failed: "
                                   f"{type(exc).__name__}: {exc}") from exc
            log.info("object %s warm at %dx%d: register step and %d track steps (each replayed once) in %.0f ms",
                     entry.object_id, hw[1], hw[0], built, (time.perf_counter() - started) * 1e3)
        self._warm_group(hw, deadline)

    def _warm_group(self, hw: tuple[int, int], deadline: float | None) -> None:
        """The track steps of the group of every loaded object at ``hw`` (:meth:`track_group`), each batch size
        replayed once: any batch mixing loaded objects then replays one of them (a subset runs on its group's
        steps). Logs how many objects it holds when more are loaded. An error fails the start-up."""
        group, loaded = self.track_group()
        if len(group) < 2:
            return
        self._check_stop()
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"warm-up did not finish within {self.config.warmup_timeout_s:g} s (warming the "
                               "objects' group steps; warmup_timeout_s in the --config file); POST /readyz/retry "
                               "goes on")
        if loaded > len(group):
            log.warning("warm-up: %d objects loaded, a track group holds at most %d: the group of the first %d is "
                        "prepared; a batch mixing the others builds its step when it first comes", loaded,
                        MAX_GROUP_OBJECTS, len(group))
        started = time.perf_counter()
        try:
            built = self.service.prepare_track(group, hw)
            self.service.time_track_steps(group, hw, repeats=1)
        except Exception as exc:
            raise RuntimeError(f"warming the track group of {len(group)} objects at {hw[1]}x{hw[0]} failed: "
                               f"{type(exc).__name__}: {exc}") from exc
        log.info("track group of %d objects warm at %dx%d: %d track steps (each replayed once) in %.0f ms",
                 len(group), hw[1], hw[0], built, (time.perf_counter() - started) * 1e3)

    def _warm_requests(self, deadline: float | None = None) -> None:
        """Every request path once through the app (:func:`server.warmup.warm_app`, at the size
        :func:`~server.warmup.warm_frame_hw` gives), then every ingest worker's own paths (the hub asks each and
        waits until as many as ``ingest_workers`` are connected and warm). The object is the first one loaded, or
        a temporary procedural one (:data:`WARM_OBJECT_ID`, removed after) when none is. Without an app (a Serve
        replica, whose requests come through its ingress) nothing runs. Each path's time is logged at INFO and kept
        in ``warmup_paths_ms``; a path that fails raises :class:`~server.warmup.WarmupError` naming it."""
        cfg = self.config
        if self.app is None or self._loop is None:
            log.info("warm-up: no app in this process: the request paths are warmed by whoever serves them")
            return
        hw = warm_frame_hw(cfg.max_image_hw, cfg.max_upload_bytes)
        entries = self.objects.entries()
        entry = entries[0] if entries else self._add_warm_object()
        try:
            self.startup_step = f"warming the request paths ({entry.object_id} at {hw[1]}x{hw[0]})"
            paths = self._on_loop(warm_app(self.app, entry.object_id, hw, cfg.api_key), deadline)
            for name, ms in paths.items():
                log.info("warm-up: path %s in %.0f ms", name, ms)
            self.warmup_paths_ms.update(paths)
            # the registers scheduled the object's track steps at this size (TrackPreparer): they are part of warm
            self.startup_step = "preparing the warm-up object's track steps"
            started = time.perf_counter()
            while not self.track_preparer.wait_idle(0.05):
                self._check_stop()
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"warm-up did not finish within {cfg.warmup_timeout_s:g} s (preparing track "
                                       "steps; warmup_timeout_s in the --config file); POST /readyz/retry goes on")
            self.warmup_paths_ms["track_prepare"] = round((time.perf_counter() - started) * 1e3, 1)
            if self.ingest is not None and self.ingest_workers is not None:
                self.startup_step = f"warming the ingest workers (0 of {cfg.ingest_workers})"
                workers = self._on_loop(self.ingest.warm_workers(entry.object_id, hw, cfg.ingest_workers,
                                                                 progress=self._workers_progress), deadline)
                for pid, worker_paths in workers.items():
                    log.info("warm-up: ingest worker %d: %s", pid,
                             ", ".join(f"{name} {ms:.0f} ms" for name, ms in worker_paths.items()))
                for name in {n for worker_paths in workers.values() for n in worker_paths}:
                    self.warmup_paths_ms[f"ingest_{name}"] = max(p.get(name, 0.0) for p in workers.values())
        finally:
            if entry.object_id == WARM_OBJECT_ID and not entries:
                if self.ingest is not None:
                    self.ingest.warm_target = None  # a restarted worker has nothing to warm with
                self.objects.remove(WARM_OBJECT_ID)

    def _workers_progress(self, warm: int, wanted: int) -> None:
        self.startup_step = f"warming the ingest workers ({warm} of {wanted})"

    def _add_warm_object(self) -> ObjectEntry:
        """The request warm-up's object when none is loaded: the procedural block as :data:`WARM_OBJECT_ID`."""
        model: ObjectModel = load_object(make_procedural_mesh(), device=self.estimator.device, name=WARM_OBJECT_ID)
        entry = ObjectEntry(WARM_OBJECT_ID, model, "", False, "warm-up", time.time())
        self.objects.add(entry)
        return entry

    def _on_loop(self, coro: Any, deadline: float | None) -> Any:
        """Run ``coro`` on the event loop as a warm-up task (:func:`server.warmup.warm_task`) and wait for it (this
        thread) until ``deadline`` or shutdown, cancelling it then."""
        async def run() -> Any:
            return await warm_task(coro)

        future = asyncio.run_coroutine_threadsafe(run(), self._loop)
        try:
            return self._await(future, deadline)
        except BaseException:
            future.cancel()
            raise

    async def stop(self) -> None:
        """Stop the sweep and start-up, cancel queued work, close what we own, each within ``shutdown_timeout_s``
        (the pipeline threads are daemons: a stuck stage cannot hold the process)."""
        previous = self.phase
        self.phase = "stopping"
        self.gc_pauses.uninstall()
        if self.loop_watch is not None:
            self.loop_watch.stop()
        limit = self.config.shutdown_timeout_s
        if not self._stop_signal.done():
            self._stop_signal.set_result(None)
        if self._sweep_task is not None:
            self._sweep_task.cancel()
            await asyncio.gather(self._sweep_task, return_exceptions=True)
        await self._stop_ingest()
        if self._startup_done is not None and not self._startup_done.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._startup_done), limit)
            except TimeoutError:
                log.warning("start-up still running after %g s (loading networks); not waiting for it", limit)
        if not await anyio.to_thread.run_sync(self.track_preparer.close, limit):
            log.warning("shutdown: a track preparation is still running after %g s; leaving it (a daemon thread)",
                        limit)
        if self._owns_service and self.service is not None:
            try:
                await anyio.to_thread.run_sync(partial(self.service.close, abort=True, timeout=limit))
            except TimeoutError as exc:
                log.warning("shutdown: %s; leaving them (daemon threads end with the process)", exc)
        # queued decodes are cancelled; a running one takes milliseconds
        await anyio.to_thread.run_sync(partial(self.decode_pool.shutdown, wait=True, cancel_futures=True))
        self.phase = "stopped"
        log.info("stopped (was %s)", previous)

    def wait_ready(self, timeout: float) -> bool:
        """Block (a thread, not the loop) until start-up ended; True if the server is ready."""
        self._settled.wait(timeout)
        return self.phase == "ready"

    # -- helpers of the backend ----------------------------------------------------------------------------------------
    def pipeline_state(self) -> str:
        """``ok``, or ``broken`` / ``closed`` when a lane of the service is."""
        if self.service is None:
            return "ok"
        stats = self.service.stats()
        states = {stats.register.state, stats.track.state}
        for bad in ("broken", "closed", "closing"):
            if bad in states:
                return bad
        return "ok"

    async def in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking work (decoding, file IO, submit with its short timeout) off the event loop."""
        return await anyio.to_thread.run_sync(fn, *args)

    def track_alone(self) -> bool:
        """Whether the track request being submitted on the loop is the only one in this process: the only track
        admitted, and no other ingest message read and waiting for its turn on the loop (those are counted before
        they are admitted). Such a request may step inline on the loop (:class:`~server.flow.backend.LocalBackend`)."""
        return self.admission.admitted <= 1 and (self.ingest is None or self.ingest.in_flight <= 1)

    # -- metrics -----------------------------------------------------------------------------------------------------
    def metric_families(self) -> list[Family]:
        """Gauges read at scrape time: readiness, sessions, objects, pipeline stages, pools, GPU memory."""
        return server_families(self)


class _StartupStopped(Exception):
    """Start-up gave up because the server is shutting down."""
