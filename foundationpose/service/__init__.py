"""The pipelined service: :class:`PoseService` runs register and track through two lanes of
``deploy_core`` pipelines (``register_lane``, ``track_lane``, their shared context in ``lane``), and
returns exactly the poses of the synchronous reference path (:mod:`foundationpose.estimator`)."""

from foundationpose.service.pose_service import PoseService, ServiceConfig, ServiceStats

__all__ = ["PoseService", "ServiceConfig", "ServiceStats"]
