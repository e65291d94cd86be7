"""What the agent's helpers for live regroups and warm starts ask of the agent that runs the workers."""

from __future__ import annotations

from typing import Protocol

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup

from elastrain.env import LaunchContext
from elastrain.launcher.phase import Phase


class WorkerHost(Protocol):
    """What the live coordination asks of the agent that runs the workers."""

    phase: Phase

    @property
    def context(self) -> LaunchContext | None:
        """The launch context of the last round formed."""
        ...

    def form_round(self, worker_group: WorkerGroup) -> None:
        """Complete the next rendezvous: the group's ranks and :attr:`context` become the new round's."""
        ...

    def poll_workers(self, worker_group: WorkerGroup) -> RunResult:
        """torch's check of the workers' processes (no membership verdict)."""
        ...

    def stop_workers(self, worker_group: WorkerGroup) -> None:
        """Stop the workers (torch's way)."""
        ...

    def start_workers_tracked(self, worker_group: WorkerGroup) -> None:
        """Start the workers outside torch's own first start, and record them in the group."""
        ...

    def replace_workers(self, worker_group: WorkerGroup, local_ranks: frozenset[int]) -> None:
        """Start new workers for ``local_ranks`` (theirs failed) into the round just formed, beside the running
        ones, and record them in the group; :class:`~elastrain.launcher.zygote.ZygoteError` if it cannot."""
        ...

    def raise_if_left(self) -> None:
        """End the agent's loop if this node leaves."""
        ...
