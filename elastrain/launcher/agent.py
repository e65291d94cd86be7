"""ElastrainAgent: torch's LocalElasticAgent with elastrain's worker contract and lifecycle events.

It reuses torch's monitor loop unchanged and hooks in at a few seams: after each rendezvous (to
classify the start and log the world-size change), when the per-worker environment is built (to add
the ELASTRAIN_* variables), after workers start (to log it and to take SIGTERM as a graceful leave)
and in ``_monitor_workers``, where membership changes become restarts that use no ``--max-restarts``:

* a worker failure within the handler's grace window of a membership change (a peer died, left or
  was evicted) is a membership change, not a failure;
* healthy workers on a node whose round is over (a member departed, a node waits to join, this node
  was evicted) are restarted through torch's own ``num_nodes_waiting`` branch; workers stuck in a
  collective with a frozen peer are killed that way too;
* before restarting for a node that waits to join, and before leaving, the agent asks its workers for
  a checkpoint through the control channel (bounded by ``--save-timeout``).

With ``--live true``, a membership change whose local workers are all alive and said they can regroup
(scripts that use :class:`elastrain.session.Session`) does not restart them: the agent completes the
new round, writes a regroup notice to the control channel and waits (bounded) for every local worker
to acknowledge it; the workers join the new round's group in place (:mod:`elastrain.live`). Workers
that cannot, or do not acknowledge in time, are restarted into the same round (the fallback).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import threading
import time
import weakref
from pathlib import Path
from types import FrameType
from typing import Any

from torch._C._distributed_c10d import HashStore
from torch.distributed import DistError
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import LogsSpecs

from elastrain.collective_failure import names_collective_failure
from elastrain.control import ControlChannel, RegroupChannel, RegroupNotice, SaveCause
from elastrain.env import WARM, ZYGOTE, LaunchContext, StartReason, start_reason, to_environ
from elastrain.errors import FATAL_EXIT_CODES, NodeLeftError
from elastrain.launcher import zygote
from elastrain.launcher.leave import Leave
from elastrain.launcher.options import ElastrainOptions
from elastrain.log import lifecycle
from elastrain.rendezvous.api import membership_of
from elastrain.rendezvous.state import Change, ChangeKind, Departure

# How many rounds in a row may lose a member before it shared its worker info (each bounded by timeouts).
RENDEZVOUS_ATTEMPTS = 20

# A SIGTERM (pod deletion, spot notice by signal) leaves within this many seconds at most.
SIGTERM_LEAVE_DEADLINE_S = 25.0

# --live: a worker stuck in a collective that cannot be given up waits at most --collective-timeout;
# the agent waits that long plus this margin for its acknowledgement before it restarts it instead.
REGROUP_ACK_MARGIN_S = 10.0
# A worker restarted by the fallback needs this long to import torch and join; live members wait for it.
COLD_START_ALLOWANCE_S = 30.0
# --live: how long a node waits for its warm workers (imports, model, data) before it joins anyway; then
# the round waits for the rest of their start, as it would for a cold one.
WARM_START_LIMIT_S = 600.0
# What a warm worker is not told (torch sets them from a round it does not have yet): a script that reads
# them before the first notice fails at once instead of training alone.
_ROUND_VARIABLES = (
    "RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"
)  # fmt: skip


def _remove_control_dir(directory: Path, owner_pid: int) -> None:
    """Remove this agent's own control directory (one per agent, made by ``tempfile.mkdtemp``); never from a
    forked copy of the agent's process, whose exit would take it from the agent still running."""
    if os.getpid() != owner_pid:
        return
    try:
        shutil.rmtree(directory)
    except FileNotFoundError:
        return  # removed already: nothing left behind
    except OSError as exc:
        lifecycle("control_dir_left", level=logging.WARNING, control_dir=str(directory), error=repr(exc)[:300])
        return
    lifecycle("control_dir_removed", level=logging.DEBUG, control_dir=str(directory))


class ElastrainAgent(LocalElasticAgent):
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
        self._previous_world_size: int | None = None
        self._worker_failed = False
        self._config_error = False
        self._rounds_seen = 0
        # The first workers start before the rendezvous (see _start_warm): scripts that wait for their round only.
        self._warm = warm_start
        self._warming = False
        self._fenced = False  # the change at hand: another world won the fencing claim (see _live_capable)
        self._left_behind = False  # the change at hand: this node's round was superseded, or it was evicted
        self._deferred_since: float | None = None  # when a membership change began to wait for closing workers
        self._context: LaunchContext | None = None
        self.control = ControlChannel(tempfile.mkdtemp(prefix="elastrain-control-"))
        # Removed when run() ends, however it ends; at the latest when the interpreter exits (an agent never run).
        self._remove_control_dir = weakref.finalize(self, _remove_control_dir, self.control.directory, os.getpid())
        self.regroup = RegroupChannel(self.control.directory)
        self._leave = Leave()
        self._workers_running = False
        self._workers_exited = False
        self._probed_round: int | None = None
        # Started now, so that torch is imported while the first rendezvous runs.
        self._zygote = zygote.Zygote.for_entrypoint(spec.entrypoint, spec.args) if options.zygote else None
        self._membership = membership_of(spec.rdzv_handler)

    # -- leaving -----------------------------------------------------------------------------------
    def request_leave(self, reason: str, deadline_s: float) -> None:
        """Leave the job within ``deadline_s``: checkpoint (if enabled), announce, stop the workers, end.

        Thread-safe and idempotent. Called from a watcher thread it does the checkpoint and the
        announcement there and the main loop ends the agent at its next tick; called on the main thread
        (the SIGTERM handler) it does everything inline.
        """
        if not self._leave.claim(reason, deadline_s):
            return
        started = time.monotonic()
        try:  # however it ends, the main loop must learn that the leave is over (see _raise_if_left)
            lifecycle("leave_requested", level=logging.WARNING, reason=reason, deadline_s=deadline_s)
            if self._workers_running:
                self._checkpoint_before_change(SaveCause.LEAVE, reason, max(0.0, deadline_s - 1.0))
            self._membership.leave(reason)  # bounded, and logs its own failure
        finally:
            self._leave.over()
        lifecycle("leave_announced", reason=reason, took_s=round(time.monotonic() - started, 3))

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        self.request_leave(name, min(self._options.save_timeout_s + 1.0, SIGTERM_LEAVE_DEADLINE_S))
        self._leave.wait()  # a watcher's leave may be checkpointing still (bounded)
        raise NodeLeftError(f"left the job on {name}")

    def _install_sigterm(self) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _raise_if_left(self) -> None:
        reason = self._leave.reason
        if reason is not None:
            # A watcher thread may still be checkpointing: wait for it, until its deadline at most.
            self._leave.wait()
            raise NodeLeftError(f"left the job: {reason}")

    def _checkpoint_before_change(self, cause: SaveCause, detail: str, timeout_s: float) -> None:
        """Ask local workers for a checkpoint and wait (bounded) for the ack; only with --checkpoint-dir."""
        opts = self._options
        if not opts.save_on_change or not opts.checkpoint_dir or timeout_s <= 0:
            return
        try:
            req = self.control.request_save(cause, detail)
        except OSError as exc:  # the control directory is gone or unwritable: the job's last checkpoint stands
            lifecycle(
                "checkpoint_request_failed",
                level=logging.ERROR,
                cause=cause.value,
                error=repr(exc)[:300],
                control_dir=str(self.control.directory),
                why="going on without this checkpoint",
            )
            return
        lifecycle("checkpoint_requested", request_id=req.request_id, reason=req.reason, timeout_s=timeout_s)
        wait_s = min(opts.save_timeout_s, timeout_s)
        ack = self.control.wait_ack(req.request_id, wait_s)
        if ack is None:
            lifecycle("checkpoint_timeout", level=logging.WARNING, request_id=req.request_id, waited_s=wait_s)
        else:
            lifecycle("checkpoint_acked", request_id=req.request_id, step=ack.step, checkpoint=ack.checkpoint)

    def run(self, role: str = "default") -> RunResult:
        self._install_sigterm()
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
        if self._leave.reason is None:
            super()._exit_barrier()  # type: ignore[no-untyped-call]

    @property
    def context(self) -> LaunchContext | None:
        return self._context

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        self._raise_if_left()
        self._raise_if_fatal()
        result: RunResult = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and self._fatal_exit(result):
            return self._end_on_config_error(result)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            change = self._wait_for_membership_change(self._failure_is_echo(result))
            if change is not None:
                # A peer died, left or was evicted: our workers' collective broke because of it.
                lifecycle("membership_changed", level=logging.WARNING, cause=str(change), workers="failed")
                self._worker_failed = False
                self._workers_exited = True  # nothing left to regroup in place
                return RunResult(state=WorkerState.HEALTHY)
            self._worker_failed = True
            return result
        if result.state is WorkerState.HEALTHY:
            if self._finishing(worker_group):
                return result  # a change waits for the closing workers (_restart_workers says so, once)
            self._probe_if_a_worker_broke()
            change = self._membership.membership_change()
            if change is not None and Departure.CONFIG in change.departures:
                own = self._await_own_verdict(worker_group)
                if own is not None:
                    return own
            if change is not None:
                # Fenced: another world of this job won the claim. Our workers' state diverged from the
                # winners' (both trained on from the same checkpoint): never carry it into their world.
                self._fenced = change.kind is ChangeKind.FENCED
                # Superseded or evicted: the job trained on without this node; its workers' state is behind.
                self._left_behind = change.kind in (ChangeKind.SUPERSEDED, ChangeKind.EVICTED)
                lifecycle("membership_changed", cause=str(change), kind=change.kind.value, workers="healthy")
                if change.kind is ChangeKind.SCALE_UP and not self._live_capable(worker_group):
                    # torch's loop restarts the workers right after this tick (num_nodes_waiting gives the
                    # same decision), so the save answers before any restart: no step is dropped.
                    self._checkpoint_before_change(SaveCause.SCALE_UP, str(change), self._options.save_timeout_s)
        return result

    @property
    def config_error(self) -> bool:
        """Whether this node ends because a worker exited with EX_USAGE or EX_CONFIG (launch.py says so)."""
        return self._config_error

    def _end_on_config_error(self, result: RunResult) -> RunResult:
        self._worker_failed = self._config_error = True
        self._remaining_restarts = 0  # torch's loop then ends this node: launch.py announces the leave
        return result

    def _await_own_verdict(self, worker_group: WorkerGroup) -> RunResult | None:
        """A peer left on a setting error, most often one that every node shares (one command for all): let our
        workers, still running, reach the same verdict (bounded by the membership grace) before stopping them
        for a new round, which would wait for the peer forever. The node-local cases go on as a departure."""
        grace = self._membership.membership_grace_s
        deadline = time.monotonic() + grace
        lifecycle("peer_config_error", why="a peer left on a setting error: waiting for our workers", grace_s=grace)
        while time.monotonic() < deadline:
            result: RunResult = super()._monitor_workers(worker_group)
            if result.state is WorkerState.SUCCEEDED:
                return result
            if result.state is not WorkerState.HEALTHY:
                if self._fatal_exit(result):
                    return self._end_on_config_error(result)
                return None  # broke otherwise: the departure handles it
            time.sleep(0.05)
        return None

    def _fatal_exit(self, result: RunResult) -> bool:
        """Whether a worker exited with EX_USAGE or EX_CONFIG: a bad setting that no restart can fix."""
        fatal = {r: f.exitcode for r, f in result.failures.items() if f.exitcode in FATAL_EXIT_CODES}
        if fatal:
            lifecycle(
                "worker_config_error",
                level=logging.ERROR,
                ranks=",".join(str(r) for r in sorted(fatal)),
                exit_codes=",".join(str(c) for c in sorted(set(fatal.values()))),
                why="a worker exited with EX_USAGE (64) or EX_CONFIG (78): restarting cannot help, this node leaves",
            )
        return bool(fatal)

    def _raise_if_fatal(self) -> None:
        fatal = self._membership.fatal_error
        if fatal is not None:
            raise fatal

    def _failure_is_echo(self, result: RunResult) -> bool:
        """Whether every local worker that failed on its own said a collective broke under it (a peer's
        failure, echoed here); those torch stopped after the first failure (SIGTERM) are not asked."""
        ctx = self._context
        if ctx is None:
            return False
        primary = [f for f in result.failures.values() if f.exitcode != -signal.SIGTERM]
        noted = self.regroup.broken_local_ranks(ctx.round)
        return bool(primary) and all(
            f.local_rank in noted or names_collective_failure(str(f.message or "")) for f in primary
        )

    def _wait_for_membership_change(self, echo: bool) -> Change | None:
        """After a worker failure, wait (bounded) to learn whether a peer's departure or failure caused it."""
        membership = self._membership
        deadline = time.monotonic() + membership.membership_grace_s
        # Peers that report later learn that theirs is an echo of ours; every peer is probed at the next tick.
        membership.report_worker_failure(echo=echo)
        while True:
            self._raise_if_fatal()
            change = membership.membership_change()
            if change is not None:
                return change
            # Pending while the store fails or a peer has not beaten since (bounded by the handler).
            if time.monotonic() >= deadline and not membership.verdict_pending:
                return None
            time.sleep(0.05)

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        for attempt in range(1, RENDEZVOUS_ATTEMPTS + 1):
            try:
                super()._rendezvous(worker_group)
                break
            except DistError as exc:
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
        reason = start_reason(self._previous_world_size, world_size, self._worker_failed)
        failures = spec.max_restarts - self._remaining_restarts
        known = self._membership.round
        round_ = known if known is not None else self._rounds_seen  # job-wide where the handler knows it
        self._rounds_seen += 1
        self._context = LaunchContext(
            run_id=spec.rdzv_handler.get_run_id(),
            restart_count=round_,
            failure_count=failures,
            start_reason=reason,
            previous_world_size=self._previous_world_size,
            round=round_,
            checkpoint_dir=self._options.checkpoint_dir,
            control_dir=str(self.control.directory),
            collective_timeout_s=self._options.collective_timeout_s,
            io_timeout_s=self._options.io_timeout_s,
            generation=self._membership.generation,
            live=self._options.live,
            regroup_timeout_s=self._regroup_timeout_s() if self._options.live else None,
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
        if self._warming:
            for name in _ROUND_VARIABLES:
                worker_env.pop(name, None)
            worker_env.update(to_environ(self._warm_context(spec)))
            worker_env[WARM] = "1"
        elif self._context is not None:
            worker_env.update(to_environ(self._context))
            # One restart count for the whole job, the same on every node (torch's counts local failures).
            worker_env["TORCHELASTIC_RESTART_COUNT"] = str(self._context.restart_count)
        if self._zygote is not None:
            worker_env[ZYGOTE] = "1"

    def _initialize_workers(self, worker_group: WorkerGroup) -> None:
        """torch's first start (a rendezvous, then the workers); --live: the workers first, warm."""
        if self._warm and self._rounds_seen == 0 and self._start_warm(worker_group):
            self._regroup_live(worker_group)  # the round, then its notice to the waiting workers
            self._workers_running = True
            return
        super()._initialize_workers(worker_group)

    def _warm_context(self, spec: WorkerSpec) -> LaunchContext:
        """What a warm worker is told before it has a round: everything but its place in one."""
        return LaunchContext(
            run_id=spec.rdzv_handler.get_run_id(),
            restart_count=0,
            failure_count=0,
            start_reason=StartReason.FIRST_START,
            previous_world_size=None,
            round=-1,
            checkpoint_dir=self._options.checkpoint_dir,
            control_dir=str(self.control.directory),
            collective_timeout_s=self._options.collective_timeout_s,
            io_timeout_s=self._options.io_timeout_s,
            live=True,
            regroup_timeout_s=self._regroup_timeout_s(),
        )

    def _start_warm(self, worker_group: WorkerGroup) -> bool:
        """--live warm join: start the workers before this node joins a round, and join once each one waits.

        A Session built in a warm worker (imports, model, data) waits for the agent's first regroup notice,
        so a node that joins a running job costs the others only the regroup and the state transfer, not
        its cold start. A script that does not wait (it does not use Session) ends for want of a rank;
        then its workers start the usual way, after the rendezvous, for the rest of the run. False then.
        """
        if worker_group.store is None:
            worker_group.store = HashStore()  # type: ignore[assignment]  # torch requires one; warm workers get none
        self._warming = True
        try:
            self._start_tracked(worker_group)
        finally:
            self._warming = False
        self._workers_running = False  # not training yet: a leave now has no checkpoint to ask for
        local_ranks = {w.local_rank for w in worker_group.workers}
        started = time.monotonic()
        lifecycle("workers_warming", workers=len(local_ranks), up_to_s=WARM_START_LIMIT_S)
        while not local_ranks <= set(self.regroup.warm_pids()):
            self._raise_if_left()
            result: RunResult = super()._monitor_workers(worker_group)
            if result.state is not WorkerState.HEALTHY:
                self._warm = False
                codes = sorted({f.exitcode for f in result.failures.values()}) if result.failures else [0]
                lifecycle(
                    "warm_start_unsupported",
                    level=logging.WARNING,
                    exit_codes=",".join(map(str, codes)),
                    why="--live: a worker ended before it waited for its round (a script without Session); "
                    "its workers now start after the rendezvous",
                )
                self._workers_running = False
                self._stop_workers(worker_group)
                worker_group.state = WorkerState.INIT
                return False
            if time.monotonic() - started > WARM_START_LIMIT_S:
                lifecycle("warm_start_slow", level=logging.WARNING, waited_s=WARM_START_LIMIT_S, why="joining now")
                break
            time.sleep(0.05)
        lifecycle("workers_warm", took_s=round(time.monotonic() - started, 3))
        return True

    def _start_tracked(self, worker_group: WorkerGroup) -> None:
        """Start the workers outside torch's own first start: record their ids, and the group as healthy."""
        for local_rank, worker_id in self._start_workers(worker_group).items():
            worker_group.workers[local_rank].id = worker_id
        worker_group.state = WorkerState.HEALTHY

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self._raise_if_left()
        self.regroup.forget_workers()  # the new workers say again whether they can regroup
        self._fenced = self._left_behind = False
        self._workers_exited = False
        with zygote.forking_from(self._zygote):
            pids: dict[int, Any] = super()._start_workers(worker_group)
        # torch's process context installs its own signal handlers on every start; SIGTERM is ours.
        self._install_sigterm()
        self._workers_running = True
        ctx = self._context
        lifecycle(
            "workers_started",
            round=ctx.round if ctx else None,
            reason=ctx.start_reason.value if ctx else None,
            pids=",".join(str(p) for p in pids.values()),
        )
        return pids

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        if self._defer_for_finishing(worker_group):
            return
        if self._live_capable(worker_group):
            self._regroup_live(worker_group)
            return
        lifecycle(
            "workers_restarting",
            level=logging.WARNING,
            cause="worker_failure" if self._worker_failed else "membership_change",
            remaining_restarts=self._remaining_restarts,
        )
        self._workers_running = False
        super()._restart_workers(worker_group)

    def _finishing(self, worker_group: WorkerGroup) -> bool:
        """Every local worker said its training is over (Session.close): it ends on its own, soon."""
        if self._worker_failed or self._workers_exited or not self._workers_running:
            return False
        local_ranks = {w.local_rank for w in worker_group.workers}
        return bool(local_ranks) and local_ranks <= set(self.regroup.finishing_pids())

    def _defer_for_finishing(self, worker_group: WorkerGroup) -> bool:
        """A membership change while the workers close (their last save, then exit) waits for them to exit,
        bounded: a restart would redo the finished job, and a save request or regroup notice is never read."""
        if not self._finishing(worker_group):
            self._deferred_since = None
            return False
        now = time.monotonic()
        bound = self._options.save_timeout_s + self._ack_wait_s()
        if self._deferred_since is None:
            self._deferred_since = now
            lifecycle("membership_change_deferred", why="the workers finished training and are closing", up_to_s=bound)
        if now - self._deferred_since <= bound:
            return True
        lifecycle("finishing_slow", level=logging.WARNING, waited_s=round(bound, 3), why="restarting for the change")
        return False

    # -- live reconfiguration (--live) -------------------------------------------------------------
    def _ack_wait_s(self) -> float:
        """How long the agent waits for its workers to acknowledge a regroup notice before it restarts them."""
        return self._options.collective_timeout_s + REGROUP_ACK_MARGIN_S

    def _regroup_timeout_s(self) -> float:
        """How long a live worker waits for a regroup notice after its collective broke, and for the members
        of a new round to join it: the agent's wait for acknowledgements, plus a restarted worker's cold start."""
        return self._ack_wait_s() + COLD_START_ALLOWANCE_S

    def _probe_if_a_worker_broke(self) -> None:
        """--live: a worker whose collective broke stays alive and says so; probe the peers now (a dead
        peer's refused probe is found at the next heartbeat tick instead of after its timeout)."""
        if not self._options.live or self._context is None:
            return
        broken = self.regroup.broken_round()
        if broken is None or broken < self._context.round or broken == self._probed_round:
            return
        self._probed_round = broken
        self._membership.probe_peers()
        lifecycle("peers_probed", round=broken, why="a worker's collective broke")

    def _live_capable(self, worker_group: WorkerGroup) -> bool:
        """Live mode is on, the workers are running and healthy, and every one said it can regroup."""
        if not self._options.live or self._worker_failed or self._workers_exited or not self._workers_running:
            return False
        if self._fenced:
            return False  # restarted instead: they join the winners' world without state, and receive theirs
        if worker_group.state is not WorkerState.HEALTHY:
            return False
        local_ranks = {w.local_rank for w in worker_group.workers}
        return bool(local_ranks) and local_ranks <= set(self.regroup.live_pids())

    def _regroup_live(self, worker_group: WorkerGroup) -> None:
        """Form the new round and move the running workers into it; restart them only if they do not answer."""
        started = time.monotonic()
        old_world_size = self._previous_world_size
        ids = {w.local_rank: w.id for w in worker_group.workers}
        self._rendezvous(worker_group)
        for worker in worker_group.workers:  # the same processes, in the new round's ranks
            worker.id = ids.get(worker.local_rank)
        ctx = self._context
        if ctx is None or not worker_group.workers:
            raise RuntimeError("internal: a completed rendezvous left no launch context")
        notice = RegroupNotice(
            round=ctx.round,
            generation=ctx.generation,
            world_size=worker_group.workers[0].world_size,
            group_rank=int(worker_group.group_rank or 0),
            group_world_size=int(worker_group.group_world_size or 1),
            ranks={w.local_rank: w.global_rank for w in worker_group.workers},
            master_addr=str(worker_group.master_addr),
            master_port=int(worker_group.master_port or 0),
            start_reason=ctx.start_reason.value,
            previous_world_size=old_world_size,
            announced_at=time.time(),
            no_departure=self._membership.kept_every_member,
            superseded=self._left_behind,
        )
        self._left_behind = False
        self.regroup.announce(notice)
        lifecycle("regroup_announced", round=notice.round, world_size=f"{old_world_size}->{notice.world_size}")
        wait_s = self._ack_wait_s()
        missing = self._wait_regroup_acks(worker_group, notice, wait_s)
        if missing is None:
            return  # a worker ended meanwhile: the next monitor tick reports how (success or failure)
        if not missing:
            worker_group.state = WorkerState.HEALTHY
            lifecycle(
                "workers_regrouped",
                round=notice.round,
                world_size=f"{old_world_size}->{notice.world_size}",
                took_s=round(time.monotonic() - started, 3),
            )
            return
        # Fallback: today's restart, into the round just formed (the other nodes' workers wait in it).
        lifecycle(
            "regroup_fallback",
            level=logging.WARNING,
            round=notice.round,
            unanswered_local_ranks=",".join(map(str, missing)),
            waited_s=wait_s,
        )
        self._workers_running = False
        self._stop_workers(worker_group)
        worker_group.state = WorkerState.STOPPED
        self._start_tracked(worker_group)

    def _wait_regroup_acks(self, worker_group: WorkerGroup, notice: RegroupNotice, wait_s: float) -> list[int] | None:
        """The local ranks that did not acknowledge ``notice`` within ``wait_s``; None if a worker ended first
        (one that finished its training as the change came, or died: restarting it would be wrong either way)."""
        deadline = time.monotonic() + wait_s
        while True:
            missing = self.regroup.wait_acks(
                sorted(notice.ranks), notice.round, min(0.5, max(0.0, deadline - time.monotonic()))
            )
            if not missing or time.monotonic() >= deadline:
                return missing
            result: RunResult = super()._monitor_workers(worker_group)
            if result.state is not WorkerState.HEALTHY:
                lifecycle(
                    "regroup_unanswered",
                    level=logging.WARNING,
                    round=notice.round,
                    workers=result.state.name.lower(),
                    why="a worker ended before it acknowledged the regroup",
                )
                return None
