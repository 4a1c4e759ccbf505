"""Operations routes: ``/healthz`` (liveness, no auth), ``/readyz`` (readiness), ``POST /readyz/retry`` (retry a
failed start-up) and ``/metrics`` (Prometheus). What each says is its host's (``health``, ``readiness``,
``retry``, ``metrics_text``)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse

from server.api.host import HostDep
from server.metrics import CONTENT_TYPE
from server.schemas import ErrorBody, HealthBody, ReadyBody

__all__ = ["router"]

router = APIRouter(tags=["operations"])


@router.get("/healthz", response_model=HealthBody, responses={503: {"model": HealthBody}},
            summary="Liveness: the process is up (no API key needed)",
            description="200 while the process serves requests; 503 when start-up failed or a pipeline lane broke "
                        "(restart the process). `curl -s http://127.0.0.1:8000/healthz`")
async def healthz(host: HostDep) -> JSONResponse:
    body, ok = host.health()
    return JSONResponse(body.model_dump(), status_code=200 if ok else 503)


@router.get("/readyz", response_model=ReadyBody, responses={503: {"model": ReadyBody}},
            summary="Readiness: networks loaded, objects loaded, warm-up done",
            description="503 (with Retry-After) while starting, after a failed start-up, when the pipeline is "
                        "broken or while shutting down. `curl -s http://127.0.0.1:8000/readyz`")
async def readyz(host: HostDep) -> JSONResponse:
    body, ready = await host.readiness()
    headers = {} if ready else {"Retry-After": str(host.config.retry_after_s)}
    return JSONResponse(body.model_dump(), status_code=200 if ready else 503, headers=headers)


@router.post("/readyz/retry", response_model=ReadyBody, status_code=202,
             responses={409: {"model": ErrorBody, "description": "Start-up has not failed: nothing to retry."}},
             summary="Retry a failed start-up (e.g. a warm-up that missed its deadline)",
             description="Only when `/readyz` says `phase: failed`. Steps already done (networks, objects) are "
                         "kept; a warm-up still running is waited for again, not submitted twice. Poll `/readyz`. "
                         "`curl -s -X POST http://127.0.0.1:8000/readyz/retry`")
async def readyz_retry(host: HostDep) -> JSONResponse:
    return JSONResponse(host.retry().model_dump(), status_code=202)


@router.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics (text format 0.0.4)",
            description="Requests and latency histograms per endpoint and status, per-stage pipeline timings, "
                        "queue depths, pool leases in use, sessions, GPU memory on CUDA. "
                        "`curl -s http://127.0.0.1:8000/metrics`")
async def metrics(host: HostDep) -> PlainTextResponse:
    return PlainTextResponse(await host.metrics_text(), media_type=CONTENT_TYPE)
