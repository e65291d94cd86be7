"""The chaos harness: run a job as N local nodes and preempt them on a trace (``elastrain-chaos``)."""

from elastrain.chaos.harness import ChaosHarness, ChaosResult, elastrain_node_command
from elastrain.chaos.procs import ProcessTree
from elastrain.chaos.progress import MetricsProgress
from elastrain.chaos.trace import Action, Trace, TraceEvent, load_trace, random_trace, trace_from_dict

__all__ = [
    "Action",
    "ChaosHarness",
    "ChaosResult",
    "MetricsProgress",
    "ProcessTree",
    "Trace",
    "TraceEvent",
    "elastrain_node_command",
    "load_trace",
    "random_trace",
    "trace_from_dict",
]
