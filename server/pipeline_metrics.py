"""The Prometheus families a single-process server reports at scrape time: its own gauges
(:func:`server_families`) and those of its :class:`~foundationpose.service.PoseService`'s lanes
(:func:`pipeline_families`)."""

from __future__ import annotations

from typing import Any

import torch

from foundationpose.service import ServiceStats
from server.metrics import Family

__all__ = ["pipeline_families", "server_families"]


def _warmup_family(paths_ms: dict[str, float]) -> Family:
    fam = Family("fp_warmup_seconds", "gauge", "Start-up's warm-up: each step (pipeline, objects, requests) and the "
                 "first request of each path it ran (ingest_*: the slowest ingest worker's), once done.")
    for path, ms in paths_ms.items():
        fam.add(ms / 1e3, path=path)
    return fam


def server_families(state: Any) -> list[Family]:
    """The gauges of a :class:`~server.state.ServerState`: readiness, sessions, objects, admission, streams, the
    ingest workers, the garbage collector, the event loop, pipeline stages, pools, GPU memory."""
    fams = [
        Family("fp_ready", "gauge", "1 when networks are loaded and warm-up is done.").add(state.phase == "ready"),
        _warmup_family(state.warmup_paths_ms),
        *state.sessions.families(),
        Family("fp_objects_loaded", "gauge", "Registered objects.").add(len(state.objects or ())),
        Family("fp_track_admitted", "gauge", "Track requests admitted now (running + waiting).")
        .add(state.admission.admitted),
        Family("fp_track_admission_capacity", "gauge", "Track requests that may be admitted at once.")
        .add(state.admission.capacity),
        Family("fp_service_time_seconds", "gauge", "Recent measured submit-to-result time of a lane "
               "(the Retry-After estimates).").add(state.service_times.ms("register") / 1e3, lane="register")
        .add(state.service_times.ms("track") / 1e3, lane="track"),
        *state.streams.families(),
        *(state.ingest.families() if state.ingest is not None else ()),
        *state.gc_pauses.families(),
        *(state.loop_watch.families() if state.loop_watch is not None else ()),
    ]
    if state.ingest_workers is not None:
        fams.append(Family("fp_ingest_worker_restarts_total", "counter",
                           "Ingest worker processes started again after they exited.")
                    .add(state.ingest_workers.restarts))
        connections = Family("fp_ingest_worker_connections", "gauge",
                             "Open connections per ingest worker slot, as the GPU process hands them "
                             "out (each worker reports its closed ones).")
        dispatcher = state.ingest_workers.dispatcher
        for slot, load in (dispatcher.loads() if dispatcher is not None else {}).items():
            connections.add(load, worker=str(slot))
        fams.append(connections)
        fams.append(Family("fp_ingest_connections_served_here_total", "counter",
                           "Connections the GPU process served itself because no ingest worker could take them "
                           "(every worker given up, or every worker's channel full).")
                    .add(dispatcher.served_here if dispatcher is not None else 0))
    fams.append(Family("fp_track_prepares_total", "counter",
                       "Track step preparations (per object and image size, in the background) that finished.")
                .add(state.track_preparer.ok, outcome="ok").add(state.track_preparer.failed, outcome="failed"))
    if state.estimator is not None:
        fams.append(Family("fp_random_weights", "gauge", "1 when running on random weights (poses meaningless).")
                    .add(bool(getattr(state.estimator.networks, "random_weights", False))))
    if state.service is not None:
        fams += pipeline_families(state.service.stats())
    if state.estimator is not None and state.estimator.device.type == "cuda":
        dev = state.estimator.device
        fams.append(Family("fp_gpu_memory_allocated_bytes", "gauge", "CUDA memory held by tensors.")
                    .add(torch.cuda.memory_allocated(dev), device=str(dev)))
        fams.append(Family("fp_gpu_memory_reserved_bytes", "gauge", "CUDA memory reserved by the caching "
                           "allocator.").add(torch.cuda.memory_reserved(dev), device=str(dev)))
    return fams


def pipeline_families(stats: ServiceStats) -> list[Family]:
    calls = Family("fp_pipeline_stage_calls_total", "counter", "Packages processed by each pipeline stage.")
    errors = Family("fp_pipeline_stage_errors_total", "counter", "Stage calls that raised.")
    wall = Family("fp_pipeline_stage_seconds", "summary",
                  "Stage wall time: recent p50/p90 (quantile), total busy time (_sum) and calls (_count).")
    wait = Family("fp_pipeline_stage_queue_wait_seconds", "gauge", "Recent queue wait in front of a stage, by quantile.")
    gpu = Family("fp_pipeline_stage_gpu_p50_seconds", "gauge", "Recent median GPU (CUDA event) time of a stage.")
    depth = Family("fp_pipeline_queue_depth", "gauge", "Packages waiting in front of a stage.")
    capacity = Family("fp_pipeline_queue_capacity", "gauge", "Capacity of the queue in front of a stage.")
    in_flight = Family("fp_pipeline_in_flight", "gauge", "Packages admitted and not yet completed, by lane.")
    submitted = Family("fp_pipeline_submitted_total", "counter", "Packages admitted, by lane.")
    healthy = Family("fp_pipeline_running", "gauge", "1 while the lane's pipeline is running (not broken/closed).")
    for lane, pipe in (("register", stats.register), ("track", stats.track)):
        in_flight.add(pipe.in_flight, lane=lane)
        submitted.add(pipe.submitted, lane=lane)
        healthy.add(pipe.state in ("new", "running"), lane=lane)
        for s in pipe.stages:
            calls.add(s.count, lane=lane, stage=s.name)
            errors.add(s.errors, lane=lane, stage=s.name)
            wall.add(s.wall_p50_ms / 1e3, lane=lane, stage=s.name, quantile="0.5")
            wall.add(s.wall_p90_ms / 1e3, lane=lane, stage=s.name, quantile="0.9")
            wall.add(s.busy_ms_total / 1e3, "_sum", lane=lane, stage=s.name)
            wall.add(s.count, "_count", lane=lane, stage=s.name)
            wait.add(s.queue_wait_p50_ms / 1e3, lane=lane, stage=s.name, quantile="0.5")
            wait.add(s.queue_wait_p90_ms / 1e3, lane=lane, stage=s.name, quantile="0.9")
            if s.gpu_p50_ms is not None:
                gpu.add(s.gpu_p50_ms / 1e3, lane=lane, stage=s.name)
            depth.add(s.queue_depth, lane=lane, stage=s.name)
            capacity.add(s.queue_capacity, lane=lane, stage=s.name)
    leases = Family("fp_pool_leases_in_use", "gauge", "Memory-pool slots leased by packages in flight, by lane.")
    leases.add(stats.register_pool.leased, lane="register").add(stats.track_pool.leased, lane="track")
    waiting = Family("fp_track_batcher_waiting", "gauge", "Track requests waiting to join a batch.")
    waiting.add(stats.track_batcher.waiting)
    batches = Family("fp_track_batches_total", "counter", "Track batches sent to the pipeline.")
    batches.add(stats.track_batcher.batches)
    items = Family("fp_track_batched_requests_total", "counter", "Track requests sent in batches.")
    items.add(stats.track_batcher.items)
    inline = Family("fp_track_inline_total", "counter",
                    "Track requests that found the lane idle and ran in their worker thread (no batch).")
    inline.add(stats.track_inline)
    captures = Family("fp_track_graph_captures_total", "counter", "Track steps captured as CUDA graphs (graphed lanes).")
    captures.add(stats.track_captures)
    capture_failures = Family("fp_track_graph_capture_failures_total", "counter",
                              "Track step captures that failed: the step runs eagerly meanwhile and is captured again on "
                              "its next use (three attempts in all); the log says why.")
    capture_failures.add(stats.track_capture_failures)
    graphs = Family("fp_track_graphs", "gauge",
                    "Track steps the graphed lane holds now (one per object, image size and batch size).")
    graphs.add(stats.track_graphs)
    register_captures = Family("fp_register_graph_captures_total", "counter",
                               "Register steps (refine iterations + scorer) captured as CUDA graphs, by outcome "
                               "(failed: those registers run iteration by iteration; the log says why).")
    register_captures.add(stats.register_captures, outcome="captured")
    register_captures.add(stats.register_capture_failures, outcome="failed")
    driver = Family("fp_track_driver_launches_total", "counter",
                    "Track batches sent to the GPU by CUDA driver calls that keep the GIL; the rest of "
                    "fp_track_batches_total went through PyTorch's calls.")
    driver.add(stats.track_driver_launches)
    rows = Family("fp_track_step_rows_total", "counter",
                  "Rows the graphed lane's track steps computed: requested frames, and padding up to the padded batch "
                  "size.")
    rows.add(stats.track_rows_requested, kind="requested").add(stats.track_rows_padding, kind="padding")
    return [calls, errors, wall, wait, gpu, depth, capacity, in_flight, submitted, healthy, leases, waiting, batches, items,
            inline, captures, capture_failures, graphs, register_captures, driver, rows]
