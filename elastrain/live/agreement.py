"""One agreed state after a regroup: which step the new world continues from, and who sends it.

A peer that dies inside an all-reduce can leave the survivors one step apart: one got every
contribution and applied step ``k + 1``, another's collective failed at step ``k``. Every member
reports whether it holds training state in memory and the last step it completed; the world continues
from the *smallest* step among the members that hold state (every one of them completed it, and it
is what an uninterrupted run had at that step), sent by the lowest rank at that step to all others
(:mod:`elastrain.live.transfer`). A member ahead of it rolls back; a member with no state (a restarted
or joining node) receives it. A member more than one step behind another holds a superseded world's state
(members of one world are never further apart): it is treated as having none. With no state anywhere,
the world loads the newest checkpoint.
:func:`decide` is the pure rule; :func:`vote` is the collective around it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Ballot:
    """One member's report: whether it holds state in memory, and the last step it completed."""

    has_state: bool
    step: int
    world_size: int = 0
    """The world size the held state's last step was trained at (0: unknown, or no state)."""
    training: int = 0
    """Which of the script's trainings the member is in (a script may train one model after another: the Trainer's
    count of its ``train()`` calls; 0: unknown)."""


@dataclass(frozen=True)
class Agreement:
    step: int | None
    """The step every member continues from (None: nobody holds state; load the checkpoint)."""
    source: int | None
    """The rank that sends it (None with ``step``)."""
    behind: tuple[int, ...] = ()
    """Members that hold state at an earlier step than another member (it completed more)."""
    ahead: tuple[int, ...] = ()
    """Members that roll back: they completed a step beyond the agreed one."""
    receivers: tuple[int, ...] = ()
    """Members with no state in memory, and the stale ones."""
    stale: tuple[int, ...] = ()
    """Members whose state is more than one step behind another's: left over from a world the job moved on
    from (they receive the agreed state; their own is dropped)."""
    trained_at: int | None = None
    """The world size the agreed step was trained at (the source's ballot; None: unknown)."""
    training: int = 0
    """The training the world continues (the source's ballot, else rank 0's; 0: unknown)."""

    @property
    def from_checkpoint(self) -> bool:
        return self.source is None

    def holders(self, world_size: int) -> tuple[int, ...]:
        """The members that hold the agreed state already (the source among them): all but those that receive it."""
        if self.source is None:
            return ()
        needy = set(self.ahead) | set(self.receivers)
        return tuple(r for r in range(world_size) if r not in needy)


def decide(ballots: list[Ballot]) -> Agreement:
    """Pure: the agreement for the members' ballots (index = rank)."""
    holders = [(r, b.step) for r, b in enumerate(ballots) if b.has_state]
    top = max((s for _, s in holders), default=0)
    # Members of one world are at most one step apart (a peer died inside the step's all-reduce). A holder
    # further behind carries the state of a world the job moved on from (a node cut off by a partition):
    # it receives the state like a member without any, and never rolls the others back to its own.
    stale = tuple(r for r, s in holders if s < top - 1)
    holders = [(r, s) for r, s in holders if r not in stale]
    receivers = tuple(r for r, b in enumerate(ballots) if not b.has_state or r in stale)
    if not holders:
        return Agreement(step=None, source=None, receivers=receivers, training=ballots[0].training if ballots else 0)
    step = min(s for _, s in holders)
    source = min(r for r, s in holders if s == step)
    ahead = tuple(r for r, s in holders if s > step)
    behind = tuple(r for r, s in holders if s < top)
    trained_at = ballots[source].world_size or None
    return Agreement(
        step=step,
        source=source,
        behind=behind,
        ahead=ahead,
        receivers=receivers,
        stale=stale,
        trained_at=trained_at,
        training=ballots[source].training,
    )


def vote(mine: Ballot, device: torch.device) -> Agreement:
    """Every member's ballot, gathered on the current default group (collective), and the agreement."""
    world = dist.get_world_size()
    fields = [int(mine.has_state), mine.step, mine.world_size, mine.training]
    local = torch.tensor(fields, dtype=torch.int64, device=device)
    gathered = [torch.zeros(len(fields), dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(gathered, local)
    return decide([Ballot(bool(int(t[0])), int(t[1]), int(t[2]), int(t[3])) for t in gathered])
