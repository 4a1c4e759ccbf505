"""The synchronous reference path: ``register`` and ``track`` (spec §1.2, §1.3).

Poses at this API are ``cam_from_mesh`` (4x4, metres, the mesh file's own frame). Internally
everything runs in the centred frame; the conversion happens here, once.

Deviations from the reference, on purpose:
* fewer than 4 valid masked depth pixels raise :class:`InputError` instead of returning a
  guessed pose in the wrong frame (spec §8.19);
* ``track`` is stateless: the caller passes the previous pose (:class:`Tracker` keeps it).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np
import torch
from torch import Tensor

from deploy_core.timing import TimingRecorder, timed
from foundationpose import validate
from foundationpose.compile_cache import CacheLoad, compile_cache_file, load_compile_cache, save_compile_cache
from foundationpose.coordinate_frames import to_centred_frame, to_mesh_frame
from foundationpose.errors import InputError
from foundationpose.mesh import ObjectModel, load_object
from foundationpose.models.blocks import CROP_SIZE
from foundationpose.networks import EngineFiles, PoseNetworks, load_networks
from foundationpose.observation import PreparedFrame, prepare_frame
from foundationpose.recovery import DEFAULT_RECOVERY, RecoveryConfig, RecoveryPlan
from foundationpose.register_graph import RegisterGraphRunner
from foundationpose.render import Renderer, make_renderer
from foundationpose.render._cache import GeometryConstants
from foundationpose.runtime import RuntimeConfig
from foundationpose.sampling import guess_translation, make_rotation_grid
from foundationpose.session_state import SessionConfig, SessionReport, SessionState
from foundationpose.session_step import answer, plan_frame, recovery_register
from foundationpose.session_trust import CLIENT_REGISTER, TRACK, SessionTrust
from foundationpose.track_graph import TrackFrame, TrackGraphConfig, TrackGraphRunner, graph_batch_sizes
from foundationpose.validity import Judgement, ValidityModels, judgement_of_row

__all__ = [
    "EstimatorConfig",
    "PoseEstimator",
    "RegisterCandidates",
    "RegisterResult",
    "TrackResult",
    "Tracker",
    "check_crop_side",
    "runtime_with",
    "start_cam_from_centred",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class EstimatorConfig:
    """The algorithm's numbers; defaults are the reference demo's (spec §2.8). How it runs (device, precision,
    graphs, compilation) is :class:`foundationpose.runtime.RuntimeConfig`."""

    register_iterations: int = 5
    track_iterations: int = 2
    num_hypotheses: int | None = None  # None = the whole clustered grid (252); fewer for tests
    crop_size: int = CROP_SIZE  # S; must equal the networks' and the renderer's crop side (spec §0)
    max_translation_m: float | None = validate.MAX_TRANSLATION_M  # working range of user poses (|t|, metres)

    def __post_init__(self) -> None:
        if self.register_iterations < 1 or self.track_iterations < 1:
            raise ValueError("register_iterations and track_iterations must be >= 1")
        if self.num_hypotheses is not None and self.num_hypotheses < 1:
            raise ValueError(f"num_hypotheses must be >= 1 or None; got {self.num_hypotheses}")
        if self.max_translation_m is not None and not self.max_translation_m > 0:
            raise ValueError(f"max_translation_m must be > 0 or None; got {self.max_translation_m!r}")


@dataclass(frozen=True, slots=True)
class RegisterResult:
    """cam_from_mesh: (4, 4) float64 pose of the mesh file's frame (the server's ``pose``); score: scorer logit
    of the pose (only comparable within one call); cam_from_centred: the float32 tracking state; validity: how
    well the observed depth supports the pose (:class:`foundationpose.validity.Judgement`; no motion term)."""

    cam_from_mesh: np.ndarray
    score: float
    timings_ms: dict[str, float]
    cam_from_centred: np.ndarray  # (4, 4) float32: the tracking state
    validity: Judgement | None = None
    session: SessionReport | None = None  # the session's state after this frame (a Tracker's; None: stateless)


@dataclass(frozen=True, slots=True)
class RegisterCandidates:
    """All refined hypotheses of one register call before the pick. cam_from_centred: (N, 4, 4) float32 and
    scores: (N,) float32 scorer logits, on the estimator's device; best: the index :meth:`run_register` returns."""

    cam_from_centred: Tensor
    scores: Tensor
    best: int
    timings_ms: dict[str, float]

    validity: Judgement | None = None  # of the pick

    def result(self, obj: ObjectModel) -> RegisterResult:
        """The :class:`RegisterResult` of the pick (one device-to-host copy of one pose)."""
        cam_from_centred = self.cam_from_centred[self.best].detach().cpu().numpy().astype(np.float32)
        timings = dict(self.timings_ms)
        timings["total"] = sum(timings.values())
        return RegisterResult(
            cam_from_mesh=to_mesh_frame(cam_from_centred, obj.centred_from_mesh),
            score=float(self.scores[self.best].item()),
            timings_ms=timings,
            cam_from_centred=cam_from_centred,
            validity=self.validity,
        )


@dataclass(frozen=True, slots=True)
class TrackResult:
    """cam_from_mesh: (4, 4) float64 (the server's ``pose``); cam_from_centred: the float32 tracking state;
    validity: measured in the track step on the frame's depth at the refined pose
    (:class:`foundationpose.validity.Judgement`: ``valid``, ``confidence`` and the measurements behind them)."""

    cam_from_mesh: np.ndarray
    timings_ms: dict[str, float]
    cam_from_centred: np.ndarray
    validity: Judgement | None = None
    session: SessionReport | None = None  # the session's state after this frame (a Tracker's; None: stateless)


def check_crop_side(config: EstimatorConfig, networks: PoseNetworks, renderer: Renderer) -> None:
    """The crop side S is fixed by the networks' input (spec §0, §2.8); the settings must agree with it.

    Raises ValueError naming the setting, the networks' side and the value found.
    """
    sides = {"EstimatorConfig.crop_size": config.crop_size, "RenderConfig.crop_size_px": renderer.config.crop_size_px}
    for core in (networks.refiner, networks.scorer):
        net_side = core.inputs[0].shape[1]  # (N, S, S, C) NHWC
        for name, side in sides.items():
            if side != net_side:
                raise ValueError(
                    f"{name}: expected {net_side}, the {core.name} network's input side (spec §0 S); got {side}"
                )


def subsample_grid(grid: np.ndarray, n: int | None) -> np.ndarray:
    """Evenly spaced subset of ``n`` rotation hypotheses (all of them when ``n`` is None or larger)."""
    if n is None or n >= len(grid):
        return grid
    idx = np.linspace(0, len(grid) - 1, n).round().astype(np.int64)
    return grid[idx]


class PoseEstimator:
    """Register and track poses of known meshes. Thread-compatible, not thread-safe
    (use one per thread, or the pipelined service).

    Each call runs one step definition: a register's refine iterations and scorer
    (:func:`foundationpose.register_graph.register_step`) and a track step
    (:func:`foundationpose.track_graph.track_step`), on the runners' static buffers. Where everything is capturable
    (CUDA, the Triton rasteriser, torch networks, ``capture``) the steps are CUDA graphs; elsewhere the same
    functions run eagerly: that is the reference path, bit for bit the plain per-iteration algorithm on the CPU
    (tested).
    """

    def __init__(
        self,
        networks: PoseNetworks,
        renderer: Renderer,
        *,
        device: torch.device | str,
        config: EstimatorConfig = EstimatorConfig(),
        capture: bool = True,
    ) -> None:
        check_crop_side(config, networks, renderer)
        self.networks = networks
        self.renderer = renderer
        self.device = torch.device(device)
        self.config = config
        self.capture = capture
        self.recorder = TimingRecorder(name="estimator")
        self.compile_cache: CacheLoad | None = None  # what create() found in the compile cache (None: not used)
        # crop, depth-filter and back-projection constants per size and camera (bounded)
        self.constants = GeometryConstants(name="estimator")
        self._grids: dict[bytes, np.ndarray] = {}
        self._device_grids: dict[bytes, Tensor] = {}
        self._track_runner = TrackGraphRunner(
            networks.track_refiner, renderer, self.device, crop_size=config.crop_size,
            config=TrackGraphConfig(batch_sizes=(1,), capture=capture), constants=self.constants,
        )
        self.validity_models = ValidityModels(self.device)  # each object's points for judging a register's pick
        self._register_runner = RegisterGraphRunner(
            networks.refiner, networks.scorer, renderer, self.device, crop_size=config.crop_size,
            capture=capture, constants=self.constants,
        )

    @property
    def register_runner(self) -> RegisterGraphRunner:
        """The runner of this estimator's register steps (captured or eager)."""
        return self._register_runner

    @property
    def track_runner(self) -> TrackGraphRunner:
        """The runner of this estimator's track steps (captured or eager, batch 1)."""
        return self._track_runner

    @classmethod
    def create(
        cls,
        *,
        runtime: RuntimeConfig | None = None,
        config: EstimatorConfig = EstimatorConfig(),
        engine_files: EngineFiles | None = None,
        device: str | torch.device | None = None,
        weights: Path | str | None = None,
        backend: str | None = None,
        precision: str | None = None,
        renderer: str | None = None,
        trust_weights_file: bool | None = None,
    ) -> PoseEstimator:
        """Build networks and renderer as ``runtime`` says (default: :class:`RuntimeConfig`, the fastest measured
        configuration for the machine: on CUDA the compiled half-precision networks, the Triton rasteriser and
        captured steps; see :mod:`foundationpose.runtime`).

        device, weights, backend, precision, renderer, trust_weights_file: shortcuts for the fields of the same
            name; with ``runtime`` given, a shortcut that disagrees with it raises ValueError.
        engine_files: for the onnxruntime / tensorrt backends, ``engines.files.engine_files``.
        On CUDA everything is compiled, captured and warmed up here, so the first request does not pay for it;
        with ``runtime.compile_cache`` the compiled kernels are loaded from (or saved to) that folder.
        """
        runtime = runtime_with(runtime, device=device, weights=weights, backend=backend, precision=precision,
                               renderer=renderer, trust_weights_file=trust_weights_file)
        dev = runtime.resolved_device()
        render = make_renderer(runtime.renderer, dev)
        whole_steps = runtime.capture and TrackGraphRunner.captures_steps(runtime.backend, render)
        # graphs of the track refiner's own forward only where track steps cannot be captured as a whole
        track_graphs = graph_batch_sizes(TRACK_MAX_BATCH) if runtime.capture and dev.type == "cuda" and not whole_steps else ()
        cache_load = None
        cache_path = compile_cache_file(runtime.compile_cache, dev) if runtime.compiles(dev) and runtime.compile_cache else None
        if cache_path is not None:
            cache_load = load_compile_cache(cache_path)
        networks = load_networks(runtime, dev, track_graph_batches=track_graphs, engine_files=engine_files)
        estimator = cls(networks, render, device=dev, config=config, capture=runtime.capture)
        estimator.compile_cache = cache_load
        if dev.type == "cuda":  # compile / capture now, so the first request does not pay for it
            networks.warmup(len(estimator.rotation_grid()), track_graphs or (1,))
            estimator.warmup_kernels()
        if cache_path is not None and cache_load is not None and not cache_load.loaded:
            try:
                save_compile_cache(cache_path)  # the next start-up loads what this one compiled
            except OSError as exc:
                log.warning("compile cache %s not saved: %s", cache_path, exc)
        log.info("estimator ready: %s", runtime.describe(dev) | {"renderer": render.name, "captured_steps": whole_steps})
        return estimator

    def warmup_kernels(self, hw: tuple[int, int] = (480, 640)) -> None:
        """JIT-compile the depth-filter kernels (both back-projection variants) on a blank frame."""
        rgb = np.zeros((*hw, 3), np.uint8)
        depth = np.full(hw, 0.5, np.float32)
        K = np.array([[500.0, 0.0, hw[1] / 2], [0.0, 500.0, hw[0] / 2], [0.0, 0.0, 1.0]])
        for xyz_float64 in (True, False):
            prepare_frame(rgb, depth, K, self.device, xyz_float64=xyz_float64, constants=self.constants)

    def load_object(self, mesh: str | Path, **kwargs) -> ObjectModel:
        return load_object(mesh, device=self.device, **kwargs)

    # -- hypotheses -------------------------------------------------------------------------

    def rotation_grid(self, symmetry_tfs: np.ndarray | None = None) -> np.ndarray:
        """(M, 4, 4) float32 clustered grid for a symmetry set, cached (spec §2.1)."""
        key = _symmetry_key(symmetry_tfs)
        if key not in self._grids:
            grid = make_rotation_grid(symmetry_tfs)
            self._grids[key] = subsample_grid(grid, self.config.num_hypotheses)
        return self._grids[key]

    # -- the two calls ----------------------------------------------------------------------

    @property
    def limits(self) -> validate.InputLimits:
        """What :func:`validate.register_request` / :func:`validate.track_request` enforce for this estimator."""
        return validate.InputLimits(max_translation_m=self.config.max_translation_m)

    def register(
        self,
        obj: ObjectModel,
        rgb: np.ndarray,
        depth: np.ndarray,
        mask: np.ndarray,
        K: np.ndarray,
        *,
        iterations: int | None = None,
    ) -> RegisterResult:
        """First frame: hypotheses from the rotation grid, refine, score, pick the best.

        rgb: (H, W, 3) uint8 RGB.  depth: (H, W) float32 metres, 0 = invalid.
        mask: (H, W) bool / uint8, > 0 = object.  K: (3, 3) pixels.
        iterations: refine iterations (None = ``config.register_iterations``). A symmetric object
        (``obj.symmetry``) is searched on its reduced rotation grid.
        Validates into a :class:`~foundationpose.validate.RegisterRequest`, then :meth:`run_register`.
        """
        request = validate.register_request(
            rgb, depth, mask, K, iterations=iterations, limits=self.limits
        )
        return self.run_register(obj, request)

    def track(
        self,
        obj: ObjectModel,
        rgb: np.ndarray,
        depth: np.ndarray,
        K: np.ndarray,
        prev_pose: np.ndarray,
        *,
        iterations: int | None = None,
        prev_frame: str = "mesh",
    ) -> TrackResult:
        """Next frame: refine ``prev_pose`` for ``iterations`` (default ``config.track_iterations``) steps.

        prev_pose: (4, 4) cam_from_mesh, or cam_from_centred with ``prev_frame="centred"``
            (the exact float32 tracking state of the previous result, as the reference keeps it).
        Validates into a :class:`~foundationpose.validate.TrackRequest`, then :meth:`run_track`.
        """
        request = validate.track_request(
            rgb, depth, K, prev_pose, prev_frame=prev_frame, iterations=iterations, limits=self.limits
        )
        return self.run_track(obj, request)

    @overload
    def run(self, obj: ObjectModel, request: validate.RegisterRequest) -> RegisterResult: ...

    @overload
    def run(self, obj: ObjectModel, request: validate.TrackRequest) -> TrackResult: ...

    def run(self, obj, request):
        """:meth:`run_register` or :meth:`run_track`, by the request's type (as ``PoseService.submit``)."""
        if isinstance(request, validate.RegisterRequest):
            return self.run_register(obj, request)
        if isinstance(request, validate.TrackRequest):
            return self.run_track(obj, request)
        raise TypeError(f"request must be a RegisterRequest or TrackRequest, got {type(request).__name__}")

    def run_register(self, obj: ObjectModel, request: validate.RegisterRequest) -> RegisterResult:
        """:meth:`register` of an already validated request."""
        return self.register_candidates(obj, request).result(obj)

    def register_candidates(self, obj: ObjectModel, request: validate.RegisterRequest) -> RegisterCandidates:
        """:meth:`run_register` up to the scorer's pick: every refined hypothesis with its score (what
        ``foundationpose.evaluate`` needs to tell refiner failures from scorer failures)."""
        iterations = request.iterations or self.config.register_iterations
        timings: dict[str, float] = {}
        with self._stage("prepare", timings):
            frame = prepare_frame(request.rgb, request.depth, request.K, self.device, xyz_float64=True,
                                  constants=self.constants)
            mask_t = torch.as_tensor(request.mask, device=self.device)
        validate.require_masked_depth_count(int(validate.masked_depth_count(frame.depth, mask_t)))
        with self._stage("hypotheses", timings):
            poses = self.hypotheses(frame, mask_t, obj.symmetry_tfs)
        runner = self._register_runner
        with self._stage("refine_score", timings, n=len(poses)):  # every iteration and the scorer: one step
            ticket = runner.submit(obj, frame, poses, iterations, keep_all=True)
            _, _, best = runner.collect(ticket)
        assert ticket.poses is not None and ticket.scores is not None
        if self.device.type == "cuda":  # made on the runner's stream, read on the caller's from here on
            ticket.poses.record_stream(torch.cuda.current_stream(self.device))
            ticket.scores.record_stream(torch.cuda.current_stream(self.device))
        validity = self.validity_models.judge_pose(obj, frame.depth, request.K, ticket.poses[best])
        return RegisterCandidates(cam_from_centred=ticket.poses, scores=ticket.scores, best=best, timings_ms=timings,
                                  validity=validity)

    def run_track(self, obj: ObjectModel, request: validate.TrackRequest) -> TrackResult:
        """:meth:`track` of an already validated request: one track step (copy in, the step, copy out)."""
        iterations = request.iterations or self.config.track_iterations
        runner = self._track_runner
        frame = TrackFrame(rgb=request.rgb, depth=request.depth, K=request.K, start=start_cam_from_centred(request, obj))
        with timed("track_step", sink=self.recorder, stream=runner.stream, n=1) as t:
            poses, judged = runner.run(obj, [frame], iterations)
        timings = {"track_step": t.record.wall_ms if t.record is not None else 0.0}
        timings["total"] = timings["track_step"]
        return TrackResult(
            cam_from_mesh=to_mesh_frame(poses[0], obj.centred_from_mesh),
            timings_ms=timings,
            cam_from_centred=poses[0],
            validity=judgement_of_row(judged[0]),
        )

    def forget_object(self, obj: ObjectModel) -> int:
        """Drop this estimator's captured steps of ``obj`` (graphs and static buffers); returns how many."""
        return self._track_runner.forget(obj) + self._register_runner.forget(obj)

    # -- helpers ----------------------------------------------------------------------------

    def hypotheses(self, frame: PreparedFrame, mask: Tensor, symmetry_tfs: np.ndarray | None = None) -> Tensor:
        """(N, 4, 4) float32 cam_from_centred: grid rotations with the guessed translation (spec §1.2 step 4).

        mask: (H, W) bool on the frame's device. No host synchronisation.
        """
        key = _symmetry_key(symmetry_tfs)
        grid = self._device_grids.get(key)
        if grid is None:  # uploaded once per symmetry set (a synchronous copy: safe for every stream after)
            grid = self._device_grids[key] = torch.as_tensor(self.rotation_grid(symmetry_tfs), device=self.device)
        t0 = guess_translation(frame.depth, mask, frame.K, constants=self.constants)
        poses = grid.clone()
        poses[:, :3, 3] = t0.to(poses.dtype)
        return poses

    @contextmanager
    def _stage(self, name: str, timings: dict[str, float], **extra) -> Iterator[None]:
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None  # gpu_ms per stage
        with timed(name, sink=self.recorder, stream=stream, **extra) as t:
            yield
            if self.device.type == "cuda":  # the synchronous path reports synchronised stage times
                torch.cuda.synchronize(self.device)
        timings[name] = t.record.wall_ms if t.record is not None else 0.0


TRACK_MAX_BATCH = 16  # the service's default track batch (ServiceConfig.track_max_batch)


def runtime_with(runtime: RuntimeConfig | None, **shortcuts: object) -> RuntimeConfig:
    """``runtime`` (default :class:`RuntimeConfig`) with the shortcuts that were given (not None) applied; a
    shortcut that disagrees with an explicitly given ``runtime`` raises ValueError naming both values."""
    given = {name: value for name, value in shortcuts.items() if value is not None}
    if runtime is None:
        return RuntimeConfig(**{k: (str(v) if k == "device" else v) for k, v in given.items()})
    for name, value in given.items():
        have = getattr(runtime, name)
        same = str(value) == str(have) if name in ("device", "weights") else value == have
        if not same:
            raise ValueError(f"{name}={value!r} disagrees with runtime.{name}={have!r}: pass it in one place")
    return runtime


def _symmetry_key(symmetry_tfs: np.ndarray | None) -> bytes:
    """Cache key of a symmetry set (the grid depends on it, spec §2.1)."""
    return b"" if symmetry_tfs is None else np.ascontiguousarray(symmetry_tfs, dtype=np.float64).tobytes()


def start_cam_from_centred(request: validate.TrackRequest, obj: ObjectModel) -> np.ndarray:
    """The float32 (4, 4) cam_from_centred a track step starts from (the request's pose in the centred frame)."""
    if request.prev_frame == "centred":
        return request.prev_pose.astype(np.float32)
    return to_centred_frame(request.prev_pose, obj.mesh_from_centred)


class Tracker:
    """One object's tracking session in Python: the last pose, and the session's trust
    (:class:`~foundationpose.session_trust.SessionTrust`: the state, tracking / uncertain / lost / recovering,
    driven by each result's validity; automatic recovery; the pose shown for a symmetric object).

    estimator: a :class:`PoseEstimator` or a :class:`foundationpose.service.PoseService` (the same calls).
    While the session is LOST, :meth:`track` re-registers by itself on candidate masks found in the depth
    (:func:`foundationpose.recovery.recovery_candidates`: around the last valid pose first, widening with the
    frames since, then whole-image clusters of the object's size), one candidate per frame; ``recovery=None``
    turns that off. Every result carries ``session`` (a :class:`~foundationpose.session_state.SessionReport`): a
    LOST or RECOVERING session never reports ``pose_valid``. A symmetric object (``obj.symmetry``): registers
    search the reduced grid, and each result's ``cam_from_mesh`` is the member of the pose's symmetry class
    nearest the previous answer, so a symmetric flip never shows as a jump (``cam_from_centred`` stays the
    tracking state).
    """

    def __init__(self, estimator: Any, obj: ObjectModel, *, config: SessionConfig | None = None,
                 recovery: RecoveryConfig | None = DEFAULT_RECOVERY) -> None:
        self.estimator = estimator
        self.obj = obj
        self.trust = SessionTrust(obj, config=config, recovery=recovery)
        self.cam_from_centred: np.ndarray | None = None  # float32 tracking state, as the reference keeps it

    @property
    def state(self) -> SessionState:
        return self.trust.state

    @property
    def cam_from_mesh(self) -> np.ndarray | None:
        """Last cam_from_mesh pose (canonical under the symmetries), or None before the first register."""
        return None if self.trust.shown is None else self.trust.cam_from_mesh(self.trust.shown)

    def register(self, rgb, depth, mask, K, *, iterations: int | None = None) -> RegisterResult:
        """Register on the client's mask (the session then trusts a valid result at once)."""
        result = self.estimator.register(self.obj, rgb, depth, mask, K, iterations=iterations)
        return self._answered(result, CLIENT_REGISTER)

    def track(self, rgb, depth, K, *, iterations: int | None = None, mask=None) -> TrackResult:
        """Next frame: a track step from the last pose, or, while the session is LOST, a register on a recovery
        candidate (answered as a TrackResult); the frame's steps are :mod:`foundationpose.session_step`'s. mask: the
        client's mask of this frame, which forces a register."""
        if mask is not None:
            return self._as_track(self.register(rgb, depth, mask, K, iterations=iterations))
        plan = plan_frame(self.trust)
        if plan is not None:
            recovered = self._recover(plan, rgb, depth, K, iterations)
            if recovered is not None:
                return recovered
        if self.cam_from_centred is None:
            raise RuntimeError("Tracker.track called before a successful register (and no recovery candidate)")
        result = self.estimator.track(
            self.obj, rgb, depth, K, self.cam_from_centred, prev_frame="centred", iterations=iterations
        )
        return self._answered(result, TRACK)

    def _recover(self, plan: RecoveryPlan, rgb, depth, K, iterations: int | None) -> TrackResult | None:
        """The frame registered on the plan's candidate; None: track it instead (no candidate in the depth, or too
        little depth under it)."""
        depth_m = validate.validate_depth(depth)
        attempt = recovery_register(plan, depth_m, K, self.obj.diameter)
        if attempt is None:
            return None
        try:
            result = self.estimator.register(self.obj, rgb, depth_m, attempt.mask, K, iterations=iterations)
        except InputError:
            return None
        return self._as_track(self._answered(result, attempt.source))

    def _answered(self, result, source: str):
        """``result`` as the session answers it (its pose the one shown); its tracking state becomes the session's."""
        answered = answer(self.trust, result, source)
        self.cam_from_centred = result.cam_from_centred
        return dataclasses.replace(result, session=answered.report, cam_from_mesh=answered.cam_from_mesh)

    @staticmethod
    def _as_track(result: RegisterResult) -> TrackResult:
        return TrackResult(cam_from_mesh=result.cam_from_mesh, timings_ms=result.timings_ms,
                           cam_from_centred=result.cam_from_centred, validity=result.validity,
                           session=result.session)
