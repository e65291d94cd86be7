"""When a live worker moves to its agent's next round: the pure rules (``elastrain-run --live true``).

A round that lost a member is taken at once: its group is broken, the next collective would fail. A
round that kept every member (nodes joined: ``RegroupNotice.no_departure``) is taken at a step
boundary that every rank agrees on through the step's flags (:mod:`elastrain.step_flags`): the rank
whose agent announced it raises :data:`REGROUP_FLAG` in the step's gradient sync, and every rank
moves once the sum says any did, finishing the step in flight.
"""

from __future__ import annotations

from collections.abc import Mapping

from elastrain.control import RegroupNotice

REGROUP_FLAG = "regroup"
"""The step flag: some rank's agent announced the next round."""


def regroup_due(agreed: Mapping[str, bool] | None, notice: RegroupNotice | None, world_size: int) -> bool:
    """At a step boundary: whether to move to the next round now.

    ``agreed``: the flags this step's gradient sync agreed (None: the step made no sync, e.g. the first
    step in a group); ``notice``: this rank's pending notice, if its agent announced a round."""
    if agreed is not None and REGROUP_FLAG in agreed:
        # Every rank decides alike from the agreed flag; a round that lost a member does not wait for it.
        return agreed[REGROUP_FLAG] or (notice is not None and not notice.no_departure)
    if notice is None:
        return False
    # No sync carried the flags: alone, or with a member gone, move now; with every member staying, wait for
    # the next step's sync (a peer may be inside a collective with this rank).
    return not notice.no_departure or world_size == 1


def supersedes(notice: RegroupNotice, generation: int | None) -> bool:
    """Whether ``notice`` names a newer fencing generation than this world's ``generation``: a save refused
    as stale was refused because this node's own next round claimed the checkpoint root, not another world."""
    if notice.generation is None:
        return False
    return generation is None or notice.generation > generation
