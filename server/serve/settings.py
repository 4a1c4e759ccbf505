"""Settings of the Ray Serve application: the server's own ``ServerConfig`` plus the scale-out knobs."""

from __future__ import annotations

from dataclasses import dataclass

from server.config import ServerConfig

__all__ = ["ServeSettings"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeSettings:
    """How the service is spread over Ray Serve replicas.

    server: everything the single-process server takes (objects directory, device, algorithm size,
        limits, timeouts, API key); each pose replica builds its service from it.
    replicas: pose replicas (``num_replicas`` of the pose deployment).
    num_gpus: GPUs per pose replica; fractional (0.5) puts several replicas on one GPU; 0 = CPU.
    num_cpus: CPUs Ray reserves per pose replica; ingress_num_cpus: for the ingress replica.
    max_ongoing_requests: requests one pose replica works on at once (keep >= the track batch so that
        sessions batch); max_queued_requests: requests the ingress queues for the pose replicas before
        answering 503 + Retry-After (Serve's ``BackPressureError``).
    ingress_max_ongoing_requests / ingress_max_queued_requests: the same for the ingress (the Serve
        proxy answers 503 above them).
    retry_attempts: tries of one pose call when its replica dies mid-request (each on a live replica).
    health_check_period_s / health_check_timeout_s: Serve's health check of each replica
        (``check_health``: the replica's pipeline is running).
    metrics_interval_s: how often each pose replica publishes its metrics for ``/metrics``.
    torch_threads: intra-op threads of each replica's torch (None = torch's default).
    switch_interval_ms: each pose replica's ``sys.setswitchinterval`` (None = Python's 5 ms; ``python -m
        server.serve`` passes ``--switch-interval-ms``, 0.5 by default, as ``python -m server`` sets its own).
    app_name / route_prefix: the Serve application's name and HTTP prefix.
    """

    server: ServerConfig
    replicas: int = 1
    num_gpus: float = 0.0
    num_cpus: float = 1.0
    ingress_num_cpus: float = 1.0
    max_ongoing_requests: int = 64
    max_queued_requests: int = 256
    ingress_max_ongoing_requests: int = 1024
    ingress_max_queued_requests: int = -1
    retry_attempts: int = 3
    health_check_period_s: float = 5.0
    health_check_timeout_s: float = 30.0
    metrics_interval_s: float = 2.0
    torch_threads: int | None = None
    switch_interval_ms: float | None = None
    app_name: str = "foundationpose"
    route_prefix: str = "/"

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas!r}")
        for name in ("num_gpus", "num_cpus", "ingress_num_cpus"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.num_gpus > 1 and self.num_gpus != int(self.num_gpus):
            raise ValueError(f"num_gpus above 1 must be a whole number, got {self.num_gpus!r}")
        for name in ("max_ongoing_requests", "ingress_max_ongoing_requests", "retry_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("max_queued_requests", "ingress_max_queued_requests"):
            value = getattr(self, name)
            if value != -1 and value < 1:
                raise ValueError(f"{name} must be >= 1 or -1 (no bound), got {value!r}")
        for name in ("health_check_period_s", "health_check_timeout_s", "metrics_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"torch_threads must be >= 1, got {self.torch_threads!r}")
        if self.switch_interval_ms is not None and not 0 < self.switch_interval_ms <= 1000:
            raise ValueError(f"switch_interval_ms must be in (0, 1000], got {self.switch_interval_ms!r}")
        if not self.route_prefix.startswith("/"):
            raise ValueError(f"route_prefix must start with '/', got {self.route_prefix!r}")
