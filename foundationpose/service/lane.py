"""What the register and track lanes of :class:`~foundationpose.service.PoseService` share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from deploy_core.cuda import new_stream
from deploy_core.memory import MemBufferPool
from deploy_core.pipeline import BaseAsyncPipeline
from foundationpose.coordinate_frames import to_mesh_frame
from foundationpose.errors import NonFinitePoseError
from foundationpose.estimator import TrackResult
from foundationpose.render import Renderer, make_renderer
from foundationpose.service.config import ServiceConfig
from foundationpose.validity import judgement_of_row

if TYPE_CHECKING:
    from foundationpose.estimator import PoseEstimator

__all__ = ["Lane", "LaneContext", "job_track_result", "track_result"]


@dataclass(frozen=True, slots=True)
class Lane:
    """One pipeline with the pool that bounds its packages in flight (built completely by its lane builder).

    inline: runs one job in the caller's thread, the lane's step without its threads, returning the job's result or
        the exception that failed it (None: the lane has no such path). Safe beside the pipeline's own packages.
    host_images: ``(rgb, depth) -> (rgb, depth)``, the job's images as the host tensors the lane copies from, made in
        the caller's thread (None: the lane takes the arrays as they are).
    """

    pipeline: BaseAsyncPipeline
    pool: MemBufferPool
    inline: Callable[[Any], Any] | None = None
    host_images: Callable[[Any, Any], tuple[Any, Any]] | None = None


@dataclass(slots=True)
class LaneContext:
    """The estimator (networks, renderer settings, algorithm config) and sizing a lane is built from."""

    estimator: PoseEstimator
    config: ServiceConfig

    @property
    def device(self) -> torch.device:
        return self.estimator.device

    def stream_factory(self) -> Callable[[], Any] | None:
        """Per-stage CUDA streams (None on CPU: one code path)."""
        if self.device.type != "cuda":
            return None
        return lambda: new_stream(self.device)

    def new_renderer(self) -> Renderer:
        """A renderer of the lane's own on CUDA (backends keep per-call workspaces, not shareable between threads);
        on the CPU the estimator's renderer (stateless between calls). A renderer with a ``spawn()`` method (e.g.
        one wrapping another) makes its own siblings."""
        base = self.estimator.renderer
        if self.device.type != "cuda":
            return base
        spawn = getattr(base, "spawn", None)
        return spawn() if spawn is not None else make_renderer(base.name, self.device, base.config)


def track_result(
    item: Any, pkg: Any, cam_from_centred: np.ndarray, judged: np.ndarray, timings: dict[str, float]
) -> TrackResult | NonFinitePoseError:
    """The answer of one track request of a finished batch: its TrackResult, or a NonFinitePoseError when its
    refined (4, 4) pose has NaN or inf entries (that request only: the batch's others get their poses).

    item: the request's ``BatchItem`` (``data`` = its job, ``key``, ``submitted_ns``); pkg: the batch's package.
    """
    # in the micro-batcher (and waiting for a slot) before the batch became a package
    batcher_wait = max(0.0, (pkg.submitted_ns - item.submitted_ns) / 1e6)
    return job_track_result(item.data.obj, cam_from_centred, judged, dict(timings, batch=float(len(pkg.data)),
                                                                           batcher_wait=batcher_wait), key=item.key)


def job_track_result(
    obj: Any, cam_from_centred: np.ndarray, judged: np.ndarray, timings_ms: dict[str, float], *, key: Any = None
) -> TrackResult | NonFinitePoseError:
    """A TrackResult of ``obj`` (an ObjectModel) from its refined (4, 4) centred pose and its judged row, or a
    NonFinitePoseError when that pose has NaN or inf entries (``key`` names the request in the message)."""
    if not np.isfinite(cam_from_centred).all():
        return NonFinitePoseError(
            f"the refined pose has {int((~np.isfinite(cam_from_centred)).sum())} NaN or inf entries "
            f"(request key={key!r}); the previous pose, K or frame is degenerate"
        )
    return TrackResult(
        cam_from_mesh=to_mesh_frame(cam_from_centred, obj.centred_from_mesh),
        timings_ms=timings_ms,
        cam_from_centred=cam_from_centred,
        validity=judgement_of_row(judged),
    )
