"""The pipelined fast path: register and track lanes on ``BaseAsyncPipeline``.

Register lane (one package = one frame, ``frames_in_flight`` at once, bounded by the pool)::

    upload -> hypotheses -> (render_i -> refine_i) x iterations -> score_render -> score_net -> select

Track lane (one package = a batch of frames of different sessions, collected by a
:class:`~deploy_core.batching.MicroBatcher` for at most ``track_max_wait_ms``)::

    upload -> (render_i -> refine_i) x iterations -> finish

Every GPU stage runs on its own CUDA stream; hand-offs are CUDA events recorded by the
pipeline (``pkg.ready_event``), so the host synchronises once per package, in the last
stage, where it reads the answer. Track has its own lane, so it never queues behind a
register. The stages call the same functions as the synchronous reference path
(:mod:`foundationpose.estimator`), so both return the same poses.

Memory: each in-flight package leases a slot of a :class:`MemBufferPool` holding, at their
maximum shapes, the pinned host staging images, the device images (and mask) and both network
inputs, which the render stages write in place. Poses, network outputs and the intermediate
tensors of the filters, renderer and warps come from PyTorch's caching allocator: the first
frames fill it (the server runs a warm-up frame at start), later frames reuse its blocks.
Replaced tensors that another stage's stream read are kept until their package completes
(:func:`foundationpose.service.lane.retire`).

The lanes themselves are built in :mod:`foundationpose.service.register_lane` and
:mod:`foundationpose.service.track_lane`.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from deploy_core.batching import MicroBatcher
from foundationpose import validate
from foundationpose.service.lane import LaneContext
from foundationpose.errors import InputError
from foundationpose.coordinate_frames import to_centred_frame
from foundationpose.estimator import (
    PoseEstimator,
    RegisterResult,
    TrackResult,
)
from foundationpose.mesh import ObjectModel
from foundationpose.service.register_lane import RegisterJob, build_register_lane
from foundationpose.service.track_lane import TrackJob, build_track_lane

__all__ = ["PoseService", "ServiceConfig"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceConfig:
    """Sizing of the two lanes.

    frames_in_flight: register frames in the pipeline at once (= register pool slots).
    track_batches_in_flight: track batches in the pipeline at once (= track pool slots).
    track_max_batch: most track requests (sessions) merged into one refiner call.
    track_max_wait_ms: how long the first track request of a batch waits for company.
    max_image_hw: largest (H, W) accepted; the pool's image buffers have this size.
    queue_capacity: packages waiting in front of each stage.
    pending_requests: track requests that may wait for a batch before submit blocks.
    """

    frames_in_flight: int = 2
    track_batches_in_flight: int = 3
    track_max_batch: int = 16
    track_max_wait_ms: float = 1.0
    max_image_hw: tuple[int, int] = (1080, 1920)
    queue_capacity: int = 2
    pending_requests: int = 256

    def __post_init__(self) -> None:
        for name in ("frames_in_flight", "track_batches_in_flight", "track_max_batch", "queue_capacity"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.track_max_wait_ms < 0:
            raise ValueError(f"track_max_wait_ms must be >= 0, got {self.track_max_wait_ms}")


class PoseService:
    """Pipelined register/track over a :class:`PoseEstimator`'s networks and settings.

    ``submit_register`` / ``submit_track`` return ``concurrent.futures.Future`` objects
    (bridge to asyncio with ``asyncio.wrap_future``). With ``timeout`` they raise
    :class:`~deploy_core.errors.BusyError` instead of blocking when the lane is full; after
    :meth:`close` they raise :class:`~deploy_core.errors.ClosedError`.
    """

    def __init__(self, estimator: PoseEstimator, config: ServiceConfig = ServiceConfig()) -> None:
        self.estimator = estimator
        self.config = config
        self.device = estimator.device
        self._lanes = LaneContext(estimator, config)
        self._register = build_register_lane(self._lanes)
        self._track = build_track_lane(self._lanes)
        # Create every render stage's renderer now (an nvdiffrast context each), not on a first request.
        for lane in (self._register, self._track):
            for stage in lane.pipeline.stages:
                if stage.name.startswith(("render_", "score_render")):
                    self._lanes.renderer_for(lane, stage.name)
        self._batcher = MicroBatcher(
            self._track.pipeline,
            max_batch=config.track_max_batch,
            max_wait_s=config.track_max_wait_ms / 1e3,
            capacity=config.pending_requests,
            name="track-batcher",
        )

    # -- public API -------------------------------------------------------------------------

    def submit_register(
        self,
        obj: ObjectModel,
        rgb: np.ndarray,
        depth: np.ndarray,
        mask: np.ndarray,
        K: np.ndarray,
        *,
        symmetry_tfs: np.ndarray | None = None,
        timeout: float | None = None,
    ) -> Future[RegisterResult]:
        """Queue a register (see :meth:`PoseEstimator.register`; inputs are validated here)."""
        rgb, depth, K = self._validated(rgb, depth, K)
        mask = validate.validate_mask(mask, depth.shape)
        job = RegisterJob(obj, rgb, depth, mask, K, symmetry_tfs)
        return self._register.pipeline.submit(job, timeout=timeout)

    def submit_track(
        self,
        obj: ObjectModel,
        rgb: np.ndarray,
        depth: np.ndarray,
        K: np.ndarray,
        prev_pose: np.ndarray,
        *,
        key: Any = None,
        prev_frame: str = "mesh",
        timeout: float | None = None,
    ) -> Future[TrackResult]:
        """Queue a track step (see :meth:`PoseEstimator.track`); batched with other sessions."""
        rgb, depth, K = self._validated(rgb, depth, K)
        prev = validate.validate_pose(prev_pose)
        if prev_frame not in ("mesh", "centred"):
            raise ValueError(f"prev_frame must be 'mesh' or 'centred'; got {prev_frame!r}")
        start = prev.astype(np.float32) if prev_frame == "centred" else to_centred_frame(prev, obj.mesh_from_centred)
        return self._batcher.submit(TrackJob(obj, rgb, depth, K, start), key=key, timeout=timeout)

    def register(self, *args, **kwargs) -> RegisterResult:
        return self.submit_register(*args, **kwargs).result()

    def track(self, *args, **kwargs) -> TrackResult:
        return self.submit_track(*args, **kwargs).result()

    def stats(self) -> dict[str, Any]:
        return {
            "register": self._register.pipeline.stats(),
            "track": self._track.pipeline.stats(),
            "register_pool_leased": self._register.pool.leased,
            "track_pool_leased": self._track.pool.leased,
            "track_waiting": self._batcher.waiting,
            "track_batches": self._batcher.batches,
            "track_items": self._batcher.items,
        }

    def timing_summary(self) -> str:
        return "\n".join(
            lane.pipeline.recorder.format_table() for lane in (self._register, self._track)
        )

    def close(self, abort: bool = False) -> None:
        self._batcher.close(abort=abort)
        self._track.pipeline.close(abort=abort)
        self._register.pipeline.close(abort=abort)
        self._track.pool.close()
        self._register.pool.close()

    def __enter__(self) -> PoseService:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close(abort=exc_info[0] is not None)

    # -- shared helpers ---------------------------------------------------------------------

    def _validated(self, rgb, depth, K):
        rgb, depth, K = validate.validate_frame(rgb, depth, K)
        h, w = depth.shape
        max_h, max_w = self.config.max_image_hw
        if h > max_h or w > max_w:
            raise InputError("rgb", f"an image of at most {max_h}x{max_w} pixels", f"{h}x{w}")
        return rgb, depth, K


