"""Generic asynchronous pipeline: stages on their own threads, joined by bounded queues.

Public names: :class:`BlockQueue` (bounded closable FIFO), :class:`Package` (one unit of
work and its future), :class:`Stage`, :class:`BaseAsyncPipeline`, :class:`PipelineConfig`,
:class:`StageStats`, :class:`PipelineStats`, :class:`QueueStatistics`.
"""

from deploy_core.pipeline._config import PipelineConfig, PipelineStats, Stage, StageStats
from deploy_core.pipeline._package import Lease, Package
from deploy_core.pipeline._pipeline import BaseAsyncPipeline
from deploy_core.pipeline._queue import BlockQueue, QueueStatistics

__all__ = [
    "BaseAsyncPipeline",
    "BlockQueue",
    "Lease",
    "Package",
    "PipelineConfig",
    "PipelineStats",
    "QueueStatistics",
    "Stage",
    "StageStats",
]
