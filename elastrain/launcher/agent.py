"""ElastrainAgent: torch's LocalElasticAgent with elastrain's worker contract and lifecycle events.

It reuses torch's monitor loop unchanged and hooks in at three seams: after each rendezvous (to
classify the start and log the world-size change), when the per-worker environment is built (to add
the ELASTRAIN_* variables) and after workers start (to log it).
"""

from __future__ import annotations

import logging
import tempfile
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import LogsSpecs

from elastrain.control import ControlChannel
from elastrain.env import LaunchContext, StartReason, start_reason, to_environ
from elastrain.launcher.options import ElastrainOptions
from elastrain.log import lifecycle


def _handler_round(handler: Any, fallback: int) -> int:
    """The job-wide round number, where the handler knows one (it is the same on every node)."""
    for attr in ("elastrain_round", "round"):
        value = getattr(handler, attr, None)
        if isinstance(value, int):
            return value
    state_holder = getattr(handler, "_state_holder", None)
    state = getattr(state_holder, "state", None)
    value = getattr(state, "round", None)
    return value if isinstance(value, int) else fallback


class ElastrainAgent(LocalElasticAgent):
    def __init__(
        self,
        spec: WorkerSpec,
        logs_specs: LogsSpecs,
        options: ElastrainOptions,
        start_method: str = "spawn",
        log_line_prefix_template: str | None = None,
        shutdown_timeout: int = 30,
    ) -> None:
        super().__init__(
            spec=spec,
            logs_specs=logs_specs,
            start_method=start_method,
            log_line_prefix_template=log_line_prefix_template,
            shutdown_timeout=shutdown_timeout,
        )
        self._options = options
        self._previous_world_size: int | None = None
        self._worker_failed = False
        self._rounds_seen = 0
        self._context: LaunchContext | None = None
        self.control = ControlChannel(tempfile.mkdtemp(prefix="elastrain-control-"))

    @property
    def context(self) -> LaunchContext | None:
        return self._context

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result: RunResult = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            self._worker_failed = True
        return result

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        super()._rendezvous(worker_group)
        spec = worker_group.spec
        world_size = worker_group.workers[0].world_size if worker_group.workers else 0
        reason = start_reason(self._previous_world_size, world_size, self._worker_failed)
        failures = spec.max_restarts - self._remaining_restarts
        round_ = _handler_round(spec.rdzv_handler, self._rounds_seen)
        self._rounds_seen += 1
        self._context = LaunchContext(
            run_id=spec.rdzv_handler.get_run_id(),
            restart_count=round_ if reason is not StartReason.FIRST_START or round_ else 0,
            failure_count=failures,
            start_reason=reason,
            previous_world_size=self._previous_world_size,
            round=round_,
            checkpoint_dir=self._options.checkpoint_dir,
            control_dir=str(self.control.directory),
            collective_timeout_s=self._options.collective_timeout_s,
        )
        old = self._previous_world_size
        lifecycle(
            "rendezvous_done",
            round=round_,
            group_rank=worker_group.group_rank,
            nodes=worker_group.group_world_size,
            world_size=f"{old if old is not None else '-'}->{world_size}",
            reason=reason.value,
            master=f"{worker_group.master_addr}:{worker_group.master_port}",
        )
        if old is not None and old != world_size:
            lifecycle("world_size_changed", old=old, new=world_size, reason=reason.value)
        self._previous_world_size = world_size
        self._worker_failed = False

    def _set_local_rank_env(self, worker_env: dict[str, str | None], local_rank: int, spec: WorkerSpec) -> None:
        super()._set_local_rank_env(worker_env, local_rank, spec)
        if self._context is not None:
            worker_env.update(to_environ(self._context))
            # One restart count for the whole job, the same on every node (torch's counts local failures).
            worker_env["TORCHELASTIC_RESTART_COUNT"] = str(self._context.restart_count)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        pids: dict[int, Any] = super()._start_workers(worker_group)
        ctx = self._context
        lifecycle(
            "workers_started",
            round=ctx.round if ctx else None,
            reason=ctx.start_reason.value if ctx else None,
            pids=",".join(str(p) for p in pids.values()),
        )
        return pids

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        lifecycle(
            "workers_restarting",
            level=logging.WARNING,
            cause="worker_failure" if self._worker_failed else "membership_change",
            remaining_restarts=self._remaining_restarts,
        )
        super()._restart_workers(worker_group)
