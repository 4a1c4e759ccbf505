"""Operations routes: ``/healthz`` (liveness, no auth), ``/readyz`` (readiness), ``POST /readyz/retry``
(retry a failed start-up) and ``/metrics`` (Prometheus)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, PlainTextResponse

from server.metrics import CONTENT_TYPE
from server.schemas import HealthBody, ReadyBody
from server.state import ServerState, get_state

__all__ = ["router"]

router = APIRouter(tags=["operations"])


StateDep = Annotated[ServerState, Depends(get_state)]


@router.get("/healthz", response_model=HealthBody, responses={503: {"model": HealthBody}},
            summary="Liveness: the process is up (no API key needed)",
            description="200 while the process serves requests; 503 when start-up failed or a pipeline lane broke "
                        "(restart the process). `curl -s http://127.0.0.1:8000/healthz`")
async def healthz(state: StateDep) -> JSONResponse:
    failed = state.phase == "failed" or state.pipeline_state() == "broken"
    body = HealthBody(status="failed" if failed else "ok", phase=state.phase)
    return JSONResponse(body.model_dump(), status_code=503 if failed else 200)


@router.get("/readyz", response_model=ReadyBody, responses={503: {"model": ReadyBody}},
            summary="Readiness: networks loaded, objects loaded, warm-up done",
            description="503 (with Retry-After) while starting, after a failed start-up, when the pipeline is "
                        "broken or while shutting down. `curl -s http://127.0.0.1:8000/readyz`")
async def readyz(state: StateDep) -> JSONResponse:
    pipeline = state.pipeline_state()
    ready = state.phase == "ready" and pipeline == "ok"
    reason = None
    if not ready:
        reason = state.failure if state.phase == "failed" else (f"pipeline {pipeline}" if pipeline != "ok" else state.phase)
    body = _ready_body(state, ready, reason)
    headers = {} if ready else {"Retry-After": str(state.config.retry_after_s)}
    return JSONResponse(body.model_dump(), status_code=200 if ready else 503, headers=headers)


def _ready_body(state: ServerState, ready: bool, reason: str | None) -> ReadyBody:
    est, cfg = state.estimator, state.config.estimator
    hypotheses = cfg.num_hypotheses or (len(est.rotation_grid()) if est is not None else None)
    return ReadyBody(
        ready=ready, phase=state.phase, reason=reason,
        device=str(est.device) if est is not None else None,
        objects=len(state.objects or ()),
        random_weights=bool(est.networks.random_weights) if est is not None else None,
        settings={"hypotheses": hypotheses, "register_iterations": cfg.register_iterations,
                  "track_iterations": cfg.track_iterations},
        note=state.config.settings_note, warmup_ms=None if state.warmup_ms is None else round(state.warmup_ms, 1),
        ingest=_ingest_info(state),
    )


def _ingest_info(state: ServerState) -> dict[str, int] | None:
    workers, hub = state.ingest_workers, state.ingest
    if workers is None or hub is None or workers.port is None:
        return None
    return {"port": workers.port, "workers": len(workers.pids), "connected": hub.connected,
            "page_locked": hub.page_locked}


@router.post("/readyz/retry", response_model=ReadyBody, status_code=202,
             responses={409: {"description": "Start-up has not failed: nothing to retry."}},
             summary="Retry a failed start-up (e.g. a warm-up that missed --warmup-timeout-s)",
             description="Only when `/readyz` says `phase: failed`. Steps already done (networks, objects) are "
                         "kept; a warm-up still running is waited for again, not submitted twice. Poll `/readyz`. "
                         "`curl -s -X POST http://127.0.0.1:8000/readyz/retry`")
async def readyz_retry(state: StateDep) -> JSONResponse:
    state.retry()
    return JSONResponse(_ready_body(state, False, "retrying").model_dump(), status_code=202)


@router.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics (text format 0.0.4)",
            description="Requests and latency histograms per endpoint and status, per-stage pipeline timings, "
                        "queue depths, pool leases in use, sessions, GPU memory on CUDA. "
                        "`curl -s http://127.0.0.1:8000/metrics`")
async def metrics(state: StateDep) -> PlainTextResponse:
    text = state.metrics.render(state.metric_families())
    return PlainTextResponse(text, media_type=CONTENT_TYPE)
