"""Live reconfiguration's pure parts: the agreement rule, the regroup notices on the control channel,
the environment a worker rewrites after a regroup, and the --live option."""

from __future__ import annotations

import pytest

from elastrain.live.agreement import Agreement, Ballot, decide, training_id


@pytest.mark.parametrize(
    ("ballots", "expected"),
    [
        # Nobody holds state (a first start, or every node restarted): load the checkpoint.
        ([Ballot(False, 0), Ballot(False, 0)], Agreement(step=None, source=None, receivers=(0, 1))),
        # Everyone at the same step: the lowest rank sends, nobody rolls back.
        ([Ballot(True, 7), Ballot(True, 7)], Agreement(step=7, source=0)),
        # Rank 0 applied step 8 (its all-reduce completed), rank 1's failed: back to 7, sent by rank 1.
        ([Ballot(True, 8), Ballot(True, 7)], Agreement(step=7, source=1, behind=(1,), ahead=(0,))),
        # A joining or restarted member receives the state of the members that hold it.
        (
            [Ballot(False, 0), Ballot(True, 5), Ballot(True, 5)],
            Agreement(step=5, source=1, receivers=(0,)),
        ),
        # A restarted member's step (from a checkpoint it did not load) never counts.
        ([Ballot(False, 99), Ballot(True, 3)], Agreement(step=3, source=1, receivers=(0,))),
        (
            [Ballot(True, 4), Ballot(True, 5), Ballot(True, 4), Ballot(False, 0)],
            Agreement(step=4, source=0, behind=(0, 2), ahead=(1,), receivers=(3,)),
        ),
        # A member further behind holds a world the job moved on from (a node cut off by a partition whose
        # workers lived on): it receives, and never rolls the others back to its step.
        (
            [Ballot(True, 151), Ballot(True, 151), Ballot(True, 3)],
            Agreement(step=151, source=0, receivers=(2,), stale=(2,)),
        ),
        (
            [Ballot(True, 3), Ballot(True, 151), Ballot(True, 150), Ballot(False, 0)],
            Agreement(step=150, source=2, behind=(2,), ahead=(1,), receivers=(0, 3), stale=(0,)),
        ),
    ],
)
def test_agreement_is_the_smallest_step_held_in_memory(ballots: list[Ballot], expected: Agreement) -> None:
    got = decide(ballots)
    assert got == expected
    assert got.from_checkpoint is (expected.source is None)


@pytest.mark.parametrize(
    ("ballots", "holders"),
    [
        ([Ballot(False, 0), Ballot(False, 0)], ()),  # the checkpoint: nobody sends
        ([Ballot(True, 7), Ballot(True, 7)], (0, 1)),
        ([Ballot(True, 8), Ballot(True, 7)], (1,)),  # rank 0 rolls back: it receives
        ([Ballot(False, 0), Ballot(True, 5), Ballot(True, 5)], (1, 2)),
        ([Ballot(True, 4), Ballot(True, 5), Ballot(True, 4), Ballot(False, 0)], (0, 2)),
        ([Ballot(True, 3), Ballot(True, 151), Ballot(True, 150), Ballot(False, 0)], (2,)),
    ],
)
def test_the_holders_of_the_agreed_state_are_every_member_that_does_not_receive_it(
    ballots: list[Ballot], holders: tuple[int, ...]
) -> None:
    got = decide(ballots)
    assert got.holders(len(ballots)) == holders
    assert got.source is None or got.source in holders


@pytest.mark.parametrize(
    ("ballots", "trained_at"),
    [
        ([Ballot(True, 7, 2), Ballot(True, 7, 2), Ballot(False, 0, 0)], 2),  # a join: the holders' world
        ([Ballot(True, 8, 3), Ballot(True, 7, 3)], 3),  # a death in the step: the world that trained it
        ([Ballot(False, 0, 0), Ballot(True, 5, 4)], 4),  # the source's, whatever a member without state says
        ([Ballot(True, 5), Ballot(True, 5)], None),  # unknown
        ([Ballot(False, 0, 3), Ballot(False, 0, 3)], None),  # nobody holds state: the checkpoint's
    ],
)
def test_the_agreement_says_at_what_world_size_its_step_was_trained(
    ballots: list[Ballot], trained_at: int | None
) -> None:
    assert decide(ballots).trained_at == trained_at


@pytest.mark.parametrize(
    ("ballots", "training"),
    [
        ([Ballot(True, 7, 2, 11), Ballot(True, 7, 2, 11), Ballot(False, 0, 0, 22)], 11),  # a joiner of another model
        ([Ballot(False, 0, 0, 22), Ballot(True, 5, 1, 11)], 11),  # the source's, whatever a member without state says
        ([Ballot(False, 0, 0, 22), Ballot(False, 0, 0, 11)], 22),  # nobody holds state: rank 0's
        ([Ballot(True, 5), Ballot(False, 0)], 0),  # unknown (a Session)
    ],
)
def test_the_world_continues_the_training_of_its_source(ballots: list[Ballot], training: int) -> None:
    assert decide(ballots).training == training


def test_a_training_is_numbered_alike_in_every_process_and_never_0() -> None:
    assert training_id("/out/fold-0") == training_id("/out/fold-0") != training_id("/out/fold-1")
    assert all(training_id(name) > 0 for name in ("", "a", "/out/fold-0"))
