"""Preemption notices from the clouds (Azure, AWS, GCP) and SIGTERM, turned into a graceful leave."""

from elastrain.preemption.aws import AwsSpotInstanceAction
from elastrain.preemption.azure import AzureScheduledEvents
from elastrain.preemption.gcp import GcpPreempted
from elastrain.preemption.monitor import PreemptionMonitor, build_watchers, detect, parse_watchers, start_monitor
from elastrain.preemption.notice import Notice, Watcher
from elastrain.preemption.sigterm import SigtermWatcher

__all__ = [
    "AwsSpotInstanceAction",
    "AzureScheduledEvents",
    "GcpPreempted",
    "Notice",
    "PreemptionMonitor",
    "SigtermWatcher",
    "Watcher",
    "build_watchers",
    "detect",
    "parse_watchers",
    "start_monitor",
]
