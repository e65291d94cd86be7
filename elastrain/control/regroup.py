"""The regroup channel of one node (``--live``): the agent's notices of a new round, the workers' acks,
and which workers can regroup in place, are warm, are finishing, or saw a collective break.

The same per-node directory as the save channel (``ELASTRAIN_CONTROL_DIR``), one small file per
message, written atomically (:mod:`elastrain.control.files`): a worker pays one ``stat`` per poll.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from elastrain.control.files import Fields, MessageReader, poll, write_atomic
from elastrain.env import WorkerEnv
from elastrain.log import lifecycle

_REGROUP = "regroup.json"
_REGROUP_ACK = "regroup-ack-{local_rank}.json"
_LIVE = "live-{local_rank}.json"
_BROKEN = "broken-{local_rank}.json"
_WARM = "warm-{local_rank}.json"
_FINISHING = "finishing-{local_rank}.json"
_FIRST_STEP = "first-step-{local_rank}.json"
_JOB_FORMING = "job-forming.json"


@dataclass(frozen=True)
class RegroupNotice:
    """The agent's word to its live workers (``--live``): a new round formed; join it without restarting.

    ``ranks`` maps each local rank to its global rank in the new world; the group's store is a fresh
    TCPStore at ``master_addr:master_port`` hosted by the new rank 0 (one per round, as at a start).
    """

    round: int
    generation: int | None
    world_size: int
    group_rank: int
    group_world_size: int
    ranks: dict[int, int]
    master_addr: str
    master_port: int
    start_reason: str
    previous_world_size: int | None
    announced_at: float
    no_departure: bool = False
    """The change lost no member (nodes joined): every collective of the old round completes, so the
    workers move at a step boundary they agree on (:mod:`elastrain.step_flags`), finishing the step in
    flight, and the watchdog gives up nothing."""
    superseded: bool = False
    """This node's last round was superseded or it was evicted (cut off, then back): the job trained on
    without it, so its workers drop their state and receive the world's (:mod:`elastrain.live.agreement`)."""
    first_round: bool = False
    """The job's first round: every member of it starts its script from the top (no member trains yet)."""

    def to_json(self) -> dict[str, object]:
        out = dict(self.__dict__)
        out["ranks"] = {str(k): v for k, v in self.ranks.items()}
        return out

    @classmethod
    def from_json(cls, data: object, source: str = _REGROUP) -> RegroupNotice:
        """The notice in ``data`` (a decoded JSON value); :class:`ControlMessageError` if it is not one."""
        return cls.decode(Fields(data, source))

    @classmethod
    def decode(cls, f: Fields) -> RegroupNotice:
        return cls(
            round=f.integer("round"),
            generation=f.optional_integer("generation"),
            world_size=f.integer("world_size"),
            group_rank=f.integer("group_rank"),
            group_world_size=f.integer("group_world_size"),
            ranks=f.integer_map("ranks"),
            master_addr=f.text("master_addr"),
            master_port=f.integer("master_port"),
            start_reason=f.text("start_reason"),
            previous_world_size=f.optional_integer("previous_world_size"),
            announced_at=f.number("announced_at"),
            no_departure=f.flag("no_departure", default=False),
            superseded=f.flag("superseded", default=False),
            first_round=f.flag("first_round", default=False),
        )


def _round(f: Fields) -> int:
    return f.integer("round")


def _announced(f: Fields) -> tuple[int, int, bool]:
    """An announcement's local rank, pid, and whether it is a deciding warm worker's (False for every other)."""
    return f.integer("local_rank"), f.integer("pid"), f.flag("deciding", default=False)


def _forming(f: Fields) -> bool:
    return f.flag("forming", default=False)


def _until(f: Fields) -> float:
    return f.number("until")


class RegroupChannel:
    """The regroup side of one node's control directory (``--live``): notices, acks, and who can regroup.

    A worker that can regroup in place says so once (:meth:`announce_live`, with its pid); the agent
    tries a live regroup only when every local worker did, so plain torchrun scripts never wait for
    an ack that cannot come. The agent writes one notice per round (:meth:`announce`); each worker
    acknowledges it (:meth:`ack`) when it starts to regroup, which the agent waits for, bounded.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._last_mtime: int | None = None
        self._last: RegroupNotice | None = None
        self._reader = MessageReader()

    # -- agent side -------------------------------------------------------------------------------
    def announce(self, notice: RegroupNotice) -> None:
        write_atomic(self.directory / _REGROUP, notice.to_json())

    def acked(self, local_rank: int, round_: int) -> bool:
        acked = self._reader.read(self.directory / _REGROUP_ACK.format(local_rank=local_rank), _round)
        return acked is not None and acked >= round_

    def wait_acks(self, local_ranks: list[int], round_: int, timeout_s: float, poll_s: float = 0.02) -> list[int]:
        """Wait (bounded) until every local rank acknowledged ``round_``; the ranks that did not."""
        return poll(lambda: [r for r in local_ranks if not self.acked(r, round_)], lambda m: not m, timeout_s, poll_s)

    def broken_round(self) -> int | None:
        """The newest round in which a local worker reported a broken collective (:meth:`report_broken`)."""
        return max(self._broken_rounds().values(), default=None)

    def broken_local_ranks(self, round_: int) -> set[int]:
        """The local ranks that reported a broken collective in ``round_``."""
        return {int(rank) for rank, r in self._broken_rounds().items() if r == round_ and rank.isdigit()}

    def _broken_rounds(self) -> dict[str, int]:
        """What each ``broken-<local_rank>.json`` says: its file's local rank (as named) -> round."""
        out: dict[str, int] = {}
        for path in self.directory.glob(_BROKEN.format(local_rank="*")):
            round_ = self._reader.read(path, _round)
            if round_ is not None:
                out[path.stem.split("-", 1)[1]] = round_
        return out

    def forget_workers(self, local_ranks: Collection[int] | None = None) -> None:
        """Before new workers start: the old workers' live announcements and acks no longer hold (only those of
        ``local_ranks`` when given: the others keep running)."""
        names = ["*"] if local_ranks is None else [str(r) for r in local_ranks]
        for pattern in (_LIVE, _REGROUP_ACK, _BROKEN, _WARM, _FINISHING, _FIRST_STEP):
            for name in names:
                for path in self.directory.glob(pattern.format(local_rank=name)):
                    path.unlink(missing_ok=True)

    def live_pids(self) -> dict[int, int]:
        """The workers that said they can regroup in place: local rank -> pid."""
        return self._pids(_LIVE)

    def warm_pids(self, deciding: bool | None = None) -> dict[int, int]:
        """The warm workers that wait for their first round (:meth:`announce_warm`): local rank -> pid. ``deciding``:
        only those that wait to know whether their node founds the job (True), or only the others (False)."""
        return self._pids(_WARM, deciding)

    def tell_job_forming(self, forming: bool) -> None:
        """Whether this node may found the job: no round had formed as its warm workers started (True), or one has
        formed without it (False: then the workers that wait to know, :meth:`announce_warm` ``deciding``, do not)."""
        write_atomic(self.directory / _JOB_FORMING, {"forming": forming, "at": time.time()})

    def finishing_pids(self) -> dict[int, int]:
        """The workers whose training is over and that are closing (:meth:`announce_finishing`)."""
        return self._pids(_FINISHING)

    def first_step_until(self, local_rank: int) -> float | None:
        """Until when (wall clock) a worker in a new world's first step, bound longer than --collective-timeout (a
        compiled model, --first-step-timeout), may take to reach its next step boundary (:meth:`announce_first_step`);
        None if it is not in one."""
        return self._reader.read(self.directory / _FIRST_STEP.format(local_rank=local_rank), _until)

    def _pids(self, pattern: str, deciding: bool | None = None) -> dict[int, int]:
        out: dict[int, int] = {}
        for path in self.directory.glob(pattern.format(local_rank="*")):
            found = self._reader.read(path, _announced)
            if found is not None and (deciding is None or found[2] is deciding):
                out[found[0]] = found[1]
        return out

    # -- worker side ------------------------------------------------------------------------------
    def announce_live(self, local_rank: int, pid: int) -> None:
        self._announce(_LIVE, local_rank, pid)

    def announce_warm(self, local_rank: int, pid: int, deciding: bool = False) -> None:
        """A warm worker is built (imports, model, data) and waits for its first notice: its node may join.
        ``deciding``: it waits to know whether its node founds the job (its first notice says so), unless the agent
        says first that the job formed without it (:meth:`job_forming`)."""
        self._announce(_WARM, local_rank, pid, deciding=deciding)

    def withdraw_warm(self, local_rank: int) -> None:
        """A deciding warm worker that learnt that the job formed without its node: not waiting any more."""
        (self.directory / _WARM.format(local_rank=local_rank)).unlink(missing_ok=True)

    def job_forming(self) -> bool | None:
        """What the agent said of the job's first round (:meth:`tell_job_forming`); None: nothing yet."""
        return self._reader.read(self.directory / _JOB_FORMING, _forming)

    def announce_finishing(self, local_rank: int, pid: int) -> None:
        """The worker's training is over (its last save and exit follow): it answers no save request or
        regroup notice any more, so a membership change now waits for it to exit instead of moving it."""
        self._announce(_FINISHING, local_rank, pid)

    def withdraw_finishing(self, local_rank: int) -> None:
        """The worker trains again (a script that trains a second model): a change moves it again."""
        (self.directory / _FINISHING.format(local_rank=local_rank)).unlink(missing_ok=True)

    def announce_first_step(self, local_rank: int, pid: int, until: float) -> None:
        """The worker is in a new world's first step with a bound longer than --collective-timeout (a compiled model
        compiles there, for minutes on a large one; or --first-step-timeout): it reaches its next step boundary, and so
        answers a notice, as late as ``until`` (wall clock)."""
        self._announce(_FIRST_STEP, local_rank, pid, until=until)

    def withdraw_first_step(self, local_rank: int) -> None:
        """The worker's first step in its world has ended: it answers a notice within --collective-timeout again."""
        (self.directory / _FIRST_STEP.format(local_rank=local_rank)).unlink(missing_ok=True)

    def _announce(self, pattern: str, local_rank: int, pid: int, **more: object) -> None:
        path = self.directory / pattern.format(local_rank=local_rank)
        write_atomic(path, {"local_rank": local_rank, "pid": pid, **more})

    def notice(self) -> RegroupNotice | None:
        """The newest notice; one ``stat`` when nothing changed since the last call."""
        path = self.directory / _REGROUP
        try:
            mtime = path.stat().st_mtime_ns
        except FileNotFoundError:
            return None
        if mtime != self._last_mtime:
            notice = self._reader.read(path, RegroupNotice.decode)
            if notice is None:
                return self._last  # a torn read cannot happen (atomic replace); a foreign file can (logged)
            self._last, self._last_mtime = notice, mtime
        return self._last

    def newer_than(self, round_: int) -> RegroupNotice | None:
        notice = self.notice()
        return notice if notice is not None and notice.round > round_ else None

    def wait_newer(self, round_: int, timeout_s: float, poll_s: float = 0.02) -> RegroupNotice | None:
        return poll(lambda: self.newer_than(round_), lambda notice: notice is not None, timeout_s, poll_s)

    def report_broken(self, local_rank: int, round_: int) -> None:
        """A collective of ``round_`` failed in this worker: the agent probes its peers now, not at their timeout."""
        write_atomic(self.directory / _BROKEN.format(local_rank=local_rank), {"round": round_, "at": time.time()})

    def ack(self, local_rank: int, round_: int, pid: int) -> None:
        write_atomic(
            self.directory / _REGROUP_ACK.format(local_rank=local_rank),
            {"round": round_, "pid": pid, "at": time.time()},
        )


def announce_training(env: WorkerEnv, over: bool) -> None:
    """Tell this worker's agent that its training is over (``over``: its last save and exit follow, so a membership
    change waits for it to exit rather than ask it for a save or a regroup it will never answer), or that it trains
    (again: a script that trains one model after another, whose next training a change must move as the first)."""
    if not (env.under_elastrain and env.control_dir):
        return
    channel = RegroupChannel(env.control_dir)
    try:
        if over:
            channel.announce_finishing(env.local_rank, os.getpid())
        else:
            channel.withdraw_finishing(env.local_rank)
    except OSError as exc:
        lifecycle("finishing_unannounced", level=logging.WARNING, over=over, error=repr(exc)[:200])
