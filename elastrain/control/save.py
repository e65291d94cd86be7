"""The save channel of one node: "save a checkpoint now, and tell me when it is committed".

The agent asks before an announced membership change (SIGTERM, a preemption notice, a node waiting
to join) so that the change costs no steps. It is a pair of small files in a per-node directory
(``ELASTRAIN_CONTROL_DIR``), written atomically (:mod:`elastrain.control.files`), so a worker pays one
``stat`` per poll and nothing here depends on torch. Workers must agree among themselves on *when* to
honour a request (any rank that saw it makes all ranks save at the same step boundary); that agreement,
and what a worker does after the save it was asked for, live in :mod:`elastrain.checkpoint.schedule`.
"""

from __future__ import annotations

import enum
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from elastrain.control.files import Fields, MessageReader, poll, write_atomic

_REQUEST = "save-request.json"
_ACK = "save-ack.json"


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
            write_atomic(self.directory / _REQUEST, {**req.__dict__, "cause": cause.value})
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

    def wait_ack(
        self,
        request: SaveRequest | int,
        timeout_s: float,
        poll_s: float = 0.05,
        stop: Callable[[], bool] | None = None,
    ) -> SaveAck | None:
        """The commit that answers ``request``, waited for up to ``timeout_s``, or until ``stop()`` says no answer
        can come (the workers are gone); ``None`` then."""

        def done(ack: SaveAck | None) -> bool:
            return ack is not None or (stop is not None and stop())

        return poll(lambda: self.ack_for(request), done, timeout_s, poll_s)

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
        write_atomic(self.directory / _ACK, {"step": step, "checkpoint": checkpoint, "current_at": current_at})
