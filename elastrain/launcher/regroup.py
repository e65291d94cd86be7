"""The agent's side of a live regroup (``--live``): warm start, regroup notice, acknowledgements, fallback.

A membership change whose local workers are all alive and said they can regroup (scripts that use
:class:`elastrain.session.Session`) does not restart them: the agent completes the new round, writes a
regroup notice to the control channel and waits (bounded) for every local worker to acknowledge it; the
workers join the new round's group in place (:mod:`elastrain.live`). Workers that cannot, or do not
acknowledge in time, are restarted into the same round (the fallback). When a local worker fails on its own
(an out-of-memory kill, a crash), the others keep running and move in place the same way, and only the failed
one starts again, into the new round, where it receives the state from them: nothing is read from a checkpoint,
even on a node alone in its job.

A node's first workers may start *warm*, before it joins a round: they build what they can (imports,
model, data) and wait for the first regroup notice, so that joining a running job costs the others
only the regroup, not the new node's cold start. Workers that finished their training (they said so)
are let exit before a change restarts them; a worker whose collective broke makes the agent probe its
peers at once.

The agent runs the workers; this module asks it for what it needs through :class:`WorkerHost`.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from torch._C._distributed_c10d import HashStore
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.multiprocessing.api import PContext

from elastrain.control import RegroupChannel, RegroupNotice
from elastrain.env import WARM, LaunchContext, to_environ
from elastrain.launcher.options import ElastrainOptions
from elastrain.launcher.phase import Phase
from elastrain.launcher.zygote import ZygoteContext, ZygoteError
from elastrain.log import lifecycle
from elastrain.rendezvous.api import Membership

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
ROUND_VARIABLES = (
    "RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"
)  # fmt: skip


def ack_wait_s(options: ElastrainOptions) -> float:
    """How long the agent waits for its workers to acknowledge a regroup notice before it restarts them."""
    return options.collective_timeout_s + REGROUP_ACK_MARGIN_S


COMPILING = "a worker compiles in its world's first step: it answers at the step's end"


def compiling_until(regroup: RegroupChannel, missing: list[int]) -> float | None:
    """When (monotonic) to stop waiting for the ``missing`` workers that are in a new world's first step with a longer
    bound (a compiled model compiles there: ``FIRST_STEP_TIMEOUT_S`` in elastrain/live/group.py, or
    --first-step-timeout): they answer a notice at the step's end, as late as they announced, plus the margin; None if
    none is."""
    now_wall = time.time()
    until = [u for r in missing if (u := regroup.first_step_until(r)) is not None and u > now_wall]
    return time.monotonic() + max(until) - now_wall + REGROUP_ACK_MARGIN_S if until else None


def regroup_timeout_s(options: ElastrainOptions) -> float:
    """How long a live worker waits for a regroup notice after its collective broke, and for the members
    of a new round to join it: the agent's wait for acknowledgements, plus a restarted worker's cold start."""
    return ack_wait_s(options) + COLD_START_ALLOWANCE_S


def tell_warm(worker_env: dict[str, str | None], ctx: LaunchContext) -> None:
    """Make ``worker_env`` a warm worker's: no place in a round, everything else of ``ctx``."""
    for name in ROUND_VARIABLES:
        worker_env.pop(name, None)
    worker_env.update(to_environ(ctx))
    worker_env[WARM] = "1"


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


class LiveCoordination:
    """One node's live regroups and warm start, for the agent ``host``."""

    def __init__(
        self,
        host: WorkerHost,
        membership: Membership,
        regroup: RegroupChannel,
        options: ElastrainOptions,
        warm_start: bool,
    ) -> None:
        self._host = host
        self._membership = membership
        self._regroup = regroup
        self._options = options
        # The first workers start before the rendezvous (see start_warm): scripts that wait for their round only.
        self.warm_start = warm_start
        self.job_forming = False
        """Whether no round had formed when the warm workers started (they may found the job)."""
        self._deferred_since: float | None = None  # when a membership change began to wait for closing workers
        self._probed_round: int | None = None  # the last broken round whose peers were probed
        self._unjoined_round: int | None = None  # a round this node's workers ended before they joined
        self._compiling_told: int | None = None  # the last round whose ack wait a compiling worker extended
        self._warm_unjoined = False  # warm workers wait for this node's first round (start_warm, then regroup)

    # -- a change while the workers finish ---------------------------------------------------------
    def finishing(self, worker_group: WorkerGroup) -> bool:
        """Every local worker said its training is over (Session.close): it ends on its own, soon."""
        if not self._host.phase.in_place:
            return False
        local_ranks = {w.local_rank for w in worker_group.workers}
        return bool(local_ranks) and local_ranks <= set(self._regroup.finishing_pids())

    def defer_for_finishing(self, worker_group: WorkerGroup) -> bool:
        """A membership change while the workers close (their last save, then exit) waits for them to exit,
        bounded: a restart would redo the finished job, and a save request or regroup notice is never read."""
        if not self.finishing(worker_group):
            self._deferred_since = None
            return False
        now = time.monotonic()
        bound = self._options.save_timeout_s + ack_wait_s(self._options)
        if self._deferred_since is None:
            self._deferred_since = now
            lifecycle("membership_change_deferred", why="the workers finished training and are closing", up_to_s=bound)
        if now - self._deferred_since <= bound:
            return True
        lifecycle("finishing_slow", level=logging.WARNING, waited_s=round(bound, 3), why="restarting for the change")
        return False

    def ended_before_round(self) -> bool:
        """Whether this node's workers ended before they joined its current round (they finished training as it
        formed): that round never trained, and its other members wait in it for workers that never come."""
        ctx = self._host.context
        return ctx is not None and self._unjoined_round == ctx.round

    # -- live regroup ------------------------------------------------------------------------------
    def probe_if_a_worker_broke(self) -> None:
        """--live: a worker whose collective broke stays alive and says so; probe the peers now (a dead
        peer's refused probe is found at the next heartbeat tick instead of after its timeout)."""
        ctx = self._host.context
        if not self._options.live or ctx is None:
            return
        broken = self._regroup.broken_round()
        if broken is None or broken < ctx.round or broken == self._probed_round:
            return
        self._probed_round = broken
        self._membership.probe_peers()
        lifecycle("peers_probed", round=broken, why="a worker's collective broke")

    def capable(self, worker_group: WorkerGroup) -> bool:
        """Live mode is on, the workers are running and healthy, and every one said it can regroup."""
        if not self._options.live or not self._host.phase.in_place:
            return False
        if self._host.phase is Phase.FENCED:
            return False  # restarted instead: they join the winners' world without state, and receive theirs
        if worker_group.state is not WorkerState.HEALTHY:
            return False
        local_ranks = {w.local_rank for w in worker_group.workers}
        return bool(local_ranks) and local_ranks <= set(self._regroup.live_pids())

    def keeps(self, survivors: frozenset[int]) -> bool:
        """When some local workers failed: whether the others, ``survivors``, keep running (--live, each said it can
        regroup) to move to the next round in place, while only the failed ones start again (:meth:`regroup` with
        ``replaced``); otherwise they are stopped with them and all start again, as torch's agent does."""
        phase = self._host.phase
        if not self._options.live or not phase.in_place or phase is Phase.FENCED:
            return False
        return survivors <= set(self._regroup.live_pids())

    def replaceable(self, pcontext: PContext | None) -> frozenset[int]:
        """After a failure: the local ranks whose worker failed while the others were kept running (:meth:`keeps`)
        and still run, so that only they start again (none: every local worker restarts)."""
        if not isinstance(pcontext, ZygoteContext) or self._host.phase not in (Phase.FAILED, Phase.EXITED):
            return frozenset()
        failed, running = pcontext.failed_ranks(), pcontext.running_ranks()
        if not failed or not running or not running <= set(self._regroup.live_pids()):
            return frozenset()
        return failed

    def regroup(self, worker_group: WorkerGroup, replaced: frozenset[int] = frozenset()) -> None:
        """Form the new round and move the running workers into it; restart them only if they do not answer.

        ``replaced``: local ranks whose worker failed; a new one starts for each into the round (a cold start that
        receives the state from the others), while the rest move in place."""
        host = self._host
        started = time.monotonic()
        ids = {w.local_rank: w.id for w in worker_group.workers}
        host.form_round(worker_group)
        for worker in worker_group.workers:  # the same processes, in the new round's ranks
            worker.id = ids.get(worker.local_rank)
        ctx = host.context
        if ctx is None or not worker_group.workers:
            raise RuntimeError("internal: a completed rendezvous left no launch context")
        old_world_size = ctx.previous_world_size
        lost = self._warm_lost(worker_group, ctx.round)
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
            no_departure=self._membership.kept_every_member and not replaced and not lost,
            # Left behind: told while running (this round superseded, evicted) or found in forming the new round.
            superseded=host.phase is Phase.LEFT_BEHIND or self._membership.left_behind,
            first_round=ctx.first_round,
        )
        if host.phase is Phase.LEFT_BEHIND:
            host.phase = Phase.RUNNING  # dealt with: the notice says so
        self._regroup.announce(notice)
        lifecycle("regroup_announced", round=notice.round, world_size=f"{old_world_size}->{notice.world_size}")
        if lost:
            self._restart_all(worker_group)  # cold, into the round just formed: its other members wait for them
            return
        if replaced and not self._replace(worker_group, replaced):
            return
        wait_s = ack_wait_s(self._options)
        missing = self._wait_acks(worker_group, notice, wait_s, replaced)
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
        self._restart_all(worker_group)

    def _warm_lost(self, worker_group: WorkerGroup, round_: int) -> bool:
        """Whether this node's warm workers died while it waited for its first round (a spare's standby can last hours:
        an out-of-memory kill, an operator's kill); their round is then the one just formed, and they start again in
        it, cold, as a node that joins without a warm start does. Not a failure counted against --max-restarts: they
        never trained. Before, the node found its dead worker only after it had joined the round and left it (with
        --max-restarts 0) or forced a round more."""
        if not self._warm_unjoined:
            return False
        self._warm_unjoined = False
        result = self._host.poll_workers(worker_group)
        if result.state is not WorkerState.FAILED:
            return False
        lifecycle(
            "warm_worker_lost",
            level=logging.WARNING,
            round=round_,
            exit_codes=",".join(map(str, sorted({f.exitcode for f in result.failures.values()}))),
            why="a warm worker died while this node waited for its round: its workers start again, cold, into it",
        )
        return True

    def _restart_all(self, worker_group: WorkerGroup) -> None:
        host = self._host
        host.phase = host.phase.stopped()
        host.stop_workers(worker_group)
        worker_group.state = WorkerState.STOPPED
        host.start_workers_tracked(worker_group)

    def _replace(self, worker_group: WorkerGroup, replaced: frozenset[int]) -> bool:
        """Start the new workers for ``replaced``; if that fails, restart every local worker into the round instead
        (False: nothing is left to wait for)."""
        host = self._host
        try:
            host.replace_workers(worker_group, replaced)
        except ZygoteError as exc:
            lifecycle("worker_replace_failed", level=logging.WARNING, error=str(exc)[:200], action="restarting all")
            self._restart_all(worker_group)
            return False
        host.phase = host.phase.without_change()
        return True

    def _wait_acks(
        self, worker_group: WorkerGroup, notice: RegroupNotice, wait_s: float, replaced: frozenset[int] = frozenset()
    ) -> list[int] | None:
        """The local ranks that did not acknowledge ``notice`` within ``wait_s`` (those ``replaced`` just started
        in its round: none is asked); None if a worker ended first (one that finished its training as the change
        came, or died: restarting it would be wrong either way)."""
        deadline = time.monotonic() + wait_s
        asked = sorted(set(notice.ranks) - replaced)
        while True:
            missing = self._regroup.wait_acks(asked, notice.round, min(0.5, max(0.0, deadline - time.monotonic())))
            if missing and time.monotonic() >= deadline and (until := compiling_until(self._regroup, missing)):
                if self._compiling_told != notice.round:
                    self._compiling_told = notice.round
                    up_to = round(until - time.monotonic(), 1)
                    lifecycle("regroup_ack_extended", round=notice.round, up_to_s=up_to, why=COMPILING)
                deadline = max(deadline, until)
            if not missing or time.monotonic() >= deadline:
                return missing
            result = self._host.poll_workers(worker_group)
            if result.state is not WorkerState.HEALTHY:
                if result.state is WorkerState.SUCCEEDED:  # a failure restarts them into another round
                    self._unjoined_round = notice.round
                lifecycle(
                    "regroup_unanswered",
                    level=logging.WARNING,
                    round=notice.round,
                    workers=result.state.name.lower(),
                    why="a worker ended before it acknowledged the regroup",
                )
                return None

    # -- warm start --------------------------------------------------------------------------------
    def start_warm(self, worker_group: WorkerGroup) -> bool:
        """--live warm join: start the workers before this node joins a round, and join once each one waits.

        A Session built in a warm worker (imports, model, data) waits for the agent's first regroup notice,
        so a node that joins a running job costs the others only the regroup and the state transfer, not
        its cold start. A script that does not wait (it does not use Session) ends for want of a rank;
        then its workers start the usual way, after the rendezvous, for the rest of the run. False then.
        """
        host = self._host
        if worker_group.store is None:
            worker_group.store = HashStore()  # type: ignore[assignment]  # torch requires one; warm workers get none
        host.phase = Phase.WARMING
        try:
            host.start_workers_tracked(worker_group)
        finally:
            if host.phase is Phase.WARMING:
                host.phase = Phase.IDLE
        host.phase = host.phase.stopped()  # not training yet: a leave now has no checkpoint to ask for
        started = time.monotonic()
        # Read while the workers load (a store that does not answer delays no worker): whether this node may found
        # the job. Its workers that wait to know are told when the job formed without it (never: a member of round 0).
        self.job_forming = self._membership.job_formed() is False
        if self.job_forming:
            self._membership.on_formed_without_this_node(lambda: self._regroup.tell_job_forming(False))
        self._regroup.tell_job_forming(self.job_forming)
        lifecycle("workers_warming", workers=len(worker_group.workers), up_to_s=WARM_START_LIMIT_S)
        if not self._await_warm(worker_group, started, deciding=None):
            return False
        if self.job_forming and self._regroup.warm_pids(deciding=True) and self._membership.job_formed():
            # It formed while they were built: they evaluate alone first, then wait for a round where they train.
            self._regroup.tell_job_forming(False)
            lifecycle("job_formed_meanwhile", why="this node joins a job that trains on: its workers are told so")
            if not self._await_warm(worker_group, started, deciding=False):
                return False
        lifecycle("workers_warm", took_s=round(time.monotonic() - started, 3))
        self._warm_unjoined = True
        return True

    def _await_warm(self, worker_group: WorkerGroup, started: float, deciding: bool | None) -> bool:
        """Wait until every worker waits for its round (``deciding=False``: none of them waiting to know whether
        this node founds the job). False if one ended first: the workers then start after the rendezvous."""
        host = self._host
        local_ranks = {w.local_rank for w in worker_group.workers}
        while not local_ranks <= set(self._regroup.warm_pids(deciding)):
            host.raise_if_left()
            result = host.poll_workers(worker_group)
            if result.state is not WorkerState.HEALTHY:
                self.warm_start = False
                codes = sorted({f.exitcode for f in result.failures.values()}) if result.failures else [0]
                lifecycle(
                    "warm_start_unsupported",
                    level=logging.WARNING,
                    exit_codes=",".join(map(str, codes)),
                    why="--live: a worker ended before it waited for its round (a script that does not wait: no "
                    "Session, or a Trainer that restarts at every change); its workers now start after the rendezvous",
                )
                host.phase = host.phase.stopped()
                host.stop_workers(worker_group)
                worker_group.state = WorkerState.INIT
                return False
            if time.monotonic() - started > WARM_START_LIMIT_S:
                lifecycle("warm_start_slow", level=logging.WARNING, waited_s=WARM_START_LIMIT_S, why="joining now")
                break
            time.sleep(0.05)
        return True
