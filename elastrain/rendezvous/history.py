"""The rounds a node was in, what its next round's continuity needs (:func:`~elastrain.rendezvous.state.continuity`).

A node's next round either continues its last one (the next number, every member kept, no member's workers failed:
a live regroup moves at an agreed step) or it does not; and the node was left behind when rounds were formed without
it, when it was redirected to a winning world's store since (that world numbers its own rounds), or when it was
frozen for a heartbeat timeout and the new round did not keep every member. Its workers then drop the state they
hold.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from elastrain.rendezvous import state as st


class RoundHistory:
    """One node's last round (number, members, when it formed) and whether it was redirected since."""

    def __init__(self, node_id: str) -> None:
        self._node_id = node_id
        self.round = -1
        """The job-wide number of the last round this node joined (-1: none yet)."""
        self.members: tuple[str, ...] = ()
        self.continuity = st.Continuity(kept_every_member=False, left_behind=False)
        """How the last round formed relates to the one before it."""
        self._redirected = False
        self._formed_at = time.monotonic()

    @property
    def alone(self) -> bool:
        """Whether this node is its round's only member: no peer's departure can have broken its workers."""
        return self.members == (self._node_id,)

    def redirected(self) -> None:
        """This node left its lineage's store for a winning world's (its world lost the fencing claim)."""
        self._redirected = True

    def formed(self, state: st.RendezvousState, silent_since: Callable[[float], bool]) -> None:
        """This node is in ``state``'s round now; ``silent_since(t)``: whether it was frozen for a heartbeat timeout
        after ``t`` (monotonic)."""
        silent = silent_since(self._formed_at)
        self.continuity = st.continuity(
            self._node_id,
            self.round,
            self.members,
            state.round,
            state.members,
            self._redirected,
            silent,
            state.after_failure,
        )
        self.round, self.members = state.round, state.members
        self._redirected = False
        self._formed_at = time.monotonic()
