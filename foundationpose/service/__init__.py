"""The pipelined service: :class:`PoseService` runs register and track through two lanes of ``deploy_core``
pipelines (``register_lane``, ``track_lane``, their shared context in ``lane``, sizing in ``config``) and returns
exactly the poses of :class:`~foundationpose.estimator.PoseEstimator` (the same step definitions)."""

from foundationpose.service.config import ServiceConfig, ServiceStats
from foundationpose.service.pose_service import PoseService

__all__ = ["PoseService", "ServiceConfig", "ServiceStats"]
