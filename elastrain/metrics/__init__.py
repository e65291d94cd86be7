"""Events file and step-keyed metrics that stay continuous across restarts (optional TensorBoard)."""

from elastrain.metrics.events import EVENTS_FILENAME, EventsFile, read_events
from elastrain.metrics.series import METRICS_FILENAME, MetricsHistory, MetricsWriter, Point, read_metrics
from elastrain.metrics.tensorboard import TensorBoardWriter, tensorboard_available

__all__ = [
    "EVENTS_FILENAME",
    "METRICS_FILENAME",
    "EventsFile",
    "MetricsHistory",
    "MetricsWriter",
    "Point",
    "TensorBoardWriter",
    "read_events",
    "read_metrics",
    "tensorboard_available",
]
