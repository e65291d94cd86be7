"""The exit barrier's wait (elastrain.launcher.exit_barrier), on an in-process store and a scripted membership: how
each way of ending the wait is told apart, and that the count is read with short calls, never one long wait."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest
from torch._C._distributed_c10d import HashStore
from torch.distributed import DistStoreError

from elastrain.errors import RendezvousStateCorruptError, RendezvousStoreLostError
from elastrain.launcher import exit_barrier
from elastrain.launcher.exit_barrier import KEY, Outcome
from elastrain.rendezvous.state import Change, ChangeKind


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []
        self.at: dict[float, Callable[[], object]] = {}  # things that happen once the clock passes a time

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s
        for t in sorted(self.at):
            if t <= self.now:
                self.at.pop(t)()


class ScriptedMembership:
    """Only what the barrier reads of :class:`~elastrain.rendezvous.api.Membership`."""

    def __init__(self) -> None:
        self.change: Change | None = None
        self.fatal_error: BaseException | None = None
        self.asked = 0

    def membership_change(self) -> Change | None:
        self.asked += 1
        return self.change


class NoWaitStore(HashStore):
    """A store whose blocking wait fails the test: the barrier must never hold the shared client in one."""

    def wait(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("the exit barrier blocked in store.wait")


def _wait(store: HashStore, nodes: int, membership: ScriptedMembership, clock: Clock, **kw: object) -> Outcome:
    return exit_barrier.wait(store, nodes, membership, 300.0, clock=clock, sleep=clock.sleep, **kw)  # type: ignore[arg-type]


def test_a_lone_node_passes_at_once() -> None:
    clock, store = Clock(), NoWaitStore()
    assert _wait(store, 1, ScriptedMembership(), clock) is Outcome.PASSED
    assert clock.sleeps == []


def test_the_last_node_to_count_itself_in_passes_at_once_and_the_others_at_their_next_read() -> None:
    clock, store = Clock(), NoWaitStore()
    store.add(KEY, 2)  # two of three already wait
    assert _wait(store, 3, ScriptedMembership(), clock) is Outcome.PASSED
    assert clock.sleeps == []


def test_a_node_waits_in_short_reads_until_its_peer_counts_itself_in() -> None:
    clock, store = Clock(), NoWaitStore()
    clock.at[20.0] = lambda: store.add(KEY, 1)  # the peer finishes 20 s later (a long final save)
    assert _wait(store, 2, ScriptedMembership(), clock) is Outcome.PASSED
    assert 20.0 <= clock.now < 21.0
    assert max(clock.sleeps) <= exit_barrier.POLL_S


@pytest.mark.parametrize(
    ("kind", "outcome"),
    [
        (ChangeKind.DEPARTED, Outcome.RELEASED),
        (ChangeKind.SUPERSEDED, Outcome.RELEASED),
        (ChangeKind.EVICTED, Outcome.RELEASED),
        (ChangeKind.REGROUP, Outcome.RELEASED),
        (ChangeKind.PEER_FAILED, Outcome.RELEASED),
        (ChangeKind.FENCED, Outcome.RELEASED),
        (ChangeKind.SCALE_UP, Outcome.TIMED_OUT),  # a node waiting to join ends nobody's round: the wait goes on
    ],
)
def test_a_round_that_ends_otherwise_releases_the_wait_but_a_node_waiting_to_join_does_not(
    kind: ChangeKind, outcome: Outcome
) -> None:
    clock, store, membership = Clock(), NoWaitStore(), ScriptedMembership()

    def change() -> None:
        membership.change = Change(kind, "a test's change")

    clock.at[5.0] = change
    assert _wait(store, 2, membership, clock) is outcome
    assert clock.now < 6.0 if outcome is Outcome.RELEASED else clock.now >= 300.0


def test_a_lost_store_ends_the_wait() -> None:
    clock, store, membership = Clock(), NoWaitStore(), ScriptedMembership()

    def lost() -> None:
        membership.fatal_error = RendezvousStoreLostError("the store is gone")

    clock.at[3.0] = lost
    assert _wait(store, 2, membership, clock) is Outcome.STORE_FAILED


def test_a_store_call_that_fails_ends_the_wait_with_its_error() -> None:
    class Failing(NoWaitStore):
        def add(self, key: str, value: int) -> int:
            raise DistStoreError("connection reset")

    assert _wait(Failing(), 2, ScriptedMembership(), Clock()) is Outcome.STORE_FAILED


def test_a_leave_ends_the_wait() -> None:
    clock, store = Clock(), NoWaitStore()
    asked: list[bool] = []

    def leaving() -> bool:
        asked.append(True)
        return clock.now >= 2.0

    assert _wait(store, 2, ScriptedMembership(), clock, leaving=leaving) is Outcome.LEFT
    assert asked


def test_the_wait_is_bounded_by_its_timeout() -> None:
    clock, store = Clock(), NoWaitStore()
    store.set_timeout(timedelta(seconds=1))
    assert _wait(store, 2, ScriptedMembership(), clock) is Outcome.TIMED_OUT
    assert 300.0 <= clock.now < 301.0


def test_a_membership_that_cannot_read_the_round_ends_the_wait_not_the_node() -> None:
    class Unreadable(ScriptedMembership):
        def membership_change(self) -> Change | None:
            raise RendezvousStateCorruptError("the state key holds garbage")

    assert _wait(NoWaitStore(), 2, Unreadable(), Clock()) is Outcome.STORE_FAILED


def test_a_node_whose_workers_ended_before_joining_the_round_waits_for_nobody() -> None:
    """Its workers finished training as a round with a joiner formed: the joiner's workers wait in that round for
    ours, which never come; the node closes the job at once, and the joiner finds it finished."""
    clock, store = Clock(), NoWaitStore()
    assert _wait(store, 3, ScriptedMembership(), clock, unjoined=True) is Outcome.SKIPPED
    assert clock.sleeps == [] and store.add(KEY, 0) == 0  # not even counted in
