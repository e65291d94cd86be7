"""The failure verdict: whether a worker failure is this node's own, a membership change, or a setting error.

A worker failure within the membership grace of a change (a peer died, left or was evicted) is that
change, not a failure: it uses no ``--max-restarts``. A worker that exits with EX_USAGE (64) or EX_CONFIG
(78) names a bad setting that no restart can fix: this node leaves. A peer that left on a setting error
most often shares it (one command for all): this node's workers, still running, are given the grace to
reach the same verdict. Membership is asked only through :class:`~elastrain.rendezvous.api.Membership`.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

from elastrain.collective_failure import names_collective_failure
from elastrain.control import RegroupChannel
from elastrain.env import LaunchContext
from elastrain.errors import FATAL_EXIT_CODES, UsageError
from elastrain.log import lifecycle
from elastrain.rendezvous.api import Membership
from elastrain.rendezvous.state import Change


def fatal_exit(result: RunResult) -> bool:
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


def static_rendezvous_failed(handler: StaticTCPRendezvous, exc: BaseException) -> UsageError:
    """torch's static rendezvous (``--nnodes N`` without ``--rdzv-backend``, torchrun's default) failed at its store:
    most often two nodes were given one ``--node-rank`` (both host the store: the second one's port is taken), or
    node 0 is not up at the address the others were given. One line naming the flags, not torch's traceback and
    no retry: that rendezvous has one round only."""
    endpoint = f"{handler.master_addr}:{handler.master_port}"
    return UsageError(
        "--node-rank",
        f"the static rendezvous (--nnodes {handler.world_size} without --rdzv-backend) failed as node "
        f"{handler.rank} at {endpoint}: {str(exc).splitlines()[0][:200]}; give each node its own --node-rank "
        f"(0 to {handler.world_size - 1}; node 0 hosts the store at --master-addr/--master-port), or use "
        "--rdzv-backend c10d, where no node needs a rank",
    )


def failed_on_their_own(result: RunResult) -> list[ProcessFailure]:
    """The local workers that failed on their own: not those torch stopped after the first failure (SIGTERM)."""
    return [f for f in result.failures.values() if f.exitcode != -signal.SIGTERM]


def killed_outright(result: RunResult) -> bool:
    """Whether every local worker that failed on its own was SIGKILLed (the kernel's OOM killer, an operator, a
    chaos tool): this node's own failure, which no peer's departure causes (a peer's shows as an error in a
    collective, or as an abort from one)."""
    primary = failed_on_their_own(result)
    return bool(primary) and all(f.exitcode == -signal.SIGKILL for f in primary)


class FailureVerdict:
    """Judges this node's worker failures against membership (bounded by its grace)."""

    def __init__(self, membership: Membership, regroup: RegroupChannel) -> None:
        self._membership = membership
        self._regroup = regroup

    def raise_if_fatal(self) -> None:
        """Raise the error that ends this node, if membership has one (the store is lost, a foreign job...)."""
        fatal = self._membership.fatal_error
        if fatal is not None:
            raise fatal

    def is_echo(self, result: RunResult, ctx: LaunchContext | None) -> bool:
        """Whether every local worker that failed on its own said a collective broke under it (a peer's
        failure, echoed here); those torch stopped after the first failure (SIGTERM) are not asked."""
        if ctx is None:
            return False
        primary = failed_on_their_own(result)
        noted = self._regroup.broken_local_ranks(ctx.round)
        return bool(primary) and all(
            f.local_rank in noted or names_collective_failure(str(f.message or "")) for f in primary
        )

    def wait_for_membership_change(self, echo: bool, own: bool = False) -> Change | None:
        """After a worker failure, wait (bounded) to learn whether a peer's departure or failure caused it.

        ``own``: no peer can have caused it (:func:`killed_outright`): a change already known is still taken, but
        none is waited for beyond the peers' next beat."""
        membership = self._membership
        deadline = time.monotonic() + (0.0 if own else membership.membership_grace_s)
        # Peers that report later learn that theirs is an echo of ours; every peer is probed at the next tick.
        membership.report_worker_failure(echo=echo)
        while True:
            self.raise_if_fatal()
            change = membership.membership_change()
            if change is not None:
                return change
            # Pending while the store fails or a peer has not beaten since (bounded by the handler).
            if time.monotonic() >= deadline and not membership.verdict_pending:
                return None
            time.sleep(0.05)

    def await_own_verdict(self, poll: Callable[[], RunResult]) -> RunResult | None:
        """A peer left on a setting error, most often one that every node shares (one command for all): let our
        workers, still running, reach the same verdict (bounded by the membership grace) before stopping them
        for a new round, which would wait for the peer forever. The node-local cases go on as a departure.

        ``poll``: torch's check of the workers. Returns their result if they succeeded or exited on a setting
        error (:func:`fatal_exit`); ``None`` if they broke otherwise or still run at the grace's end.
        """
        grace = self._membership.membership_grace_s
        deadline = time.monotonic() + grace
        lifecycle("peer_config_error", why="a peer left on a setting error: waiting for our workers", grace_s=grace)
        while time.monotonic() < deadline:
            result = poll()
            if result.state is WorkerState.SUCCEEDED:
                return result
            if result.state is not WorkerState.HEALTHY:
                if fatal_exit(result):
                    return result
                return None  # broke otherwise: the departure handles it
            time.sleep(0.05)
        return None
