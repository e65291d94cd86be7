"""When a live worker moves to the next round (elastrain.session.regroup): the rule as tables."""

from __future__ import annotations

import pytest

from elastrain.control import RegroupNotice
from elastrain.session.regroup import REGROUP_FLAG, regroup_due, supersedes


def notice(no_departure: bool, generation: int | None = 3) -> RegroupNotice:
    return RegroupNotice(
        round=4,
        generation=generation,
        world_size=2,
        group_rank=0,
        group_world_size=2,
        ranks={0: 0},
        master_addr="127.0.0.1",
        master_port=29500,
        start_reason="scale_up",
        previous_world_size=2,
        announced_at=0.0,
        no_departure=no_departure,
    )


JOINED, LOST = notice(no_departure=True), notice(no_departure=False)


@pytest.mark.parametrize(
    ("agreed", "pending", "world_size", "due"),
    [
        # The step's sync carried the flags: every rank decides from the agreed flag alike.
        ({REGROUP_FLAG: False}, None, 2, False),
        ({REGROUP_FLAG: True}, None, 2, True),  # a peer's agent announced it: move, waiting for our notice
        ({REGROUP_FLAG: True}, JOINED, 2, True),
        ({REGROUP_FLAG: False}, JOINED, 2, False),  # announced after the sync: the next step's sync carries it
        ({REGROUP_FLAG: False}, LOST, 2, True),  # a member is gone: the next collective would fail, move now
        # No sync carried the flags (the first step in a group).
        (None, None, 2, False),
        (None, LOST, 2, True),
        (None, JOINED, 2, False),  # a peer may be inside a collective with this rank: wait for a sync
        (None, JOINED, 1, True),  # alone: nobody to agree with
        ({}, JOINED, 1, True),  # a sync without the regroup flag (restart-mode flags only)
    ],
)
def test_regroup_due(agreed: dict[str, bool] | None, pending: RegroupNotice | None, world_size: int, due: bool) -> None:
    assert regroup_due(agreed, pending, world_size) is due


@pytest.mark.parametrize(
    ("generation", "ours", "superseded"),
    [(4, 3, True), (3, 3, False), (2, 3, False), (None, 3, False), (1, None, True), (None, None, False)],
)
def test_a_stale_save_is_ours_only_when_the_notice_names_a_newer_generation(
    generation: int | None, ours: int | None, superseded: bool
) -> None:
    assert supersedes(notice(no_departure=True, generation=generation), ours) is superseded
