"""When to save: one schedule for every checkpointer (DCP, DeepSpeed, the Trainer integration).

:class:`SaveSchedule` is the policy, a frozen and validated value (intervals, hold after a request);
:func:`decide` is the pure rule; :class:`SaveTrigger` applies them at step boundaries: it reads the
launcher's save requests (:mod:`elastrain.control`), makes every rank agree (a rank that saw a
request, or whose clock says the interval passed, makes all ranks save at the same step: through
the step's gradient all-reduce when the Session provides one, :mod:`elastrain.step_flags`, else by
a tiny all-reduce of its own), and reports commits back to the launcher. A checkpointer owns one trigger; replacing
``trigger.schedule`` changes the schedule from the next step on. After a save the launcher asked for,
:func:`hold_for_restart` is what a worker does while the announced membership change comes.

Which requests a commit answers is one rule for every checkpointer: a requested save claims the pending request and
answers it when the ranks hold; a save that training goes on from without holding (an interval save, the script's
own ``save()``) answers only the requests the ranks had read when they agreed on its step (:meth:`SaveTrigger.bound`).
A request made since stays pending, and the next step saves for it and holds: a leaving node's workers stop outside a
step, never in one their peers run. When training ends instead, :meth:`SaveTrigger.answer_at_end` answers it.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elastrain.control import ControlChannel, RegroupChannel, SaveAck, SaveRequest
from elastrain.errors import CheckpointError
from elastrain.step_flags import StepFlags

# Saved this often when neither interval is given (pass interval_seconds=math.inf for "on request only").
DEFAULT_INTERVAL_SECONDS = 300.0


_TIMED, _REQUESTED = "save_timed", "save_requested"  # the trigger's StepFlags

FINAL = "final"
"""The reason of a save at the end of training (the Session's close): the state it holds is the last one."""


class SaveReason(str, enum.Enum):
    INTERVAL = "interval"
    REQUEST = "request"


def goes_on_after(reason: str) -> bool:
    """Whether training goes on, without holding, from a save made for ``reason`` (every reason but a requested
    save and the final one: the script's own, an interval, a regroup's)."""
    return reason not in (SaveReason.REQUEST.value, FINAL)


@dataclass(frozen=True)
class SaveSchedule:
    """How often to save, and what to do after a save the launcher asked for."""

    interval_steps: int | None = None
    """Save every this many steps (at steps divisible by it)."""
    interval_seconds: float | None = None
    """Save when this many seconds passed since the last save (``math.inf``: on request only)."""
    hold_after_request_s: float = 5.0
    """After a requested save, hold up to this long for the restart the launcher is about to do."""
    agree_every_steps: int = 1
    """Agree on time-based and requested saves every this many steps (one tiny all-reduce each time)."""

    def __post_init__(self) -> None:
        if self.interval_steps is not None and self.interval_steps < 1:
            raise CheckpointError(f"interval_steps must be >= 1, got {self.interval_steps}")
        if self.interval_seconds is not None and not self.interval_seconds > 0:
            raise CheckpointError(f"interval_seconds must be > 0, got {self.interval_seconds}")
        if self.hold_after_request_s < 0:
            raise CheckpointError(f"hold_after_request_s must be >= 0, got {self.hold_after_request_s}")
        if self.agree_every_steps < 1:
            raise CheckpointError(f"sync_every_steps must be >= 1, got {self.agree_every_steps}")

    @classmethod
    def default(
        cls, interval_steps: int | None = None, interval_seconds: float | None = None, **more: Any
    ) -> SaveSchedule:
        """With neither interval given, every :data:`DEFAULT_INTERVAL_SECONDS`."""
        if interval_steps is None and interval_seconds is None:
            interval_seconds = DEFAULT_INTERVAL_SECONDS
        return cls(interval_steps=interval_steps, interval_seconds=interval_seconds, **more)

    @property
    def timed(self) -> bool:
        return self.interval_seconds is not None and math.isfinite(self.interval_seconds)

    def steps_due(self, step: int) -> bool:
        return self.interval_steps is not None and step % self.interval_steps == 0

    def seconds_due(self, since_save_s: float) -> bool:
        return self.interval_seconds is not None and since_save_s >= self.interval_seconds


def decide(
    schedule: SaveSchedule, step: int, last_saved_step: int | None, timed: bool, requested: bool
) -> SaveReason | None:
    """Pure: why to save ``step`` (``timed``/``requested`` as agreed by all ranks), or ``None``."""
    if step == last_saved_step:
        return None
    if requested:
        return SaveReason.REQUEST
    if timed or schedule.steps_due(step):
        return SaveReason.INTERVAL
    return None


class SaveTrigger:
    """A schedule applied at step boundaries, with the launcher's requests and the ranks' agreement.

    ``agree(flags)`` is the element-wise max of ``flags`` over all ranks (``None``: one process).
    ``live_round()``: with ``--live``, the round the worker is in now (``None``: restart mode).
    """

    def __init__(
        self,
        schedule: SaveSchedule,
        channel: ControlChannel | None,
        agree: Callable[[list[int]], list[int]] | None,
        *,
        is_local_leader: bool = True,
        log: Callable[..., None] | None = None,
        live_round: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.schedule = schedule
        self.channel = channel
        self._agree = agree
        self._is_local_leader = is_local_leader
        self._log = log or (lambda *a, **k: None)
        self.last_saved_step: int | None = None
        self._last_save_time = time.monotonic()
        self._answer: SaveAck | None = None
        self._unanswered = False  # a committed requested save the launcher was not told of yet
        self._flags: StepFlags | None = None
        self._live_round = live_round
        self._read_at: float | None = None  # wall clock: when this rank last read the launcher's requests
        self._requests_read_at: float | None = None  # ... for an agreement: a request made since is not agreed on
        self._checked_step: int | None = None  # the last step :meth:`check` was asked about

    def use_flags(self, flags: StepFlags) -> None:
        """Agree through ``flags`` (raised at each step's gradient sync) instead of a collective of our own."""
        flags.add(_TIMED, self._timed)
        flags.add(_REQUESTED, self._requested)
        self._flags = flags

    def release_flags(self) -> None:
        """Take this trigger's sources out of the flags it used: flags that outlive it (a worker's, shared by
        every Trainer it runs) would otherwise keep it, and all it refers to, alive."""
        if self._flags is not None:
            self._flags.remove(_TIMED, self._timed)
            self._flags.remove(_REQUESTED, self._requested)
            self._flags = None

    def _timed(self) -> bool:
        return self.schedule.seconds_due(time.monotonic() - self._last_save_time)

    def _requested(self) -> bool:
        if self.channel is None:
            return False
        self._read_at = time.time()
        return self.channel.pending() is not None

    def check(self, step: int) -> SaveReason | None:
        """Whether to save ``step``, and why; collective when distributed (call on every rank at every step),
        unless this step's gradient sync carried the flags (:meth:`use_flags`)."""
        s = self.schedule
        self._checked_step = step
        agreed = self._flags.agreed() if self._flags is not None else None
        if agreed is not None:  # the flags were raised at this step's sync, which read the requests
            self._requests_read_at = self._read_at
            return decide(s, step, self.last_saved_step, agreed[_TIMED], agreed[_REQUESTED])
        timed, requested = self._timed(), self._requested()
        if self._agree is not None and (s.timed or self.channel is not None):
            if step % s.agree_every_steps == 0:
                timed, requested = (bool(v) for v in self._agree([int(timed), int(requested)]))
            else:
                return decide(s, step, self.last_saved_step, False, False)  # what was read is not agreed on
        self._requests_read_at = self._read_at
        return decide(s, step, self.last_saved_step, timed, requested)

    def bound(self, reason: str) -> float:
        """Call as a save for ``reason`` starts (on the training thread): the latest wall-clock time its commit may
        answer requests up to. A save training goes on from (:func:`goes_on_after`) answers only the requests read
        when the ranks agreed on its step: one made since is answered by the next step's save, after which the ranks
        hold. Any other save: no bound (``math.inf``)."""
        read_at = self._requests_read_at
        return read_at if goes_on_after(reason) and read_at is not None else math.inf

    def claim(self, reason: str = SaveReason.REQUEST.value) -> SaveRequest | None:
        """The launcher's request a save for ``reason`` starting now answers, marked handled on this rank: the pending
        one for a requested save, none for a save training goes on from (:meth:`bound`)."""
        if self.channel is None or goes_on_after(reason):
            return None
        req = self.channel.pending()
        if req is not None:
            self.channel.mark_handled(req.request_id)
        return req

    def started(self, step: int) -> None:
        """A save of ``step`` started (or ``step`` was restored): the intervals count from now."""
        self.last_saved_step = step
        self._last_save_time = time.monotonic()

    def committed(
        self, step: int, path: str, current_at: float, bound: float = math.inf, defer_answer: bool = False
    ) -> None:
        """A save committed; the workers' state was that checkpoint until ``current_at`` (wall clock). It answers
        the launcher's requests made up to ``min(current_at, bound)`` (``bound``: :meth:`bound` at the save's start).

        ``defer_answer``: a requested save tells the launcher at :meth:`answer` instead (the step's own collectives,
        such as its mean loss, come first: the launcher acts on the answer, a leaving node by stopping its workers).
        """
        self._answer = SaveAck(step=step, checkpoint=path, current_at=min(current_at, bound))
        self._unanswered = defer_answer
        if not defer_answer:
            self._send(self._answer.current_at)

    def answer(self) -> None:
        """Tell the launcher of the requested save whose answer :meth:`committed` deferred (nothing if none is due):
        no step ran since, so it answers every request made until now."""
        if self._unanswered:
            self._unanswered = False
            self._send(time.time())

    def answer_at_end(self, step: int | None = None) -> None:
        """Training ended at ``step`` (default: the last step :meth:`check` was asked about): a deferred answer is
        told, and a request still pending is answered by ``step``'s commit if it is the last one (a request that a
        save training went on from left for a next step that never came, :meth:`bound`)."""
        self.answer()
        step = self._checked_step if step is None else step
        answer, channel = self._answer, self.channel
        if channel is not None and answer is not None and answer.step == step and channel.pending() is not None:
            self._send(time.time())

    def _send(self, current_at: float) -> None:
        if self.channel is None or self._answer is None:
            return
        if self._is_local_leader:
            self.channel.ack(self._answer.step, self._answer.checkpoint, current_at)
        else:
            self.channel.answered(current_at)

    def hold(self, step: int) -> None:
        """After a requested save: answer it (if deferred), then wait (bounded) for the restart, answering later
        requests with that save."""
        self.answer()
        answer = self._answer if self._is_local_leader else None
        hold_for_restart(
            self.schedule.hold_after_request_s, step, self._log, self.channel, answer, live_round=self._live_round()
        )


def hold_for_restart(
    seconds: float,
    step: int,
    log: Callable[..., None],
    channel: ControlChannel | None = None,
    answer: SaveAck | None = None,
    poll_s: float = 0.05,
    *,
    live_round: int | None = None,
) -> None:
    """Worker side, after the save that answered a request: wait (bounded) to be restarted.

    The launcher asked because a membership change is coming; a step run now would be redone after
    the restart. If no restart comes within ``seconds`` (the change was called off), training goes on
    from the checkpoint. Meanwhile the training state *is* checkpoint ``answer``: a request that
    arrives now (another agent saw the change later) is answered with it at once, when ``channel`` is
    given (``answer`` on the node's local rank 0; ``None`` on the others, which only mark it answered).
    ``log(event, level, **fields)`` is the caller's lifecycle logger. ``live_round``: with ``--live``, the
    round the worker is in (a notice of a later one ends the hold: the change comes as a regroup in place);
    ``None`` in restart mode.
    """
    if seconds <= 0:
        return
    log("checkpoint_hold", logging.INFO, step=step, up_to_s=seconds)
    # --live: the change may come as a regroup in place rather than a restart; then holding is over.
    regroup = RegroupChannel(channel.directory) if channel is not None and live_round is not None else None
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(poll_s, left))
        if regroup is not None and regroup.newer_than(live_round or 0) is not None:
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
