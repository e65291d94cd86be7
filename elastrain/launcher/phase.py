"""The phase of this node's workers, as the agent sees it: one value, the change at hand included.

torch's :class:`~torch.distributed.elastic.agent.server.api.WorkerState` says how the processes are
(healthy, failed, stopped); :class:`Phase` says what the agent has decided about them: whether they run
and may be asked for a checkpoint, whether a failure of their own awaits its restart, and which
membership change is at hand (another world won the fencing claim; this node was left behind). The
agent holds one :class:`Phase` and moves it only through the transitions below.
"""

from __future__ import annotations

from enum import Enum

from elastrain.rendezvous.state import ChangeKind


class Phase(Enum):
    """What the agent knows about its workers."""

    IDLE = "idle"
    """None run: before the first start, warm workers waiting for their round, or stopped for a restart."""
    WARMING = "warming"
    """Being started before this node has a round (``--live`` warm start): they are told no place in one."""
    RUNNING = "running"
    """They run, and no change is at hand that bars a live regroup."""
    FENCED = "fenced"
    """They run; the change at hand: another world of the job won the fencing claim. Their state diverged
    from the winners', so they are restarted, never carried into that world."""
    LEFT_BEHIND = "left_behind"
    """They run; the change at hand: this node's round was superseded, or it was evicted. The job trained on
    without it: their state is behind."""
    EXITED = "exited"
    """Their failure was a membership change (a peer died, left or was evicted): none is left to regroup."""
    FAILED = "failed"
    """A worker failed on its own: the next start is a failure restart."""
    RESTARTING_AFTER_FAILURE = "restarting_after_failure"
    """Stopped after a failure of their own, until the next round is formed."""
    CONFIG_ERROR = "config_error"
    """A worker exited with EX_USAGE or EX_CONFIG: this node ends."""

    @property
    def running(self) -> bool:
        """Started and not yet stopped by the agent: a leave asks them for a checkpoint."""
        return self not in (Phase.IDLE, Phase.WARMING, Phase.RESTARTING_AFTER_FAILURE)

    @property
    def failed(self) -> bool:
        """A failure of their own awaits its verdict or restart: the next round's start reason says so."""
        return self in (Phase.FAILED, Phase.RESTARTING_AFTER_FAILURE, Phase.CONFIG_ERROR)

    @property
    def in_place(self) -> bool:
        """Running, none failed or exited: they may finish, or move to a new round in place."""
        return self in (Phase.RUNNING, Phase.FENCED, Phase.LEFT_BEHIND)

    def started(self) -> Phase:
        """Workers were just started: running, no change at hand (a failure still awaiting its round stays)."""
        if self is Phase.CONFIG_ERROR:
            return self
        return Phase.FAILED if self.failed else Phase.RUNNING

    def stopped(self) -> Phase:
        """The agent stops the workers for a restart (a failure of their own is remembered for the round)."""
        return Phase.RESTARTING_AFTER_FAILURE if self.failed else Phase.IDLE

    def round_formed(self) -> Phase:
        """A round was formed: a failure restart is now counted in its start reason."""
        return {Phase.FAILED: Phase.RUNNING, Phase.RESTARTING_AFTER_FAILURE: Phase.IDLE}.get(self, self)

    def without_change(self) -> Phase:
        """The change at hand was dealt with (or new workers start): running workers just run."""
        return Phase.RUNNING if self in (Phase.FENCED, Phase.LEFT_BEHIND, Phase.EXITED) else self

    def with_change(self, kind: ChangeKind) -> Phase:
        """Healthy workers learn of a membership change of ``kind``: it becomes the change at hand."""
        if not self.in_place:
            return self  # failed or exited already: that decides what happens to them
        if kind is ChangeKind.FENCED:
            return Phase.FENCED
        if kind in (ChangeKind.SUPERSEDED, ChangeKind.EVICTED):
            return Phase.LEFT_BEHIND
        return Phase.RUNNING
