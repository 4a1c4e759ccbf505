"""The Ray Serve application: one ingress deployment in front of ``replicas`` pose-replica deployments.

``build_app(settings)`` returns the bound application for ``serve.run``; ``app_builder`` is the same
for ``serve run`` / a Serve config file, from string arguments named like the command's flags::

    serve run server.serve.app:app_builder objects=/data/objects replicas=2 num_gpus=1
"""

from __future__ import annotations

from collections.abc import Mapping

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from server.serve.ingress import POSE_DEPLOYMENT, PoseIngress
from server.serve.replica import PoseReplica
from server.serve.routing import SessionAffinityRouter
from server.serve.settings import ServeSettings, settings_from_args

__all__ = ["INGRESS_DEPLOYMENT", "app_builder", "build_app"]

INGRESS_DEPLOYMENT = "PoseIngress"


def build_app(settings: ServeSettings) -> Application:
    """The application: pose replicas sized by ``settings``, and the HTTP ingress bound to their handle."""
    pose = serve.deployment(PoseReplica).options(
        name=POSE_DEPLOYMENT,
        num_replicas=settings.replicas,
        ray_actor_options={"num_gpus": settings.num_gpus, "num_cpus": settings.num_cpus},
        max_ongoing_requests=settings.max_ongoing_requests,
        max_queued_requests=settings.max_queued_requests,
        health_check_period_s=settings.health_check_period_s,
        health_check_timeout_s=settings.health_check_timeout_s,
        graceful_shutdown_timeout_s=settings.server.request_timeout_s,
        request_router_config=RequestRouterConfig(request_router_class=SessionAffinityRouter),
    )
    ingress = serve.deployment(serve.ingress()(PoseIngress)).options(
        name=INGRESS_DEPLOYMENT,
        num_replicas=1,  # it holds the sessions
        ray_actor_options={"num_cpus": settings.ingress_num_cpus},
        max_ongoing_requests=settings.ingress_max_ongoing_requests,
        max_queued_requests=settings.ingress_max_queued_requests,
        health_check_period_s=settings.health_check_period_s,
    )
    return ingress.bind(pose.bind(settings), settings)


def app_builder(args: Mapping[str, str]) -> Application:
    """``serve run`` entry: ``args`` are the flags of ``python -m server.serve`` without dashes (``num_gpus=0.5``)."""
    argv: list[str] = []
    for key, value in args.items():
        flag = "--" + str(key).replace("_", "-")
        if str(value).lower() in ("true", ""):
            argv.append(flag)
        elif str(value).lower() == "false":
            argv.append("--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return build_app(settings_from_args(argv))
