"""--live: a node's first workers start *warm*, before it joins a round.

They build what they can (imports, model, data) and wait for the agent's first regroup notice, so that joining a
running job costs the others only the regroup, not the new node's cold start. A script that does not wait for its
round (no Session, no Trainer) ends for want of a rank: its workers then start after the rendezvous for the rest of the
run. Warm workers that die while their node waits for its first round (a spare's standby) start again in that round,
cold (:meth:`WarmStart.lost`).
"""

from __future__ import annotations

import logging
import time

from torch._C._distributed_c10d import HashStore
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState

from elastrain.control import RegroupChannel
from elastrain.env import WARM, LaunchContext, to_environ
from elastrain.launcher.phase import Phase
from elastrain.launcher.worker_host import WorkerHost
from elastrain.log import lifecycle
from elastrain.rendezvous.api import Membership

# --live: how long a node waits for its warm workers (imports, model, data) before it joins anyway; then
# the round waits for the rest of their start, as it would for a cold one.
WARM_START_LIMIT_S = 600.0
# What a warm worker is not told (torch sets them from a round it does not have yet): a script that reads
# them before the first notice fails at once instead of training alone.
ROUND_VARIABLES = (
    "RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"
)  # fmt: skip


def tell_warm(worker_env: dict[str, str | None], ctx: LaunchContext) -> None:
    """Make ``worker_env`` a warm worker's: no place in a round, everything else of ``ctx``."""
    for name in ROUND_VARIABLES:
        worker_env.pop(name, None)
    worker_env.update(to_environ(ctx))
    worker_env[WARM] = "1"


def exit_codes(result: RunResult) -> list[int]:
    """The distinct exit codes of ``result``'s failed workers, in order; ``[0]`` when none failed (they exited)."""
    return sorted({f.exitcode for f in result.failures.values()}) if result.failures else [0]


class WarmStart:
    """One node's warm start, for the agent ``host``: the workers first, then the node's first round."""

    def __init__(self, host: WorkerHost, membership: Membership, regroup: RegroupChannel, enabled: bool) -> None:
        self._host = host
        self._membership = membership
        self._regroup = regroup
        self.enabled = enabled
        """Whether the first workers start before the rendezvous: scripts that wait for their round only."""
        self.job_forming = False
        """Whether no round had formed when the warm workers started (they may found the job)."""
        self._unjoined = False  # warm workers wait for this node's first round (start, then the first regroup)
        self._warmed_again = False  # a signal ended the warm workers while they built once: started warm again

    def start(self, worker_group: WorkerGroup) -> bool:
        """--live warm join: start the workers before this node joins a round, and join once each one waits.

        A Session built in a warm worker (imports, model, data) waits for the agent's first regroup notice,
        so a node that joins a running job costs the others only the regroup and the state transfer, not
        its cold start. A script that does not wait (it does not use Session) ends for want of a rank;
        then its workers start the usual way, after the rendezvous, for the rest of the run. False then.
        """
        if worker_group.store is None:
            worker_group.store = HashStore()  # type: ignore[assignment]  # torch requires one; warm workers get none
        self._start_warming(worker_group)
        started = time.monotonic()
        # Read while the workers load (a store that does not answer delays no worker): whether this node may found
        # the job. Its workers that wait to know are told when the job formed without it (never: a member of round 0).
        self.job_forming = self._membership.job_formed() is False
        if self.job_forming:
            self._membership.on_formed_without_this_node(lambda: self._regroup.tell_job_forming(False))
        self._regroup.tell_job_forming(self.job_forming)
        lifecycle("workers_warming", workers=len(worker_group.workers), up_to_s=WARM_START_LIMIT_S)
        if not self._await(worker_group, started, deciding=None):
            return False
        if self.job_forming and self._regroup.warm_pids(deciding=True) and self._membership.job_formed():
            # It formed while they were built: they evaluate alone first, then wait for a round where they train.
            self._regroup.tell_job_forming(False)
            lifecycle("job_formed_meanwhile", why="this node joins a job that trains on: its workers are told so")
            if not self._await(worker_group, started, deciding=False):
                return False
        lifecycle("workers_warm", took_s=round(time.monotonic() - started, 3))
        self._unjoined = True
        return True

    def _await(self, worker_group: WorkerGroup, started: float, deciding: bool | None) -> bool:
        """Wait until every worker waits for its round (``deciding=False``: none of them waiting to know whether
        this node founds the job). False if one ended first: the workers then start after the rendezvous."""
        host = self._host
        local_ranks = {w.local_rank for w in worker_group.workers}
        while not local_ranks <= set(self._regroup.warm_pids(deciding)):
            host.raise_if_left()
            result = host.poll_workers(worker_group)
            if result.state is not WorkerState.HEALTHY:
                codes = exit_codes(result)
                if self._warm_again(worker_group, codes):
                    continue
                self.enabled = False
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

    def _warm_again(self, worker_group: WorkerGroup, codes: list[int]) -> bool:
        """Start the workers warm again, once, if a signal ended them while they built (an out-of-memory kill, an
        operator's kill: a negative exit code), not a script that cannot wait (it exits on its own, for want of a
        rank). Before, that too ended the warm start, and the node's round waited for its workers' whole build."""
        if self._warmed_again or not all(code < 0 for code in codes):
            return False
        self._warmed_again = True
        lifecycle(
            "warm_worker_lost",
            level=logging.WARNING,
            exit_codes=",".join(map(str, codes)),
            why="a warm worker was killed while it built: its workers start warm again (once)",
        )
        host = self._host
        host.phase = host.phase.stopped()
        host.stop_workers(worker_group)
        self._start_warming(worker_group)
        return True

    def _start_warming(self, worker_group: WorkerGroup) -> None:
        host = self._host
        host.phase = Phase.WARMING
        try:
            host.start_workers_tracked(worker_group)
        finally:
            if host.phase is Phase.WARMING:
                host.phase = Phase.IDLE
        host.phase = host.phase.stopped()  # not training yet: a leave now has no checkpoint to ask for

    def lost(self, worker_group: WorkerGroup, round_: int) -> bool:
        """Whether this node's warm workers died while it waited for its first round (a spare's standby can last hours:
        an out-of-memory kill, an operator's kill); their round is then the one just formed, and they start again in
        it, cold, as a node that joins without a warm start does. Not a failure counted against --max-restarts: they
        never trained. Before, the node found its dead worker only after it had joined the round and left it (with
        --max-restarts 0) or forced a round more."""
        if not self._unjoined:
            return False
        self._unjoined = False
        result = self._host.poll_workers(worker_group)
        if result.state is not WorkerState.FAILED:
            return False
        lifecycle(
            "warm_worker_lost",
            level=logging.WARNING,
            round=round_,
            exit_codes=",".join(map(str, exit_codes(result))),
            why="a warm worker died while this node waited for its round: its workers start again, cold, into it",
        )
        return True
