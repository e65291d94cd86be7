"""ElastrainAgent: torch's LocalElasticAgent with elastrain's worker contract and lifecycle events.

It reuses torch's monitor loop unchanged, overrides its hooks and delegates: after each rendezvous (to
classify the start and log the world-size change), when the per-worker environment is built (to add
the ELASTRAIN_* variables), after workers start (to log it and to take SIGTERM as a graceful leave)
and in ``_monitor_workers``, where membership changes become restarts that use no ``--max-restarts``:

* a worker failure within the handler's grace window of a membership change (a peer died, left or
  was evicted) is a membership change, not a failure (:mod:`elastrain.launcher.verdict`);
* healthy workers on a node whose round is over (a member departed, a node waits to join, this node
  was evicted) are restarted through torch's own ``num_nodes_waiting`` branch; workers stuck in a
  collective with a frozen peer are killed that way too;
* before restarting for a node that waits to join, and before leaving (:mod:`elastrain.launcher.leave`),
  the agent asks its workers for a checkpoint through the control channel
  (:mod:`elastrain.launcher.save_request`, bounded by ``--save-timeout``).

With ``--live true``, a membership change whose local workers are all alive and said they can regroup
moves them to the new round in place (:mod:`elastrain.launcher.regroup`). The workers' phase is one
:class:`~elastrain.launcher.phase.Phase`; membership is asked only through
:class:`~elastrain.rendezvous.api.Membership`; each start's launch context comes from
:class:`~elastrain.launcher.context.ContextBuilder`.
"""

from __future__ import annotations

import logging
import os
import weakref
from functools import partial
from typing import Any

from torch.distributed import DistError
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import LogsSpecs
from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

from elastrain.control import ControlChannel, RegroupChannel, SaveCause
from elastrain.env import ZYGOTE, LaunchContext, start_reason, to_environ
from elastrain.launcher import control_dir, exit_barrier, zygote
from elastrain.launcher.context import ContextBuilder
from elastrain.launcher.leave import NodeLeave
from elastrain.launcher.options import ElastrainOptions
from elastrain.launcher.phase import Phase
from elastrain.launcher.regroup import LiveCoordination
from elastrain.launcher.save_request import checkpoint_before_change
from elastrain.launcher.verdict import FailureVerdict, fatal_exit, killed_outright, static_rendezvous_failed
from elastrain.launcher.warm_start import tell_warm
from elastrain.log import lifecycle
from elastrain.rendezvous.api import membership_of
from elastrain.rendezvous.state import ChangeKind, Departure

# How many rounds in a row may lose a member before it shared its worker info (each bounded by timeouts).
RENDEZVOUS_ATTEMPTS = 20


class ElastrainAgent(LocalElasticAgent):
    """torch's agent with elastrain's hooks: each one moves the workers' phase and hands the job to its module."""

    def __init__(
        self,
        spec: WorkerSpec,
        logs_specs: LogsSpecs,
        options: ElastrainOptions,
        start_method: str = "spawn",
        log_line_prefix_template: str | None = None,
        shutdown_timeout: int = 30,
        warm_start: bool = False,
    ) -> None:
        super().__init__(
            spec=spec,
            logs_specs=logs_specs,
            start_method=start_method,
            log_line_prefix_template=log_line_prefix_template,
            shutdown_timeout=shutdown_timeout,
        )
        self._options = options
        self.phase = Phase.IDLE  # the workers' phase, the change at hand included (see phase.py)
        self._previous_world_size: int | None = None
        self._rounds_seen = 0
        self._context: LaunchContext | None = None
        self.control = ControlChannel(control_dir.make())
        # Removed when run() ends, however it ends; at the latest when the interpreter exits (an agent never run).
        self._remove_control_dir = weakref.finalize(self, control_dir.remove, self.control.directory, os.getpid())
        self.regroup = RegroupChannel(self.control.directory)
        self._membership = membership_of(spec.rdzv_handler)
        self._contexts = ContextBuilder(options, spec.rdzv_handler.get_run_id(), str(self.control.directory))
        self._verdict = FailureVerdict(self._membership, self.regroup)
        self._live = LiveCoordination(self, self._membership, self.regroup, options, warm_start)
        self._checkpoint = partial(
            checkpoint_before_change,
            self.control,
            options,
            workers_exited=self._workers_exited,
            workers_finishing=self._workers_finishing,
        )
        self._leave = NodeLeave(self._membership, self._checkpoint, lambda: self.phase.running, options.save_timeout_s)
        # Started now, so that torch is imported while the first rendezvous runs.
        self._zygote = zygote.Zygote.for_entrypoint(spec.entrypoint, spec.args) if options.zygote else None

    def _workers_exited(self) -> bool:
        """Whether every worker process of this node has exited, read from their handles (not from the main loop,
        which a leave may hold in the SIGTERM handler); ``False`` when that cannot be told."""
        pcontext = self._pcontext
        if not isinstance(pcontext, SubprocessContext):
            return False
        return all(handler.proc.poll() is not None for handler in pcontext.subprocess_handlers.values())

    def _workers_finishing(self) -> bool:
        """Whether every worker of this node said its training is over (:meth:`LiveCoordination.finishing`)."""
        return self._live.finishing(self._worker_group)

    def request_leave(self, reason: str, deadline_s: float) -> None:
        """Leave the job within ``deadline_s``: checkpoint (if enabled), announce, stop the workers, end.

        Thread-safe and idempotent (see :class:`~elastrain.launcher.leave.NodeLeave`).
        """
        self._leave.request(reason, deadline_s)

    def run(self, role: str = "default") -> RunResult:
        self._leave.install_sigterm()
        try:
            result: RunResult = super().run(role)
        finally:
            try:
                if self._zygote is not None:  # not in _shutdown: torch calls that on every worker stop
                    self._zygote.close()
            finally:
                self._remove_control_dir()  # the workers are stopped (torch's run ends with _shutdown)
        return result

    def _exit_barrier(self) -> None:
        """torch's wait for the round's other nodes, elastic (:mod:`elastrain.launcher.exit_barrier`)."""
        if self._leave.reason is None and self._store is not None:
            nodes = int(self._worker_group.group_world_size or 1)
            timeout_s, unjoined = self._exit_barrier_timeout, self._live.ended_before_round()
            exit_barrier.wait(self._store, nodes, self._membership, timeout_s, self._leave.leaving, unjoined)

    @property
    def context(self) -> LaunchContext | None:
        return self._context

    @property
    def config_error(self) -> bool:
        """Whether this node ends because a worker exited with EX_USAGE or EX_CONFIG (launch.py says so)."""
        return self.phase is Phase.CONFIG_ERROR

    # -- torch's hooks -----------------------------------------------------------------------------
    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        self._leave.raise_if_left()
        self._verdict.raise_if_fatal()
        result: RunResult = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and fatal_exit(result):
            return self._end_on_config_error(result)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            echo = self._verdict.is_echo(result, self._context)
            change = self._verdict.wait_for_membership_change(echo, own=killed_outright(result))
            if change is not None:
                # A peer died, left or was evicted: our workers' collective broke because of it.
                lifecycle("membership_changed", level=logging.WARNING, cause=str(change), workers="failed")
                self.phase = Phase.EXITED  # nothing left to regroup in place
                return RunResult(state=WorkerState.HEALTHY)
            self.phase = Phase.FAILED
            return result
        if result.state is WorkerState.HEALTHY:
            if self._live.finishing(worker_group):
                return result  # a change waits for the closing workers (_restart_workers says so, once)
            self._live.probe_if_a_worker_broke()
            change = self._membership.membership_change()
            if change is not None and Departure.CONFIG in change.departures:
                own = self._verdict.await_own_verdict(partial(self.poll_workers, worker_group))
                if own is not None:
                    return own if own.state is WorkerState.SUCCEEDED else self._end_on_config_error(own)
            if change is not None:
                # Fenced: another world of this job won the claim. Our workers' state diverged from the
                # winners' (both trained on from the same checkpoint): never carry it into their world.
                # Superseded or evicted: the job trained on without this node; its workers' state is behind.
                self.phase = self.phase.with_change(change.kind)
                lifecycle("membership_changed", cause=str(change), kind=change.kind.value, workers="healthy")
                if change.kind is ChangeKind.SCALE_UP and not self._live.capable(worker_group):
                    # torch's loop restarts the workers right after this tick (num_nodes_waiting gives the
                    # same decision), so the save answers before any restart: no step is dropped.
                    self._checkpoint(SaveCause.SCALE_UP, str(change), self._options.save_timeout_s)
        return result

    def _end_on_config_error(self, result: RunResult) -> RunResult:
        self.phase = Phase.CONFIG_ERROR
        self._remaining_restarts = 0  # torch's loop then ends this node: launch.py announces the leave
        return result

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        for attempt in range(1, RENDEZVOUS_ATTEMPTS + 1):
            try:
                super()._rendezvous(worker_group)
                break
            except DistError as exc:
                handler = worker_group.spec.rdzv_handler
                if isinstance(handler, StaticTCPRendezvous):  # one round only: no next one to form
                    raise static_rendezvous_failed(handler, exc) from exc
                # torch's rank assignment waits (store timeout) for every member's worker info: a member that
                # froze or died right after the round formed never writes it. Form the next round without it
                # rather than end this node (it is evicted by its heartbeat meanwhile).
                if attempt == RENDEZVOUS_ATTEMPTS:
                    raise
                lifecycle(
                    "rendezvous_incomplete",
                    level=logging.WARNING,
                    attempt=attempt,
                    error=repr(exc)[:200],
                    why="a member of the new round did not share its worker info in time; forming the next round",
                )
                self._membership.probe_peers()
        spec = worker_group.spec
        world_size = worker_group.workers[0].world_size if worker_group.workers else 0
        reason = start_reason(self._previous_world_size, world_size, self.phase.failed)
        failures = spec.max_restarts - self._remaining_restarts
        known = self._membership.round
        round_ = known if known is not None else self._rounds_seen  # job-wide where the handler knows it
        self._rounds_seen += 1
        self._context = self._contexts.for_round(
            round_, failures, reason, self._previous_world_size, self._membership.generation, first_round=known == 0
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
        self.phase = self.phase.round_formed()

    def _set_local_rank_env(self, worker_env: dict[str, str | None], local_rank: int, spec: WorkerSpec) -> None:
        super()._set_local_rank_env(worker_env, local_rank, spec)
        if self.phase is Phase.WARMING:
            tell_warm(worker_env, self._contexts.warm())
        elif self._context is not None:
            worker_env.update(to_environ(self._context))
            # One restart count for the whole job, the same on every node (torch's counts local failures).
            worker_env["TORCHELASTIC_RESTART_COUNT"] = str(self._context.restart_count)
        if self._zygote is not None:
            worker_env[ZYGOTE] = "1"

    def _initialize_workers(self, worker_group: WorkerGroup) -> None:
        """torch's first start (a rendezvous, then the workers); --live: the workers first, warm."""
        if self._live.warm.enabled and self._rounds_seen == 0 and self._live.warm.start(worker_group):
            self._live.regroup(worker_group)  # the round, then its notice to the waiting workers
            self.phase = self.phase.started()
            return
        super()._initialize_workers(worker_group)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self._leave.raise_if_left()
        self.regroup.forget_workers()  # the new workers say again whether they can regroup
        self.phase = self.phase.without_change()
        with zygote.forking_from(self._zygote):
            pids: dict[int, Any] = super()._start_workers(worker_group)
        if isinstance(self._pcontext, zygote.ZygoteContext):
            self._pcontext.keep_survivors = self._live.keeps  # a failed worker alone is replaced (--live)
        # torch's process context installs its own signal handlers on every start; SIGTERM is ours.
        self._leave.install_sigterm()
        self.phase = self.phase.started()
        ctx = self._context
        lifecycle(
            "workers_started",
            round=ctx.round if ctx else None,
            reason=ctx.start_reason.value if ctx else None,
            pids=",".join(str(p) for p in pids.values()),
        )
        return pids

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        if self._live.defer_for_finishing(worker_group):
            return
        if self._live.capable(worker_group):
            self._live.regroup(worker_group)
            return
        if replaced := self._live.replaceable(self._pcontext):
            self._live.regroup(worker_group, replaced)
            return
        lifecycle(
            "workers_restarting",
            level=logging.WARNING,
            cause="worker_failure" if self.phase.failed else "membership_change",
            remaining_restarts=self._remaining_restarts,
        )
        self.phase = self.phase.stopped()
        super()._restart_workers(worker_group)

    # -- what the live coordination asks of the agent (worker_host.WorkerHost) ----------------------
    def form_round(self, worker_group: WorkerGroup) -> None:
        self._rendezvous(worker_group)

    def poll_workers(self, worker_group: WorkerGroup) -> RunResult:
        result: RunResult = super()._monitor_workers(worker_group)
        return result

    def stop_workers(self, worker_group: WorkerGroup) -> None:
        self._stop_workers(worker_group)

    def start_workers_tracked(self, worker_group: WorkerGroup) -> None:
        """Start the workers outside torch's own first start: record their ids, and the group as healthy."""
        for local_rank, worker_id in self._start_workers(worker_group).items():
            worker_group.workers[local_rank].id = worker_id
        worker_group.state = WorkerState.HEALTHY

    def replace_workers(self, worker_group: WorkerGroup, local_ranks: frozenset[int]) -> None:
        ctx = self._pcontext
        if not isinstance(ctx, zygote.ZygoteContext) or self._zygote is None or not self._zygote.alive:
            raise zygote.ZygoteError("the zygote that forks a single worker is gone")
        self._leave.raise_if_left()
        self.regroup.forget_workers(local_ranks)  # the new ones say again whether they can regroup
        new: dict[int, int] = {}
        with zygote.respawning(ctx, local_ranks, new):
            pids = super()._start_workers(worker_group)
        for local_rank, pid in pids.items():
            worker_group.workers[local_rank].id = pid
        worker_group.state = WorkerState.HEALTHY
        new_pids, all_pids = (",".join(str(ps[r]) for r in sorted(ps)) for ps in (new, pids))  # by local rank
        round_ = self._context.round if self._context else None
        lifecycle(
            "workers_replaced", round=round_, local_ranks=",".join(map(str, sorted(new))), new=new_pids, pids=all_pids
        )

    def raise_if_left(self) -> None:
        self._leave.raise_if_left()
