"""The agent ↔ worker control channel on one node: "save a checkpoint now, and tell me when it is committed",
and, with ``--live``, "a new round formed: regroup in place" (:class:`RegroupChannel`).

The agent asks before an announced membership change (SIGTERM, a preemption notice, a node waiting
to join) so that the change costs no steps. It is a pair of small files in a per-node directory
(``ELASTRAIN_CONTROL_DIR``), written atomically, so a worker pays one ``stat`` per poll and nothing
here depends on torch. Workers must agree among themselves on *when* to honour a request (any rank
that saw it makes all ranks save at the same step boundary); that agreement lives in the checkpoint
module, not here.
"""

from __future__ import annotations

import enum
import itertools
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from elastrain.control_codec import Fields, MessageReader
from elastrain.env import LIVE, ROUND

_REQUEST = "save-request.json"
_ACK = "save-ack.json"
_REGROUP = "regroup.json"
_REGROUP_ACK = "regroup-ack-{local_rank}.json"
_LIVE = "live-{local_rank}.json"
_BROKEN = "broken-{local_rank}.json"
_WARM = "warm-{local_rank}.json"
_FINISHING = "finishing-{local_rank}.json"
_T = TypeVar("_T")
# Temporary names unique per process, thread and call: two writers of one file never share one.
_TMP_SEQUENCE = itertools.count()


class SaveCause(str, enum.Enum):
    """Why the launcher asks its workers for a checkpoint before a membership change."""

    LEAVE = "leave"  # this node leaves (SIGTERM, a preemption notice): the job goes on without it
    SCALE_UP = "scale-up"  # nodes join: today's restart path restarts the workers


@dataclass(frozen=True)
class SaveRequest:
    request_id: int
    reason: str  # for people: the cause and what caused it
    requested_at: float
    cause: SaveCause = SaveCause.SCALE_UP

    @classmethod
    def decode(cls, f: Fields) -> SaveRequest:
        try:
            cause = SaveCause(f.text("cause", default=SaveCause.SCALE_UP.value))
        except ValueError:
            cause = SaveCause.SCALE_UP  # a newer launcher's cause: a save is a save
        return cls(f.integer("request_id"), f.text("reason"), f.number("requested_at"), cause)


@dataclass(frozen=True)
class SaveAck:
    """The newest committed checkpoint of this node's workers, and how recent it is.

    ``current_at`` is the latest wall-clock time at which the workers' training state was exactly this
    checkpoint: the commit time of a synchronous save (training waited for it), the staging time of an
    asynchronous one, or a later time while the workers hold after a requested save.
    """

    step: int
    checkpoint: str
    current_at: float
    request_id: int = 0  # the request it was checked against (0: none)

    def answers(self, request: SaveRequest) -> bool:
        """Whether this checkpoint answers ``request``: the workers had trained no further when it was made."""
        return self.current_at >= request.requested_at

    @classmethod
    def decode(cls, f: Fields) -> SaveAck:
        return cls(step=f.integer("step"), checkpoint=f.text("checkpoint"), current_at=f.number("current_at"))


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
        )


def _round(f: Fields) -> int:
    return f.integer("round")


def _local_rank_and_pid(f: Fields) -> tuple[int, int]:
    return f.integer("local_rank"), f.integer("pid")


def _poll(get: Callable[[], _T], done: Callable[[_T], bool], timeout_s: float, poll_s: float) -> _T:
    """``get()`` every ``poll_s`` until ``done`` says its value will do or ``timeout_s`` passed; the last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = get()
        if done(value) or time.monotonic() >= deadline:
            return value
        time.sleep(poll_s)


def _write_atomic(path: Path, payload: dict[str, object]) -> None:
    """Write ``path`` whole or not at all; safe from any number of threads and processes at once."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.{next(_TMP_SEQUENCE)}.tmp")
    try:
        with open(tmp, "x") as f:  # exclusive: a name that is somehow taken fails here, not at the rename
            f.write(json.dumps(payload))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class ControlChannel:
    """One node's channel; the agent and every local worker open the same directory.

    The agent's request is answered by any commit whose state is at least as new as the request
    (:meth:`SaveAck.answers`), not by a reply naming its id: an agent that asks after a job-wide save
    already started (it saw a joining node later than another agent did) accepts that save.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._handled = -1
        self._answered_at = -math.inf
        self._last_mtime: int | None = None
        self._mine: dict[int, SaveRequest] = {}
        self._reader = MessageReader()
        # The agent's threads (the main loop, a preemption watcher) may ask at once: one id each. Reentrant,
        # because the SIGTERM handler runs on the main thread, perhaps in the middle of its own request.
        self._request_lock = threading.RLock()
        self._last_id = 0

    # -- agent side -------------------------------------------------------------------------------
    def request_save(self, cause: SaveCause, detail: str) -> SaveRequest:
        """Ask the workers for a checkpoint; ``OSError`` if the request cannot be written."""
        with self._request_lock:
            previous = self.current_request()
            self._last_id = max(self._last_id, previous.request_id if previous else 0) + 1
            req = SaveRequest(
                request_id=self._last_id, reason=f"{cause.value}: {detail}", requested_at=time.time(), cause=cause
            )
            self._mine[req.request_id] = req
            _write_atomic(self.directory / _REQUEST, {**req.__dict__, "cause": cause.value})
        return req

    def latest_ack(self) -> SaveAck | None:
        """The newest commit the workers reported, whatever it answers."""
        return self._reader.read(self.directory / _ACK, SaveAck.decode)

    def ack_for(self, request: SaveRequest | int) -> SaveAck | None:
        """The commit that answers ``request`` (a request or the id of one made here), or ``None`` yet."""
        req = self._resolve(request)
        ack = self.latest_ack()
        if req is None or ack is None or not ack.answers(req):
            return None
        return SaveAck(step=ack.step, checkpoint=ack.checkpoint, current_at=ack.current_at, request_id=req.request_id)

    def _resolve(self, request: SaveRequest | int) -> SaveRequest | None:
        if isinstance(request, SaveRequest):
            return request
        if request in self._mine:
            return self._mine[request]
        current = self.current_request()
        return current if current is not None and current.request_id == request else None

    def wait_ack(self, request: SaveRequest | int, timeout_s: float, poll_s: float = 0.05) -> SaveAck | None:
        return _poll(lambda: self.ack_for(request), lambda ack: ack is not None, timeout_s, poll_s)

    # -- worker side ------------------------------------------------------------------------------
    def current_request(self) -> SaveRequest | None:
        return self._reader.read(self.directory / _REQUEST, SaveRequest.decode)

    def pending(self) -> SaveRequest | None:
        """The newest request neither marked handled nor answered by this process; cheap when nothing changed."""
        try:
            mtime = (self.directory / _REQUEST).stat().st_mtime_ns
        except FileNotFoundError:
            return None
        if mtime == self._last_mtime:
            return None
        req = self.current_request()
        if req is not None and req.requested_at > self._answered_at:
            ack = self.latest_ack()  # answered already, perhaps by the workers this process replaced
            if ack is not None and ack.answers(req):
                self.answered(ack.current_at)
        if req is None or req.request_id <= self._handled or req.requested_at <= self._answered_at:
            self._last_mtime = mtime
            return None
        return req

    def mark_handled(self, request_id: int) -> None:
        self._handled = max(self._handled, request_id)

    def answered(self, current_at: float) -> None:
        """Every request made up to ``current_at`` is answered by a commit (call on every local rank)."""
        self._answered_at = max(self._answered_at, current_at)

    def ack(self, step: int, checkpoint: str, current_at: float) -> None:
        """Report a commit to the agent (local rank 0 only): it answers requests made until ``current_at``."""
        self.answered(current_at)
        _write_atomic(self.directory / _ACK, {"step": step, "checkpoint": checkpoint, "current_at": current_at})


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
        _write_atomic(self.directory / _REGROUP, notice.to_json())

    def acked(self, local_rank: int, round_: int) -> bool:
        acked = self._reader.read(self.directory / _REGROUP_ACK.format(local_rank=local_rank), _round)
        return acked is not None and acked >= round_

    def wait_acks(self, local_ranks: list[int], round_: int, timeout_s: float, poll_s: float = 0.02) -> list[int]:
        """Wait (bounded) until every local rank acknowledged ``round_``; the ranks that did not."""
        return _poll(lambda: [r for r in local_ranks if not self.acked(r, round_)], lambda m: not m, timeout_s, poll_s)

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

    def forget_workers(self) -> None:
        """Before new workers start: the old workers' live announcements and acks no longer hold."""
        for pattern in (_LIVE, _REGROUP_ACK, _BROKEN, _WARM, _FINISHING):
            for path in self.directory.glob(pattern.format(local_rank="*")):
                path.unlink(missing_ok=True)

    def live_pids(self) -> dict[int, int]:
        """The workers that said they can regroup in place: local rank -> pid."""
        return self._pids(_LIVE)

    def warm_pids(self) -> dict[int, int]:
        """The warm workers that wait for their first round (:meth:`announce_warm`): local rank -> pid."""
        return self._pids(_WARM)

    def finishing_pids(self) -> dict[int, int]:
        """The workers whose training is over and that are closing (:meth:`announce_finishing`)."""
        return self._pids(_FINISHING)

    def _pids(self, pattern: str) -> dict[int, int]:
        out: dict[int, int] = {}
        for path in self.directory.glob(pattern.format(local_rank="*")):
            found = self._reader.read(path, _local_rank_and_pid)
            if found is not None:
                out[found[0]] = found[1]
        return out

    # -- worker side ------------------------------------------------------------------------------
    def announce_live(self, local_rank: int, pid: int) -> None:
        self._announce(_LIVE, local_rank, pid)

    def announce_warm(self, local_rank: int, pid: int) -> None:
        """A warm worker is built (imports, model, data) and waits for its first notice: its node may join."""
        self._announce(_WARM, local_rank, pid)

    def announce_finishing(self, local_rank: int, pid: int) -> None:
        """The worker's training is over (its last save and exit follow): it answers no save request or
        regroup notice any more, so a membership change now waits for it to exit instead of moving it."""
        self._announce(_FINISHING, local_rank, pid)

    def _announce(self, pattern: str, local_rank: int, pid: int) -> None:
        _write_atomic(self.directory / pattern.format(local_rank=local_rank), {"local_rank": local_rank, "pid": pid})

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
        return _poll(lambda: self.newer_than(round_), lambda notice: notice is not None, timeout_s, poll_s)

    def report_broken(self, local_rank: int, round_: int) -> None:
        """A collective of ``round_`` failed in this worker: the agent probes its peers now, not at their timeout."""
        _write_atomic(self.directory / _BROKEN.format(local_rank=local_rank), {"round": round_, "at": time.time()})

    def ack(self, local_rank: int, round_: int, pid: int) -> None:
        _write_atomic(
            self.directory / _REGROUP_ACK.format(local_rank=local_rank),
            {"round": round_, "pid": pid, "at": time.time()},
        )


def hold_for_restart(
    seconds: float,
    step: int,
    log: Callable[..., None],
    channel: ControlChannel | None = None,
    answer: SaveAck | None = None,
    poll_s: float = 0.05,
) -> None:
    """Worker side, after the save that answered a request: wait (bounded) to be restarted.

    The launcher asked because a membership change is coming; a step run now would be redone after
    the restart. If no restart comes within ``seconds`` (the change was called off), training goes on
    from the checkpoint. Meanwhile the training state *is* checkpoint ``answer``: a request that
    arrives now (another agent saw the change later) is answered with it at once, when ``channel`` is
    given (``answer`` on the node's local rank 0; ``None`` on the others, which only mark it answered).
    ``log(event, level, **fields)`` is the caller's lifecycle logger.
    """
    if seconds <= 0:
        return
    log("checkpoint_hold", logging.INFO, step=step, up_to_s=seconds)
    # --live: the change may come as a regroup in place rather than a restart; then holding is over.
    regroup = RegroupChannel(channel.directory) if channel is not None and os.environ.get(LIVE) == "1" else None
    current_round = int(os.environ.get(ROUND, "0") or 0)
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(poll_s, left))
        if regroup is not None and regroup.newer_than(current_round) is not None:
            log("checkpoint_hold_over", logging.INFO, step=step, why="regroup in place")
            return
        if channel is not None and channel.pending() is not None:
            now = time.time()
            if answer is not None:
                channel.ack(answer.step, answer.checkpoint, now)
                log("checkpoint_reacked", logging.INFO, step=answer.step, current_at=now)
            else:
                channel.answered(now)
    log("checkpoint_hold_over", logging.WARNING, step=step)
