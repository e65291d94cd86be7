"""The agent's side of a live regroup (``--live``): regroup notice, acknowledgements, fallback.

A membership change whose local workers are all alive and said they can regroup (scripts that use
:class:`elastrain.session.Session`) does not restart them: the agent completes the new round, writes a
regroup notice to the control channel and waits (bounded) for every local worker to acknowledge it; the
workers join the new round's group in place (:mod:`elastrain.live`). Workers that cannot, or do not
acknowledge in time, are restarted into the same round (the fallback). When a local worker fails on its own
(an out-of-memory kill, a crash), the others keep running and move in place the same way, and only the failed
one starts again, into the new round, where it receives the state from them: nothing is read from a checkpoint,
even on a node alone in its job.

A node's first workers may start *warm*, before it joins a round (:mod:`elastrain.launcher.warm_start`); its first
regroup is their notice. Workers that finished their training (they said so) are let exit before a change restarts
them; a worker whose collective broke makes the agent probe its peers at once.

The agent runs the workers; this module asks it for what it needs through
:class:`~elastrain.launcher.worker_host.WorkerHost`.
"""

from __future__ import annotations

import logging
import time

from torch.distributed.elastic.agent.server.api import WorkerGroup, WorkerState
from torch.distributed.elastic.multiprocessing.api import PContext

from elastrain.control import RegroupChannel, RegroupNotice
from elastrain.launcher.options import ElastrainOptions
from elastrain.launcher.phase import Phase
from elastrain.launcher.warm_start import WarmStart
from elastrain.launcher.worker_host import WorkerHost
from elastrain.launcher.zygote import ZygoteContext, ZygoteError
from elastrain.log import lifecycle
from elastrain.rendezvous.api import Membership

# --live: a worker stuck in a collective that cannot be given up waits at most --collective-timeout;
# the agent waits that long plus this margin for its acknowledgement before it restarts it instead.
REGROUP_ACK_MARGIN_S = 10.0
# A worker restarted by the fallback needs this long to import torch and join; live members wait for it.
COLD_START_ALLOWANCE_S = 30.0


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


class LiveCoordination:
    """One node's live regroups (its warm start: :attr:`warm`), for the agent ``host``."""

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
        self.warm = WarmStart(host, membership, regroup, warm_start)
        self._deferred_since: float | None = None  # when a membership change began to wait for closing workers
        self._probed_round: int | None = None  # the last broken round whose peers were probed
        self._unjoined_round: int | None = None  # a round this node's workers ended before they joined
        self._compiling_told: int | None = None  # the last round whose ack wait a compiling worker extended

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
        lost = self.warm.lost(worker_group, ctx.round)
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
