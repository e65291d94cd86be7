"""A live worker's membership: which round it is in, the agent's notices, and its training group.

:class:`LiveMember` is what :class:`elastrain.session.Session` holds in live mode. It joins the
round the worker was started into, tells the agent that this worker can regroup in place, and on a
notice moves the process group to the next round: the round's :class:`~elastrain.env.WorkerEnv`
(rank, world size, round, fencing generation) built and returned to the session, which hands it on;
the old group left, the new one joined. The process's environment variables follow the round as well,
for the script's own reads (torch's RANK, WORLD_SIZE, GROUP_RANK, MASTER_*).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping

from elastrain import fence, pids
from elastrain.control import RegroupChannel, RegroupNotice
from elastrain.env import (
    AGENT_PID,
    FIRST_ROUND,
    GENERATION,
    PREVIOUS_WORLD_SIZE,
    WARM,
    LaunchContext,
    StartReason,
    WorkerEnv,
    regrouped_environ,
)
from elastrain.errors import ElastrainError
from elastrain.live.group import JoinAbandonedError, TrainingGroup
from elastrain.live.receive_pool import ReceivePool
from elastrain.live.watchdog import Watchdog
from elastrain.log import lifecycle

FIRST_JOIN_ROUNDS = 10
"""Rounds in a row a warm worker tries to join before it gives up (each lost a member before it formed)."""
READY_LIMIT_S = 60.0
"""The longest a warm worker spends making its memory ready before it says it is warm."""


class LiveError(ElastrainError):
    """A live worker cannot go on (its agent is gone before giving it a round)."""


def _raise_if_agent_gone(before: str) -> None:
    agent = int(os.environ.get(AGENT_PID, "0") or 0)
    if agent and not pids.alive(agent):
        raise LiveError(f"the agent (pid {agent}) ended before {before}")


def _without(environ: Mapping[str, str], names: set[str]) -> dict[str, str]:
    return {name: value for name, value in environ.items() if name not in names}


class LiveMember:
    def __init__(self, env: WorkerEnv, backend: str) -> None:
        if not env.control_dir:
            raise ValueError("live mode needs the agent's control directory (ELASTRAIN_CONTROL_DIR)")
        self.env = env
        self.channel = RegroupChannel(env.control_dir)
        self.group = TrainingGroup(
            backend,
            env.collective_timeout_s,
            join_timeout_s=env.regroup_timeout_s,
            first_step_timeout_s=env.first_step_timeout_s,
        )
        self.round = env.round
        self.regroups = 0
        self._watchdog: Watchdog | None = None

    def join_first(self) -> None:
        """Join the round this worker was started into (collective over its members); a warm worker whose round lost
        a member before it formed joins the round the agent announced after it."""
        for _ in range(FIRST_JOIN_ROUNDS):
            try:
                self.group.join(
                    self.round,
                    self.env.rank,
                    self.env.world_size,
                    os.environ.get("MASTER_ADDR", "127.0.0.1"),
                    int(os.environ.get("MASTER_PORT", "29500")),
                    self._superseded(self.round),
                )
                break
            except JoinAbandonedError as exc:
                notice = self.channel.newer_than(self.round)
                if notice is None:
                    raise
                lifecycle("first_join_moved", round=f"{self.round}->{notice.round}", why=str(exc)[:160])
                self._adopt(notice)
        else:
            raise LiveError(f"no first round formed in {FIRST_JOIN_ROUNDS} rounds in a row")
        self._announce_first_step()
        self._watchdog = Watchdog(self.channel, self.group, self.round)

    def _superseded(self, round_: int) -> Callable[[], bool]:
        """Whether the agent announced a round after ``round_`` (a member of it died before it formed)."""
        return lambda: self.channel.newer_than(round_) is not None

    def ready(self) -> None:
        """The worker is training: from now on the agent regroups it in place instead of restarting it."""
        self.channel.announce_live(self.env.local_rank, os.getpid())

    def pending_notice(self) -> RegroupNotice | None:
        return self.channel.newer_than(self.round)

    def report_broken(self) -> None:
        self.channel.report_broken(self.env.local_rank, self.round)

    def wait_notice(self, after_round: int, timeout_s: float) -> RegroupNotice | None:
        return self.channel.wait_newer(after_round, timeout_s)

    def await_round(self, poll_s: float = 1.0, prepare: Callable[[], ReceivePool | None] | None = None) -> WorkerEnv:
        """A warm worker (built while its node was not in a round): make ready, say so, and wait for the first notice.

        ``prepare``: the memory this worker will receive its state into (:mod:`elastrain.live.receive_pool`),
        made and touched before the worker says it is warm (bounded by :data:`READY_LIMIT_S`): the agent joins the
        rendezvous only then, so the job trains on meanwhile, and the running workers never wait for a joiner's
        page faults (the state received into half-touched memory moved at a third of the wire's rate here, and
        the joiner's first step held the world's). The wait ends with the notice, or with the agent (it starts
        this worker the usual way, or stops it, if it gives up)."""
        started = time.monotonic()
        if prepare is not None and (pool := prepare()) is not None:
            ready = pool.ready(READY_LIMIT_S)
            lifecycle(
                "worker_memory_ready" if ready else "worker_memory_not_ready",
                level=logging.INFO if ready else logging.WARNING,
                local_rank=self.env.local_rank,
                bytes=pool.bytes,
                took_s=round(time.monotonic() - started, 3),
                why=None if ready else f"not touched within {READY_LIMIT_S:.0f} s: the rest is touched as it arrives",
            )
        self.channel.announce_warm(self.env.local_rank, os.getpid())
        lifecycle(
            "worker_warm", local_rank=self.env.local_rank, why="built before its node joined: waiting for a round"
        )
        notice = self._wait_first(poll_s, give_up=None)
        if notice is None:
            raise RuntimeError("internal: a warm worker's wait for its round ended without one")
        self._adopt(notice)
        lifecycle("worker_warm_joined", round=notice.round, waited_s=round(time.monotonic() - started, 3))
        return self.env

    def await_first_round(self, poll_s: float = 0.25) -> WorkerEnv | None:
        """A warm worker, before it runs something whose every member must run it too (an evaluation): if its agent
        saw no round formed, wait for its round (its environment then says whether it is the job's first), or for the
        agent's word that the job formed without this node. None (the worker stays warm and unannounced): the job
        formed without it, or its agent cannot tell."""
        started = time.monotonic()
        while (forming := self.channel.job_forming()) is None:  # the agent says so right after it starts us
            _raise_if_agent_gone("it said whether the job formed")
            time.sleep(0.05)
        if not forming:
            return None
        self.channel.announce_warm(self.env.local_rank, os.getpid(), deciding=True)
        notice = self._wait_first(poll_s, give_up=lambda: self.channel.job_forming() is False)
        if notice is None:
            self.channel.withdraw_warm(self.env.local_rank)
            lifecycle("worker_not_founding", local_rank=self.env.local_rank, why="the job formed without this node")
            return None
        self._adopt(notice)
        lifecycle("worker_warm_joined", round=notice.round, waited_s=round(time.monotonic() - started, 3))
        return self.env

    def _wait_first(self, poll_s: float, give_up: Callable[[], bool] | None) -> RegroupNotice | None:
        """The first notice; None once ``give_up()`` says so. Ends with the agent (it starts this worker the usual
        way, or stops it, if it gives up on it)."""
        while (notice := self.channel.wait_newer(self.round, poll_s)) is None:
            _raise_if_agent_gone("this warm worker was given a round")
            if give_up is not None and give_up():
                return None
        return notice

    def move_to(self, notice: RegroupNotice) -> WorkerEnv:
        """Acknowledge ``notice``, leave the current group, and join the notice's; the new WorkerEnv."""
        started = time.monotonic()
        self._adopt(notice)
        if notice.superseded:  # its state is dropped: the new world claims its checkpoint roots afresh
            fence.disown_claims()
        self.group.leave()
        if self._watchdog is not None:
            self._watchdog.watch_round(notice.round)
        rank = self.env.rank
        superseded = self._superseded(notice.round)
        self.group.join(notice.round, rank, notice.world_size, notice.master_addr, notice.master_port, superseded)
        self._announce_first_step()
        self.regroups += 1
        lifecycle("group_moved", round=notice.round, rank=rank, took_s=round(time.monotonic() - started, 3))
        return self.env

    def step_ended(self) -> None:
        """A step every member of the current world trained has ended (:meth:`TrainingGroup.step_ended`): a compiled
        model's first step in the world is over, and the agent waits --collective-timeout for this worker again."""
        if self.group.step_ended():
            self.channel.withdraw_first_step(self.env.local_rank)

    def _announce_first_step(self) -> None:
        """A compiled model's first step in a new world may take minutes (it compiles), as long as its bound (or
        --first-step-timeout's): tell the agent, which waits that long for this worker to answer a notice meanwhile
        rather than restart it."""
        if self.group.first_step_until is not None:
            self.channel.announce_first_step(self.env.local_rank, os.getpid(), self.group.first_step_until)

    def _adopt(self, notice: RegroupNotice) -> None:
        """Acknowledge ``notice`` and make it this process's environment (rank, world size, round, store)."""
        self.channel.ack(self.env.local_rank, notice.round, os.getpid())
        ctx = LaunchContext(
            run_id=self.env.run_id,
            restart_count=notice.round,
            failure_count=self.env.failure_count,
            start_reason=StartReason(notice.start_reason),
            previous_world_size=notice.previous_world_size,
            round=notice.round,
            checkpoint_dir=self.env.checkpoint_dir,
            control_dir=self.env.control_dir,
            events_file=self.env.events_file,
            collective_timeout_s=self.env.collective_timeout_s,
            first_step_timeout_s=self.env.first_step_timeout_s,
            generation=notice.generation,
            io_timeout_s=self.env.io_timeout_s,
            live=True,
            regroup_timeout_s=self.env.regroup_timeout_s,
            first_round=notice.first_round,
        )
        rank = notice.ranks[self.env.local_rank]
        changed = regrouped_environ(
            ctx, rank, notice.world_size, notice.group_rank, notice.master_addr, notice.master_port
        )
        unset = (
            {WARM}
            | ({FIRST_ROUND} if not notice.first_round else set())
            | {
                name
                for name, value in ((GENERATION, notice.generation), (PREVIOUS_WORLD_SIZE, notice.previous_world_size))
                if value is None
            }
        )
        # The new round's WorkerEnv is built here and handed on (the session, its checkpointer): no part of
        # elastrain reads it back from the process environment.
        self.env = WorkerEnv.from_environ({**_without(os.environ, unset), **changed})
        self.round = notice.round
        # The script's own view follows the round too: torch's variables (RANK, WORLD_SIZE, GROUP_RANK, MASTER_*)
        # and elastrain's, for scripts and libraries (accelerate) that read them after a regroup.
        os.environ.update(changed)
        for name in unset:
            os.environ.pop(name, None)

    def close(self) -> None:
        """Before the process ends: stop the watchdog, and let gloo finish what was given up (bounded)."""
        if self._watchdog is not None:
            self._watchdog.close()
            self._watchdog = None
        self.group.drain()
