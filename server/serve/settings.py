"""Settings of the Ray Serve application: the server's own :class:`~server.config.ServerConfig` plus the scale-out
settings, each declared once (:mod:`server.options`) like the server's; :func:`settings_from_args` reads both from
the command line, the ``FP_*`` variables and the ``--config`` file (``python -m server.serve``, ``serve run``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from server.cli import build_parser, config_of, settings_of_args
from server.config import ServerConfig
from server.options import optional, setting

__all__ = ["ServeSettings", "TINY_SETTINGS", "settings_from_args"]

# --tiny: a quick try (with random weights poses are meaningless)
TINY_SETTINGS = {"num_hypotheses": 4, "register_iterations": 1, "track_iterations": 1}


def _gpus(text: str) -> float:
    return float(text)


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeSettings:
    """How the service is spread over Ray Serve replicas. ``server``: everything the single-process server takes;
    each pose replica builds its service from it."""

    server: ServerConfig
    replicas: int = setting(1, "pose replicas, each with its own PoseService", group="serve", metavar="N")
    num_gpus: float | None = setting(None, "GPUs per pose replica; 0.5 puts two replicas on one GPU; 0 = CPU",
                                     group="serve", parse=optional(_gpus),
                                     default_text="1 when this machine has a CUDA GPU and --device is not cpu, else 0")
    num_cpus: float = setting(1.0, "CPUs Ray reserves per pose replica", group="serve", in_file=True)
    ingress_num_cpus: float = setting(1.0, "CPUs Ray reserves for the ingress", group="serve", in_file=True)
    max_ongoing_requests: int = setting(64, "requests one pose replica works on at once; keep >= --track-max-batch",
                                        group="serve", in_file=True)
    max_queued_requests: int = setting(256, "requests queued for the pose replicas before 503 + Retry-After; -1 = no "
                                            "bound", group="serve", in_file=True)
    ingress_max_ongoing_requests: int = 1024
    ingress_max_queued_requests: int = -1
    retry_attempts: int = setting(3, "tries of a pose call whose replica dies", group="serve", in_file=True)
    health_check_period_s: float = 5.0
    health_check_timeout_s: float = 30.0
    metrics_interval_s: float = setting(2.0, "how often replicas publish metrics", group="serve", in_file=True)
    torch_threads: int | None = setting(None, "torch intra-op threads per replica", group="serve", in_file=True,
                                        default_text="torch's")
    app_name: str = setting("foundationpose", "Serve application name", group="serve", in_file=True)
    route_prefix: str = "/"
    ray_address: str | None = setting(None, "join this Ray cluster (e.g. auto, or ray://host:10001)", group="serve",
                                      in_file=True, default_text="RAY_ADDRESS, else start a local one")
    tiny: bool = setting(False, "4 hypotheses, 1 register and 1 track iteration: a quick try", group="serve")

    def __post_init__(self) -> None:
        if self.num_gpus is None:
            object.__setattr__(self, "num_gpus", 0.0 if self.server.on_cpu else 1.0)
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
        if not self.route_prefix.startswith("/"):
            raise ValueError(f"route_prefix must start with '/', got {self.route_prefix!r}")


def settings_from_args(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> ServeSettings:
    """The ServeSettings of ``python -m server.serve``'s flags, variables and ``--config`` file; exits with status 2
    on bad values."""
    parser = build_parser(environ, classes=(ServerConfig, ServeSettings), prog="python -m server.serve",
                          description="FoundationPose HTTP service on Ray Serve: the settings of 'python -m server', "
                                      "plus how many pose replicas and what each holds.", epilog="")
    args = parser.parse_args(argv)
    if args.tiny:
        for name, value in TINY_SETTINGS.items():
            setattr(args, name, value)
    config = config_of(parser, args)
    try:
        # the ingress and the replicas serve every port: the single-process server's ingest workers do not apply
        return ServeSettings(server=dataclasses.replace(config, ingest_workers=0),
                             **settings_of_args(parser, args, ServeSettings))
    except ValueError as exc:
        parser.error(str(exc))
    raise AssertionError("unreachable")
