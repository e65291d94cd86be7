"""The pure rendezvous decisions: join, leave, evict, complete, change detection, liveness."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis.strategies import integers, sampled_from, sets

from elastrain.errors import RendezvousStateCorruptError
from elastrain.rendezvous import liveness
from elastrain.rendezvous import state as st

INFO = st.NodeInfo("127.0.0.1", 1000, 2000, 3000)


def joined(*nodes: str, base: st.RendezvousState | None = None) -> st.RendezvousState:
    s = base or st.RendezvousState()
    for n in nodes:
        s = st.join(s, n, INFO)
    return s


def formed(*nodes: str) -> st.RendezvousState:
    return st.complete(joined(*nodes), max_nodes=8)


def test_encode_roundtrip() -> None:
    s = st.remove(st.join(formed("a", "b"), "c", INFO), ["b"], "dead")
    s = st.after_store_failover(st.RendezvousState(**{**s.__dict__, "store_host": "a"}), "c")
    assert st.decode(st.encode(s)) == s


def test_a_nodes_nnodes_round_trips_and_an_address_without_it_reads_as_unsaid() -> None:
    s = st.join(formed("a"), "b", replace(INFO, nnodes=(1, 3)))
    assert st.decode(st.encode(s)).nodes["b"].nnodes == (1, 3)
    assert st.decode_info(st.encode_info(replace(INFO, nnodes=(2, 4)))).nnodes == (2, 4)
    assert st.decode_info(json.dumps(["127.0.0.1", 1, 2, 3]).encode()).nnodes == (0, 0)  # 4 fields: not said


def _with(
    nodes: dict[str, tuple[int, int]], members: tuple[str, ...], joining: tuple[str, ...] = ()
) -> st.RendezvousState:
    s = st.RendezvousState()
    for n in (*members, *joining):
        s = st.join(s, n, replace(INFO, nnodes=nodes[n]))
    return st.join(st.complete(s, max_nodes=8), "x", INFO) if not joining else s


@pytest.mark.parametrize(
    ("nodes", "members", "joining", "mine", "conflict"),
    [
        ({"a": (1, 3)}, ("a",), (), (1, 3), None),  # the same range
        ({"a": (1, 3)}, ("a",), (), (2, 4), "a"),  # a member says another
        ({"a": (0, 0)}, ("a",), (), (2, 4), None),  # a member that said nothing (an older node)
        ({"a": (1, 3), "b": (1, 3)}, (), ("a", "b"), (1, 4), "a"),  # nodes waiting for the first round count too
        ({"me": (2, 4)}, (), ("me",), (1, 3), None),  # this node's own earlier entry is no conflict
    ],
)
def test_nnodes_conflict_names_the_first_other_node_that_says_another_range(
    nodes: dict[str, tuple[int, int]],
    members: tuple[str, ...],
    joining: tuple[str, ...],
    mine: tuple[int, int],
    conflict: str | None,
) -> None:
    found = st.nnodes_conflict(_with(nodes, members, joining), "me", mine)
    assert (found[0] if found else None) == conflict


def test_nnodes_conflict_ignores_a_member_that_departed() -> None:
    s = st.remove(_with({"a": (1, 3), "b": (1, 3)}, ("a", "b")), ["a"], "dead")
    s = st.join(s, "c", replace(INFO, nnodes=(2, 4)))
    assert st.nnodes_conflict(s, "me", (2, 4)) == ("b", s.nodes["b"])
    assert st.nnodes_conflict(s, "me", (1, 3)) == ("c", s.nodes["c"])


def test_decode_rejects_foreign_state() -> None:
    with pytest.raises(RendezvousStateCorruptError, match="rdzv-id"):
        st.decode(b'{"some": "other launcher"}')


_GOOD = json.loads(st.encode(st.join(formed("a", "b"), "c", INFO)))


@pytest.mark.parametrize(
    "change",
    [
        {"departed": []},  # a list where an object belongs: was AttributeError
        {"nodes": {"a": {"addr": "x"}}},  # was KeyError
        {"nodes": {"a": ["x", 1, 2]}},  # a node's address cut short
        {"nodes": {"a": [1, 2, 3, 4]}},  # a number where the address belongs
        {"heartbeats": {"a": "7"}},
        {"members": "ab"},  # a string where the list belongs: would have been members ("a", "b")
        {"members": [["a"]]},
        {"round": True},
        {"round": 1.5},
        {"closed": "no"},
        {"generation": 5},
        {"generation": [1]},
        {"superseded_by": ["x"]},
        {"failed": {"a": 1}},
    ],
)
def test_decode_refuses_json_of_the_wrong_shape_with_a_typed_error(change: dict[str, object]) -> None:
    with pytest.raises(RendezvousStateCorruptError, match="not elastrain's"):
        st.decode(json.dumps({**_GOOD, **change}).encode())


@pytest.mark.parametrize("data", [b"[]", b"null", b"5", b'"state"', b"[" * 100_000, b"\xff\xfe"])
def test_decode_refuses_what_is_no_state_object(data: bytes) -> None:
    with pytest.raises(RendezvousStateCorruptError):
        st.decode(data)


def test_join_is_idempotent_and_ordered() -> None:
    s = joined("a", "b", "a")
    assert s.joining == ("a", "b")
    assert s.heartbeats == {"a": 0, "b": 0}


@pytest.mark.parametrize(
    ("joiners", "min_nodes", "max_nodes", "ready_for", "expected"),
    [
        (("a",), 2, 4, 10.0, False),  # below min
        (("a", "b"), 1, 2, 0.0, True),  # max reached: at once
        (("a",), 1, 2, 0.5, False),  # first round: last call not over
        (("a",), 1, 2, 1.0, True),  # first round: last call over
    ],
)
def test_can_complete_first_round(
    joiners: tuple[str, ...], min_nodes: int, max_nodes: int, ready_for: float, expected: bool
) -> None:
    assert st.can_complete(joined(*joiners), min_nodes, max_nodes, ready_for, last_call_s=1.0) is expected


@pytest.mark.parametrize(
    ("state", "started_over", "expected"),
    [
        (joined("a"), False, 30.0),  # the job's first start: the last call, for the nodes launched with it
        (joined("a"), True, 1.0),  # a job a node started over (refound, revived)
        (joined("c", base=st.remove(formed("a", "b"), ["a", "b"], "dead")), False, 1.0),  # every member gone
    ],
)
def test_only_a_jobs_first_start_waits_the_last_call(
    state: st.RendezvousState, started_over: bool, expected: float
) -> None:
    assert st.last_call(state, started_over, last_call_s=30.0, window_s=1.0) == expected


def test_a_newcomer_left_alone_by_every_member_forms_the_round_after_the_window() -> None:
    s = joined("c", base=st.remove(formed("a", "b"), ["a", "b"], "dead"))
    wait = st.last_call(s, False, last_call_s=30.0, window_s=1.0)
    assert not st.can_complete(s, 1, 3, ready_for_s=0.5, last_call_s=wait)
    assert st.can_complete(s, 1, 3, ready_for_s=1.0, last_call_s=wait)
    assert st.complete(s, 3).members == ("c",)


def test_round_completes_when_every_live_member_rejoined_without_last_call() -> None:
    s = formed("a", "b")
    s = st.remove(s, ["b"], "dead")
    assert st.change_for(s, "a", 0, 4) is not None
    s = joined("a", base=s)
    assert st.can_complete(s, 1, 4, ready_for_s=0.0, last_call_s=30.0)
    s = st.complete(s, 4)
    assert (s.round, s.members, s.departed) == (1, ("a",), {})


def test_round_waits_for_live_members_before_admitting_a_newcomer() -> None:
    s = joined("c", base=formed("a", "b"))
    assert str(st.change_for(s, "a", 0, 4)) == "scale_up: waiting: c"
    assert not st.can_complete(s, 1, 4, 100.0, 1.0)
    s = joined("b", "a", base=s)
    assert st.can_complete(s, 1, 4, 0.0, 1.0)
    assert st.complete(s, 4).members == ("a", "b", "c")  # survivors keep their ranks


def test_complete_caps_at_max_nodes_and_keeps_the_rest_waiting() -> None:
    s = st.complete(joined("a", "b", "c"), max_nodes=2)
    assert (s.members, s.joining) == (("a", "b"), ("c",))
    assert st.nodes_waiting(s, 2) == 0  # a spare: the round is full
    assert st.change_for(s, "a", 0, 2) is None


def test_remove_marks_departed_members_and_drops_joiners() -> None:
    s = joined("c", base=formed("a", "b"))
    s = st.remove(s, ["b", "c"], "left:SIGTERM")
    assert s.departed == {"b": "left:SIGTERM"}
    assert s.joining == ()
    assert "b" not in s.heartbeats and "c" not in s.nodes
    assert st.live_members(s) == ("a",)
    assert st.nodes_waiting(s, 2) == 1


def test_change_for_evicted_node_and_superseded_round() -> None:
    s = st.remove(formed("a", "b"), ["b"], "dead")
    assert st.change_for(s, "b", 0, 4) == st.Change(st.ChangeKind.EVICTED, "this node was evicted")
    assert st.change_for(s, "a", -1, 4) is not None
    assert st.change_for(formed("a", "b"), "a", 0, 4) is None


def test_closed_state_is_not_a_membership_change() -> None:
    assert st.change_for(st.close(formed("a")), "a", 0, 4) is None


def test_dead_nodes_by_observer_clock_never_self() -> None:
    obs = st.observe(st.Observations(), {"a": 0, "b": 0}, now=0.0, stalled=False)
    obs = st.observe(obs, {"a": 1, "b": 0}, now=0.5, stalled=False)
    obs = st.observe(obs, {"a": 2, "b": 0}, now=1.0, stalled=False)
    obs = st.observe(obs, {"a": 3, "b": 0}, now=1.5, stalled=False)
    assert st.dead_nodes(obs, 1.5, timeout_s=1.25, exclude="a") == ["b"]
    assert st.dead_nodes(obs, 1.5, timeout_s=1.25, exclude="b") == []


def test_observer_that_stalled_restarts_its_baselines() -> None:
    obs = st.observe(st.Observations(), {"a": 0, "b": 0}, now=0.0, stalled=False)
    obs = st.observe(obs, {"a": 0, "b": 0}, now=10.0, stalled=True)  # we were frozen for 10 s
    assert st.dead_nodes(obs, 10.0, timeout_s=1.25, exclude="a") == []


def test_a_failover_target_is_always_a_member_or_joiner_of_the_job() -> None:
    s = formed("a", "b")
    # An address in ``nodes`` that is neither a member nor a joiner (a forged entry) is never a successor.
    s = replace(s, store_host="a", nodes={**s.nodes, "x": st.NodeInfo("10.6.6.6", 1, 2, 3)})
    assert st.store_successors(s) == ["b"]
    assert st.store_successors(replace(s, store_host="x")) == ["a", "b"]  # a host that is no node: members only


def test_store_successors_skip_the_host_and_follow_rank_order() -> None:
    s = joined("d", base=formed("a", "b", "c"))
    s = st.RendezvousState(**{**s.__dict__, "store_host": "a"})
    assert st.store_successors(s) == ["b", "c", "d"]
    after = st.after_store_failover(s, "b")
    assert after.store_host == "b" and after.departed == {"a": "silent"}
    assert st.after_store_failover(s, "b", st.Departure.DEAD).departed == {"a": "dead"}
    # A host that announced why it left keeps that reason when its store dies with it.
    left = st.remove(s, ["a"], "config:a worker exited with EX_CONFIG")
    assert st.after_store_failover(left, "b").departed == {"a": "config:a worker exited with EX_CONFIG"}


@pytest.mark.parametrize(
    ("reasons", "departures"),
    [
        ({"b": "config:EX_CONFIG"}, (st.Departure.CONFIG,)),
        ({"b": "left:SIGTERM", "c": "dead"}, (st.Departure.LEFT, st.Departure.DEAD)),
        ({"c": "someone's own words"}, (st.Departure.SILENT,)),
    ],
)
def test_a_departure_says_how_each_member_left(reasons: dict[str, str], departures: tuple[st.Departure, ...]) -> None:
    change = st.change_for(replace(formed("a", "b", "c"), departed=reasons), "a", 0, 4)
    assert change is not None and change.kind is st.ChangeKind.DEPARTED and change.departures == departures


def test_a_new_judge_starts_from_the_previous_judges_evidence() -> None:
    counters = {"b": 3, "c": 7}
    obs = st.seeded(st.Observations(), counters, now=100.0, silent_for={"b": 4.0, "c": 4.0, "gone": 9.0})
    obs = st.observe(obs, counters, now=100.0, stalled=False)
    assert st.dead_nodes(obs, 101.5, timeout_s=5.0, exclude="a") == ["b", "c"]
    # A counter that moved since this node last saw it starts fresh: the snapshot is no evidence against it.
    moved = st.observe(st.Observations(), {"b": 3}, now=99.0, stalled=False)
    moved = st.seeded(moved, {"b": 4}, now=100.2, silent_for={"b": 4.0})
    moved = st.observe(moved, {"b": 4}, now=100.2, stalled=False)
    assert st.dead_nodes(moved, 101.5, timeout_s=5.0, exclude="a") == []


def test_judge_is_the_first_live_member_else_the_first_joiner() -> None:
    s = formed("a", "b", "c")
    assert st.judge(s) == "a"
    assert st.judge(st.remove(s, ["a"], "dead")) == "b"
    assert st.judge(joined("x", "y")) == "x"
    assert st.judge(st.RendezvousState()) is None


def test_the_first_failure_reported_is_the_cause_and_later_ones_are_its_echoes() -> None:
    s = formed("a", "b", "c")
    s1 = st.report_failure(s, "b", 0)
    assert s1 is not None and s1.failed == ("b",)
    # The first reporter counts its failure (no change excuses it); everyone else re-forms without one.
    assert st.change_for(s1, "b", 0, 4) is None
    for other in ("a", "c"):
        change = st.change_for(s1, other, 0, 4)
        assert change is not None and change.kind is st.ChangeKind.PEER_FAILED and "b" in change.detail
    s2 = st.report_failure(s1, "a", 0)
    assert s2 is not None and s2.failed == ("b", "a")
    assert st.change_for(s2, "b", 0, 4) is None
    # The echoes re-join at once; that is no excuse for the cause, nor is a newcomer.
    assert st.change_for(st.join(st.join(s2, "a", INFO), "d", INFO), "b", 0, 4) is None
    # Reports are idempotent, only for the current round, only by live members.
    assert st.report_failure(s2, "a", 0) is None
    assert st.report_failure(s2, "c", 1) is None
    assert st.report_failure(st.remove(s2, ["c"], "dead"), "c", 0) is None
    assert st.decode(st.encode(s2)) == s2
    # A new round starts with a clean slate, and says whose workers failed in the last (their state went with them).
    nxt = st.complete(st.join(st.join(st.join(s2, "a", INFO), "b", INFO), "c", INFO), 4)
    assert nxt.round == 1 and nxt.failed == () and nxt.after_failure == ("b", "a")
    assert st.decode(st.encode(nxt)) == nxt
    after = st.complete(st.join(st.join(st.join(nxt, "a", INFO), "b", INFO), "c", INFO), 4)
    assert after.after_failure == ()  # a round formed for a newcomer alone lost nobody's state


def test_a_round_formed_after_a_members_workers_failed_did_not_keep_every_member_on_any_node() -> None:
    """A worker SIGKILLed alone (its node re-joins with the same nodes): every node of both rounds learns that a
    member's state was lost, so a live regroup moves at once instead of finishing the step in flight."""
    s = st.report_failure(formed("a", "b"), "b", 0)
    assert s is not None
    nxt = st.complete(st.join(st.join(s, "b", INFO), "a", INFO), 4)
    for node in ("a", "b"):
        got = st.continuity(node, 0, ("a", "b"), nxt.round, nxt.members, after_failure=nxt.after_failure)
        assert got == st.Continuity(kept_every_member=False, left_behind=False)
    # A silent node is not left behind by it: the job trained nothing without it.
    got = st.continuity("a", 0, ("a", "b"), 1, ("a", "b"), silent=True, after_failure=("b",))
    assert got == st.Continuity(kept_every_member=False, left_behind=False)
    # A failed member that did not come back is a departure, not in after_failure.
    gone = st.complete(st.join(st.remove(s, ["b"], "failed"), "a", INFO), 4)
    assert gone.members == ("a",) and gone.after_failure == ()


@pytest.mark.parametrize(
    ("reports", "cause"),
    [
        ([("b", False), ("a", True), ("c", True)], "b"),  # the cause reported first
        ([("a", True), ("b", False), ("c", True)], "b"),  # an echo's agent reported before the cause's
        ([("a", True), ("c", True), ("b", False)], "b"),  # both echoes before the cause
        ([("a", True), ("c", True)], "a"),  # echoes alone (a collective broke, no peer failed): the first
        ([("b", False), ("a", False)], "b"),  # two failures of their own: report order
    ],
)
def test_an_echo_reported_before_the_cause_is_not_taken_for_it(reports: list[tuple[str, bool]], cause: str) -> None:
    s = formed("a", "b", "c")
    for node, echo in reports:
        nxt = st.report_failure(s, node, 0, echo=echo)
        assert nxt is not None
        s = nxt
    assert s.failed[0] == cause and sorted(s.failed) == sorted(n for n, _ in reports)
    assert st.change_for(s, cause, 0, 4) is None  # the cause counts its failure
    for other in {"a", "b", "c"} - {cause}:
        change = st.change_for(s, other, 0, 4)
        assert change is not None and change.kind is st.ChangeKind.PEER_FAILED and cause in change.detail
    assert st.decode(st.encode(s)) == s


@pytest.mark.parametrize(
    ("departed", "expected"),
    [({"b": "failed:workers"}, st.ChangeKind.DEPARTED), ({}, st.ChangeKind.PEER_FAILED)],
)
def test_a_departure_outranks_a_failure_report(departed: dict[str, str], expected: st.ChangeKind) -> None:
    s = st.report_failure(formed("a", "b"), "b", 0)
    assert s is not None
    change = st.change_for(replace(s, departed=departed), "a", 0, 4)
    assert change is not None and change.kind is expected


def test_members_rejoin_through_keys_only_once_the_round_is_visibly_over() -> None:
    s = formed("a", "b", "c")
    assert not st.round_over(s) and not st.rejoins_by_key(s, "a")  # the first re-joiner must write the state
    regroup = joined("b", base=s)  # b's workers failed: it re-joined through the state
    assert st.round_over(regroup)
    assert st.rejoins_by_key(regroup, "a") and st.rejoins_by_key(regroup, "c")
    assert not st.rejoins_by_key(regroup, "b")  # already in joining: it refreshes its address through the state
    gone = st.remove(s, ["c"], "dead")
    assert st.rejoins_by_key(gone, "a") and not st.rejoins_by_key(gone, "c")  # an evicted node joins anew
    newcomer = joined("d", base=s)  # a newcomer alone does not end the round for everyone
    assert not st.round_over(newcomer) and not st.rejoins_by_key(newcomer, "a")


def test_folded_keys_complete_the_round_in_one_step() -> None:
    s = st.remove(formed("a", "b", "c"), ["b"], "dead")
    fresh = st.NodeInfo("127.0.0.1", 1111, 2000, 3000)
    assert st.unfolded(s) == ("a", "c")
    half = st.fold(s, 0, {"a": fresh})
    assert half.joining == ("a",) and half.nodes["a"] == fresh
    assert not st.can_complete(half, 1, 4, 0.0, 30.0)  # c has not re-joined
    both = st.fold(s, 0, {"a": fresh, "c": INFO})
    assert st.can_complete(both, 1, 4, 0.0, 30.0)
    nxt = st.complete(both, 4)
    assert (nxt.round, nxt.members, nxt.nodes["a"]) == (1, ("a", "c"), fresh)
    # Keys of another round, of a member evicted since, or of a round not visibly over mean nothing.
    assert st.fold(s, 1, {"a": fresh, "c": INFO}) == s
    assert st.fold(st.remove(s, ["c"], "silent"), 0, {"c": INFO}).joining == ()
    assert st.fold(formed("a", "b"), 0, {"a": fresh, "b": INFO}) == formed("a", "b")
    # A newcomer and a spare keep their places: keyed survivors keep their ranks, the newcomer follows.
    with_newcomer = joined("d", base=s)
    assert st.complete(st.fold(with_newcomer, 0, {"a": INFO, "c": INFO}), 4).members == ("a", "c", "d")


def test_a_rejoin_key_roundtrips_and_a_foreign_one_is_refused() -> None:
    info = st.NodeInfo("10.1.2.3", 1, 2, 3)
    assert st.decode_info(st.encode_info(info)) == info
    with pytest.raises(RendezvousStateCorruptError):
        st.decode_info(b"not json")
    for bad in (b'{"addr": "x"}', b'["x", 1, 2]', b'["x", "1", 2, 3]', b"null"):
        with pytest.raises(RendezvousStateCorruptError):
            st.decode_info(bad)


@pytest.mark.parametrize(
    ("last_round", "last_members", "round_", "members", "kept", "left_behind"),
    [
        (-1, (), 0, ("a", "b"), False, False),  # its first round: nothing held from before
        (3, ("a", "b"), 4, ("a", "b", "c"), True, False),  # a node joined, none left
        (3, ("a", "b"), 4, ("a",), False, False),  # b left: the next round, but not every member kept
        (3, ("a", "b"), 4, ("b", "a"), True, False),  # the same members, ranks reordered
        (3, ("a", "b"), 5, ("a", "b"), False, True),  # round 4 was formed without it: the job may have trained on
        (0, ("a", "b", "c"), 2, ("a",), False, True),  # superseded, redirected, then alone after the winner died
        (3, ("a", "b"), 3, ("a", "b"), False, True),  # never the same round twice: not taken for a continuation
    ],
)
def test_continuity_of_a_nodes_rounds(
    last_round: int,
    last_members: tuple[str, ...],
    round_: int,
    members: tuple[str, ...],
    kept: bool,
    left_behind: bool,
) -> None:
    got = st.continuity("a", last_round, last_members, round_, members)
    assert got == st.Continuity(kept_every_member=kept, left_behind=left_behind)


@pytest.mark.parametrize("round_", [0, 4, 5, 9])
def test_a_node_redirected_to_a_winning_worlds_store_was_left_behind_whatever_that_world_numbers_its_round(
    round_: int,
) -> None:
    got = st.continuity("a", 3, ("a", "b"), round_, ("a", "b"), redirected=True)
    assert got == st.Continuity(kept_every_member=False, left_behind=True)


@given(
    last_round=integers(min_value=-1, max_value=20),
    gap=integers(min_value=1, max_value=5),
    last_members=sets(sampled_from("abcde")),
    members=sets(sampled_from("abcde")),
)
def test_a_round_that_keeps_every_member_is_never_one_a_node_was_left_behind_by(
    last_round: int, gap: int, last_members: set[str], members: set[str]
) -> None:
    got = st.continuity("a", last_round, last_members, last_round + gap, members | {"a"})
    assert not (got.kept_every_member and got.left_behind)
    assert got.left_behind == (last_round >= 0 and gap != 1)


@pytest.mark.parametrize(
    ("round_", "members", "left_behind"),
    [
        (4, ("a",), True),  # its store died while it was frozen: it formed "round 4" alone, maybe beside a world
        (4, ("a", "b", "c"), False),  # every member kept (a node joined): nobody went on without it
        (6, ("a", "b"), True),  # rounds formed without it anyway
    ],
)
def test_a_node_silent_for_a_heartbeat_timeout_was_left_behind_unless_its_round_kept_every_member(
    round_: int, members: tuple[str, ...], left_behind: bool
) -> None:
    got = st.continuity("a", 3, ("a", "b"), round_, members, silent=True)
    assert got.left_behind is left_behind


def test_the_pulse_tells_a_freeze_as_long_as_a_heartbeat_timeout_from_a_late_wake_up() -> None:
    pulse = liveness.Pulse(interval_s=0.25, silent_s=5.0)
    assert not pulse.silent_since(0.0, 100.0)  # not started: no gap
    pulse.woke(100.0)
    pulse.woke(100.3)
    pulse.woke(102.0)  # 1.7 s late (a loaded machine): not silent long enough to be judged dead
    assert not pulse.silent_since(0.0, 102.0)
    pulse.woke(108.0)  # frozen for 6 s
    assert pulse.silent_since(100.0, 108.0) and not pulse.silent_since(108.0, 108.1)
    assert pulse.silent_since(108.0, 113.5)  # due since 108.25 and not awake: a process not yet thawed


def _tombstoned() -> st.RendezvousState:
    s = st.record_generation(st.join(formed("a", "b"), "c", INFO), 0, 3)
    assert s is not None
    return st.supersede(replace(s, store_host="a"), "10.0.0.2:4000")


@pytest.mark.parametrize(
    ("state", "store", "revived"),
    [
        (_tombstoned(), "10.0.0.2:4000", True),  # the winner this lineage points at is gone: start over
        (_tombstoned(), "10.0.0.9:4000", False),  # a tombstone pointing at another (newer) winner stands
        (_tombstoned(), "", False),
        (formed("a", "b"), "10.0.0.2:4000", False),  # no tombstone (lifted already): nothing to do
        (st.close(_tombstoned()), "10.0.0.2:4000", False),  # a finished job stays finished
    ],
)
def test_revive_lifts_only_the_tombstone_of_the_gone_winner(
    state: st.RendezvousState, store: str, revived: bool
) -> None:
    new = st.revive(state, store)
    assert (new is not None) is revived
    if new is None:
        return
    # The round number and the store's host stay; the lineage's members and its generation are forgotten, so the
    # next round forms from fresh joins and its leader claims a fresh generation.
    assert (new.round, new.store_host) == (state.round, state.store_host)
    assert (new.superseded_by, new.generation, new.generation_round) == ("", -1, -1)
    assert new.members == new.joining == () and not new.nodes and not new.departed
    assert st.change_for(new, "a", state.round, 4) is not None  # a member of the old lineage re-joins
    again = st.complete(joined("b", "a", base=new), max_nodes=4)
    assert again.round == state.round + 1 and again.members == ("b", "a") and again.majority
    assert st.revive(new, store) is None  # a second node that gave up on the same winner changes nothing


@pytest.mark.parametrize(
    ("state", "vacated"),
    [
        (st.remove(formed("a"), ["a"], "left:SIGTERM"), True),  # the one member left: nobody carries the world on
        (st.remove(formed("a", "b"), ["a"], "left:SIGTERM"), False),  # b goes on (and takes the store over)
        (st.remove(formed("a", "b"), ["a", "b"], "left:SIGTERM"), True),
        (st.remove(st.join(formed("a"), "c", INFO), ["a"], "left:SIGTERM"), False),  # c waits in line: it fails over
        (st.remove(st.join(formed("a", "b"), "a", INFO), ["a"], "left:SIGTERM"), False),  # b is still live
        (st.close(st.remove(formed("a"), ["a"], "finished")), False),  # a finished job is closed, not vacated
        (formed("a"), False),
    ],
)
def test_a_lineage_is_vacated_only_when_nobody_is_left_in_it(state: st.RendezvousState, vacated: bool) -> None:
    assert st.vacated(state) is vacated
