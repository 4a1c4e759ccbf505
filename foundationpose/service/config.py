"""The service's sizing and its statistics: plain values, shared by the service and its lanes."""

from __future__ import annotations

from dataclasses import dataclass

from deploy_core.batching import BatcherStats
from deploy_core.memory import PoolStats
from deploy_core.pipeline import PipelineStats
from foundationpose.track_graph import graph_batch_sizes

__all__ = ["ServiceConfig", "ServiceStats"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceConfig:
    """Sizing of the two lanes.

    frames_in_flight: register frames in the lane at once.
    track_batches_in_flight: track batches in the lane at once.
    track_max_batch: most track requests (sessions) merged into one step.
    track_max_wait_ms: how long the first track request of a batch waits for company, only while another batch
        is in flight (a request into an idle lane never waits; one submitted with ``inline_if_idle`` runs in its
        caller's thread).
    track_max_graphs: captured track steps kept, one per (object, image size, padded batch size, iterations); the
        least recently used is dropped beyond it (and captured again when needed). One (object, image size) takes
        one per padded batch size (:func:`foundationpose.track_graph.graph_batch_sizes`: 10 at a max batch of 16).
    max_image_hw: the largest (H, W) accepted (memory follows the frames actually sent).
    queue_capacity: packages waiting in front of each stage.
    pending_requests: track requests that may wait for a batch before submit blocks.
    """

    frames_in_flight: int = 2
    track_batches_in_flight: int = 3
    track_max_batch: int = 16
    track_max_wait_ms: float = 1.0
    track_max_graphs: int = 128
    max_image_hw: tuple[int, int] = (1080, 1920)
    queue_capacity: int = 2
    pending_requests: int = 256

    def __post_init__(self) -> None:
        for name in ("frames_in_flight", "track_batches_in_flight", "track_max_batch", "queue_capacity",
                     "track_max_graphs", "pending_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        sizes = graph_batch_sizes(self.track_max_batch)
        if self.track_max_graphs < len(sizes):
            raise ValueError(f"track_max_graphs must hold the {len(sizes)} batch sizes {sizes} of one (object, image "
                             f"size) at track_max_batch={self.track_max_batch}; got {self.track_max_graphs}")
        if self.track_max_wait_ms < 0:
            raise ValueError(f"track_max_wait_ms must be >= 0, got {self.track_max_wait_ms}")
        h, w = self.max_image_hw
        if h < 2 or w < 2:
            raise ValueError(f"max_image_hw must be at least (2, 2) (H, W), got {self.max_image_hw}")


@dataclass(frozen=True, slots=True)
class ServiceStats:
    """A snapshot of both lanes: each pipeline's stage stats, each lane's slots, the track batcher, the steps."""

    register: PipelineStats
    track: PipelineStats
    register_pool: PoolStats
    track_pool: PoolStats
    track_batcher: BatcherStats
    track_inline: int = 0  # track requests run in their caller's thread (the lane was idle)
    track_captures: int = 0  # track steps captured as CUDA graphs so far
    track_capture_failures: int = 0  # track captures that failed (those steps run eagerly meanwhile; the log has why)
    track_graphs: int = 0  # track steps (captured or eager entries) the lane holds now
    register_captures: int = 0  # register steps captured as CUDA graphs so far
    register_capture_failures: int = 0  # captures that failed (those registers run eagerly; the log has why)
    track_driver_launches: int = 0  # track batches submitted by CUDA driver calls
    track_rows_requested: int = 0  # frames the track steps took
    track_rows_padding: int = 0  # rows those steps computed beyond them (padded batch sizes)
