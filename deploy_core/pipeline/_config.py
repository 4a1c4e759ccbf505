"""Value objects of the pipeline: Stage, PipelineConfig, StageStats, PipelineStats."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deploy_core.pipeline._package import Package

__all__ = ["PipelineConfig", "PipelineStats", "Stage", "StageStats", "annotate_failure"]


@dataclass(frozen=True, slots=True)
class Stage:
    """One named step of a pipeline: ``fn(pkg)`` mutates ``pkg.data`` (or the lease buffers).

    name: unique within the pipeline; threads are named ``fp-<name>`` (``fp-<name>-<i>``
        when ``workers > 1``); appears in timing lines, stats and failure notes.
    fn: ``fn(pkg: Package) -> None``. Raise to fail this package only. A stage may also
        complete the package itself (``pkg.finish(...)``, e.g. to drop a stale frame):
        later stages then skip it.
    workers: threads serving this stage (default 1). With more than one, packages are
        processed concurrently but leave the stage in the order they entered it, so
        per-key (indeed global) order is kept. Useful for CPU work that releases the GIL.
    queue_capacity: capacity of this stage's input queue; None means
        ``PipelineConfig.queue_capacity``.
    setup / teardown: called once in each of the stage's threads before the first and
        after the last package (e.g. create per-thread state). The synchronous path
        (``run``) calls ``setup`` once, on first use, in the caller's thread.
    stream_factory: called once per stage thread (after ``setup``); returns a
        ``torch.cuda.Stream`` or None (CPU). With a stream the pipeline, around ``fn``:
        makes it current, makes it wait on ``pkg.ready_event`` (the previous GPU
        stage's hand-off), times ``fn`` with CUDA events on it, and afterwards records a
        new ``pkg.ready_event`` on it. A CPU stage that reads a GPU stage's output must
        ``pkg.ready_event.synchronize()`` itself; the pipeline synchronises it once
        before completing the future. The synchronous path ignores streams (it runs on
        the caller's current stream).
    in_submitter: the first stage only: ``fn`` runs in the thread that calls ``submit``, right after the package
        got its lease, instead of in a thread of its own; the package then goes to the second stage's queue (that
        put blocks while it is full, whatever ``submit``'s timeout). It saves one thread hand-off per package where
        the submitter is one thread that batches (a MicroBatcher) and ``fn`` is short. ``fn`` must be safe to call
        from several submitting threads at once; no setup, teardown or stream factory (they are per stage thread).
    """

    name: str
    fn: Callable[[Package], None]
    workers: int = 1
    queue_capacity: int | None = None
    setup: Callable[[], None] | None = None
    teardown: Callable[[], None] | None = None
    stream_factory: Callable[[], Any] | None = None
    in_submitter: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or any(c.isspace() for c in self.name):
            raise ValueError(f"Stage name must be a non-empty string without spaces, got {self.name!r}")
        if not callable(self.fn):
            raise TypeError(f"Stage {self.name!r}: fn must be callable, got {type(self.fn).__name__}")
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"Stage {self.name!r}: workers must be an int >= 1, got {self.workers!r}")
        if self.queue_capacity is not None and (not isinstance(self.queue_capacity, int) or self.queue_capacity < 1):
            raise ValueError(f"Stage {self.name!r}: queue_capacity must be an int >= 1 or None, "
                             f"got {self.queue_capacity!r}")
        if self.in_submitter and (self.setup is not None or self.teardown is not None
                                  or self.stream_factory is not None or self.workers != 1):
            raise ValueError(f"Stage {self.name!r}: an in_submitter stage has no threads of its own: no setup, "
                             "teardown or stream_factory, and workers=1")


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineConfig:
    """Settings of a :class:`BaseAsyncPipeline` (design.md principle 3; reference 14.1).

    queue_capacity: packages waiting in front of each stage; small keeps latency low.
        Frames in flight are bounded by the pool (admission), not by queue depth.
    join_timeout_s: how long ``start`` waits for stage setup and ``close`` for threads.
    stats_window: samples kept per stage for the p50/p90 in ``stats()`` and the summary.
    log_summary: log the per-stage timing table on ``deploy_core.timing`` at close.
    """

    queue_capacity: int = 2
    join_timeout_s: float = 30.0
    stats_window: int = 10_000
    log_summary: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.queue_capacity, int) or self.queue_capacity < 1:
            raise ValueError(f"queue_capacity must be an int >= 1, got {self.queue_capacity!r}")
        if not self.join_timeout_s > 0:
            raise ValueError(f"join_timeout_s must be a float > 0, got {self.join_timeout_s!r}")
        if not isinstance(self.stats_window, int) or self.stats_window < 1:
            raise ValueError(f"stats_window must be an int >= 1, got {self.stats_window!r}")


@dataclass(frozen=True, slots=True)
class StageStats:
    """Run-time statistics of one stage (times in milliseconds).

    count: stage calls (async and sync paths together); errors: calls that raised;
    busy_ms_total: wall time spent inside ``fn``; percentiles are over the last
    ``PipelineConfig.stats_window`` calls (0.0 before the first call); gpu_p50_ms is None
    for stages without GPU timing; queue_depth/queue_capacity describe the input queue.
    """

    name: str
    workers: int
    count: int
    errors: int
    busy_ms_total: float
    queue_wait_p50_ms: float
    queue_wait_p90_ms: float
    wall_p50_ms: float
    wall_p90_ms: float
    gpu_p50_ms: float | None
    queue_depth: int
    queue_capacity: int


@dataclass(frozen=True, slots=True)
class PipelineStats:
    """A snapshot of a pipeline: lifecycle state, package counts and per-stage stats.

    state: "new", "running", "closing", "closed" or "broken".
    submitted: packages admitted by ``submit`` so far; in_flight: admitted, not completed.
    """

    name: str
    state: str
    submitted: int
    in_flight: int
    stages: tuple[StageStats, ...]

    def stage(self, name: str) -> StageStats:
        """The stats of the stage called ``name`` (KeyError if there is none)."""
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"no stage {name!r}; stages are {[s.name for s in self.stages]}")


def annotate_failure(exc: BaseException, pipeline: str, stage: str, pkg: Package) -> None:
    """Mark ``exc`` with where it happened: a note and ``pipeline_stage``/``pipeline_package_id``."""
    note = f"pipeline={pipeline} stage={stage} package_id={pkg.package_id}"
    if pkg.key is not None:
        note += f" key={pkg.key}"
    exc.add_note(note)
    try:
        exc.pipeline_stage = stage  # type: ignore[attr-defined]
        exc.pipeline_package_id = pkg.package_id  # type: ignore[attr-defined]
    except AttributeError:  # an exception type that refuses attributes: the note still says it
        pass
