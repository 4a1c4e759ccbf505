"""Concurrent track sessions against one :class:`~foundationpose.service.PoseService`, run three ways.

Each session tracks ``frames`` frames, one at a time: submit, wait for the pose, submit the next frame from it (a
robot's camera loop). The frames come from a sequence of distinct images: session ``i`` sends image ``(i + t) mod
len(sequence)`` at its step ``t``, so sessions never all read one image (which a host cache would keep warm). What
differs is how the caller waits:

* ``threads``: one thread per session blocks on its future (``submit_track(...).result()``), the simple way in.
  Into an idle lane a request runs inline (``inline_if_idle``), as the server's worker threads do.
* ``asyncio``: every session is a coroutine of one event loop (``await asyncio.wrap_future(...)``), as the HTTP
  service runs its clients. The loop's thread validates and stages each frame; nothing runs inline (that would
  stall the loop's other sessions for a whole step).
* ``asyncio-pool``: the same coroutines, each frame's submit (validation, the staging copy) in a pool of
  ``SUBMIT_THREADS`` threads, as the server's routes do: the copies run in parallel (NumPy lets the GIL go for
  them) instead of one after another in the loop's thread, at the price of a thread hop per frame.

With many sessions threads and coroutines load the host very differently: 64 threads that each wake, validate, stage and
submit contend for the GIL (every release around a copy or a wait is a retake behind 63 others), while one loop
thread does the same work in turn and hands the lane whole bursts. ``python -m foundationpose.bench`` reports them
side by side.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["SESSION_MODELS", "SessionRun", "run_sessions"]

SESSION_MODELS = ("threads", "asyncio", "asyncio-pool")
SUBMIT_THREADS = 4
_PARTS = ("submit", "batcher_wait", "step", "finish")  # an inline track has no batcher wait or finish


@dataclass(slots=True)
class SessionRun:
    """What one run of ``sessions`` x ``frames`` tracks measured.

    latencies_ms: submit -> pose of every answered frame; parts_ms: per frame, where its latency went (the
    result's stage timings plus ``submit``, the caller's validation and staging, and ``other``: queues, the GPU
    wait, hand-offs, the caller's wake-up); poses: each session's last pose (None if it failed)."""

    model: str
    sessions: int
    elapsed_s: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    parts_ms: dict[str, list[float]] = field(default_factory=dict)
    errors: list[BaseException] = field(default_factory=list)
    poses: list[np.ndarray | None] = field(default_factory=list)

    def add(self, local: Sequence[tuple[float, dict[str, float]]]) -> None:
        for ms, timings in local:
            self.latencies_ms.append(ms)
            for name in _PARTS:
                self.parts_ms.setdefault(name, []).append(float(timings.get(name, 0.0)))
            accounted = sum(float(timings.get(n, 0.0)) for n in _PARTS)
            self.parts_ms.setdefault("other", []).append(ms - accounted)

    def parts_mean_ms(self) -> dict[str, float]:
        return {k: round(float(np.mean(v)), 3) for k, v in sorted(self.parts_ms.items())}


Sequence_ = Sequence[tuple[np.ndarray, np.ndarray]]


def run_sessions(service: Any, obj: Any, sequence: Sequence_, K: np.ndarray, pose: np.ndarray, *,
                 sessions: int, frames: int, model: str = "threads") -> SessionRun:
    """Run ``sessions`` concurrent sessions of ``frames`` tracks each (session i submits with ``key=i``), every one
    starting from ``pose``; returns their latencies and errors (a failed session stops, the others go on).
    sequence: the (rgb (H, W, 3) uint8, depth (H, W) float32 metres) images the sessions send (see above)."""
    if model not in SESSION_MODELS:
        raise ValueError(f"model must be one of {SESSION_MODELS}, got {model!r}")
    if sessions < 1 or frames < 1:
        raise ValueError(f"sessions and frames must be >= 1, got {sessions} and {frames}")
    if not sequence:
        raise ValueError("sequence: expected at least one (rgb, depth) image pair; got none")
    run = SessionRun(model, sessions, poses=[None] * sessions)
    t0 = time.perf_counter()
    if model == "threads":
        _run_threads(service, obj, sequence, K, pose, frames, run)
    else:
        asyncio.run(_run_coroutines(service, obj, sequence, K, pose, frames, run))
    run.elapsed_s = time.perf_counter() - t0
    return run


def _timings(result: Any, submit_ms: float, inline: bool) -> dict[str, float]:
    if inline:  # the step ran inside submit: count it once, as the step
        submit_ms = max(0.0, submit_ms - float(result.timings_ms.get("step", 0.0)))
    return dict(result.timings_ms, submit=submit_ms)


def _run_threads(service, obj, sequence: Sequence_, K, pose, frames: int, run: SessionRun) -> None:
    lock = threading.Lock()

    def session(i: int) -> None:
        prev, local = pose, []
        try:
            for t in range(frames):
                rgb, depth = sequence[(i + t) % len(sequence)]
                t0 = time.perf_counter()
                future = service.submit_track(obj, rgb, depth, K, prev, key=i, inline_if_idle=True)
                submit_ms = (time.perf_counter() - t0) * 1e3
                inline = future.done()
                result = future.result()
                local.append(((time.perf_counter() - t0) * 1e3, _timings(result, submit_ms, inline)))
                prev = result.cam_from_mesh
            run.poses[i] = prev
        except BaseException as exc:  # noqa: BLE001 - reported by the caller, not swallowed
            with lock:
                run.errors.append(exc)
        with lock:
            run.add(local)

    threads = [threading.Thread(target=session, args=(i,), name=f"session-{i}") for i in range(run.sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


async def _run_coroutines(service, obj, sequence: Sequence_, K, pose, frames: int, run: SessionRun) -> None:
    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(SUBMIT_THREADS, "fp-bench-submit") if run.model == "asyncio-pool" else None

    async def session(i: int) -> None:
        prev, local = pose, []
        try:
            for t in range(frames):
                rgb, depth = sequence[(i + t) % len(sequence)]
                t0 = time.perf_counter()
                if pool is None:
                    future = service.submit_track(obj, rgb, depth, K, prev, key=i)
                else:  # the hop there and back is part of this frame's submit
                    future = await loop.run_in_executor(
                        pool, functools.partial(service.submit_track, obj, rgb, depth, K, prev, key=i))
                submit_ms = (time.perf_counter() - t0) * 1e3
                result = await asyncio.wrap_future(future)
                local.append(((time.perf_counter() - t0) * 1e3, _timings(result, submit_ms, False)))
                prev = result.cam_from_mesh
            run.poses[i] = prev
        except Exception as exc:  # noqa: BLE001 - reported by the caller, not swallowed
            run.errors.append(exc)
        run.add(local)

    try:
        await asyncio.gather(*(session(i) for i in range(run.sessions)))
    finally:
        if pool is not None:
            pool.shutdown()
