"""elastrain's rendezvous handler in one process: several handlers ("nodes") over one in-memory store."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
from support.rendezvous_nodes import FAST, eventually, handler, rendezvous_all
from support.tcp_proxy import TcpProxy
from torch.distributed import HashStore
from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

from elastrain.errors import NodeLeftError
from elastrain.rendezvous import state as st
from elastrain.rendezvous.handler import ElastrainRendezvousHandler


def make_nodes(n: int, **conf: str) -> list[ElastrainRendezvousHandler]:
    store = HashStore()
    return [handler(store, n, C10dRendezvousBackend, **conf) for _ in range(n)]


def test_nodes_form_one_round_with_fresh_worker_store_info() -> None:
    a, b = make_nodes(2)
    try:
        infos = rendezvous_all([a, b])
        assert sorted(i.rank for i in infos) == [0, 1]
        assert {i.world_size for i in infos} == {2}
        assert a.elastrain_round == b.elastrain_round == 0
        assert len({(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos}) == 1  # type: ignore[union-attr]
        assert not a.use_agent_store
        assert a.membership_change() is None and a.num_nodes_waiting() == 0
        assert a.membership_grace_s > 0  # a worker failure may be a peer's departure, seen a moment later
    finally:
        a.shutdown()
        b.shutdown()


def test_leave_makes_survivor_reform_at_once() -> None:
    a, b = make_nodes(2)
    try:
        rendezvous_all([a, b])
        b.leave("SIGTERM")
        eventually(lambda: a.membership_change() is not None)  # within one heartbeat interval
        change = a.membership_change()
        assert change is not None and change.kind is st.ChangeKind.DEPARTED
        assert a.num_nodes_waiting() >= 1
        started = time.monotonic()
        info = a.next_rendezvous()
        assert time.monotonic() - started < 5  # no last call: a was the only live member
        assert (info.world_size, info.rank, a.elastrain_round) == (1, 0, 1)
        # Alone in its round, a's worker failure is its own: no grace to wait for a peer's departure.
        assert a.membership_grace_s == 0.0
        with pytest.raises(NodeLeftError):
            b.next_rendezvous()
    finally:
        a.shutdown()


def test_silent_node_is_evicted_by_heartbeat_and_rejoins_as_newcomer() -> None:
    a, b = make_nodes(2)
    try:
        rendezvous_all([a, b])
        b.stop_beating()  # b "freezes": its heartbeat stops, its process (probe) stays alive
        eventually(lambda: str(a.membership_change()).startswith("departed"))
        assert str(b.membership_change()) == "evicted: this node was evicted"
        a.next_rendezvous()
        assert a.elastrain_round == 1
        assert (a.kept_every_member, a.left_behind) == (False, False)  # b left; a's own state is the job's
        # b comes back: it is a newcomer now, a sees it waiting, both form round 2.
        joined = threading.Thread(target=b.next_rendezvous)
        joined.start()
        eventually(lambda: str(a.membership_change()) == f"scale_up: waiting: {b.node_id}")
        info = a.next_rendezvous()
        joined.join(timeout=10)
        assert info.world_size == 2
        assert a.elastrain_round == b.elastrain_round == 2
        # a went on from round 1 (everyone in it kept); b missed round 1: its workers' state in memory is dropped.
        assert (a.kept_every_member, a.left_behind) == (True, False)
        assert (b.kept_every_member, b.left_behind) == (False, True)
    finally:
        a.shutdown()
        b.shutdown()


def test_newcomer_waits_until_members_rejoin() -> None:
    a, b = make_nodes(2, last_call_timeout="1")
    try:
        info = threading.Thread(target=a.next_rendezvous)
        info.start()
        info.join(timeout=30)  # a alone after the last call (min_nodes=1)
        assert a.elastrain_round == 0
        done = threading.Event()
        threading.Thread(target=lambda: (b.next_rendezvous(), done.set())).start()
        eventually(lambda: str(a.membership_change()) == f"scale_up: waiting: {b.node_id}")
        assert not done.wait(0.3)  # b waits for a (a live member) to re-join
        a.next_rendezvous()
        assert done.wait(10)
        assert a.elastrain_round == b.elastrain_round == 1
    finally:
        a.shutdown()
        b.shutdown()


def test_a_node_beyond_max_is_a_spare_and_takes_a_departed_members_place() -> None:
    a, b, c = make_nodes(3)
    for h in (a, b, c):
        h._params.max_nodes = 2  # type: ignore[misc]
    told: list[str] = []
    try:
        assert c.job_formed() is False  # before any round: c may found the job
        for h in (a, b, c):
            h.on_formed_without_this_node(lambda h=h: told.append(h.node_id))  # type: ignore[misc]
        rendezvous_all([a, b])
        assert c.job_formed() is True and not told
        got: list[RendezvousInfo] = []
        spare = threading.Thread(target=lambda: got.append(c.next_rendezvous()))
        spare.start()
        eventually(lambda: c.node_id in a._read().joining)
        # The spare, as it waits (its thread tells them once it reads its place in the state): its warm workers.
        eventually(lambda: told == [c.node_id])
        time.sleep(0.5)  # past the scale-up window: a full round does not restart for a spare
        assert told == [c.node_id]  # once
        assert a.membership_change() is None and a.num_nodes_waiting() == 0
        assert b.membership_change() is None
        assert not got
        b.leave("SIGTERM")
        eventually(lambda: a.membership_change() is not None)
        change = a.membership_change()
        assert change is not None and change.kind is st.ChangeKind.DEPARTED
        info = a.next_rendezvous()
        spare.join(timeout=10)
        assert info.world_size == 2 and got and got[0].world_size == 2
        assert a.elastrain_round == c.elastrain_round == 1
    finally:
        a.shutdown()
        c.shutdown()


def test_nodes_arriving_together_join_in_one_round() -> None:
    a, b, c = make_nodes(3, last_call_timeout="0.2", scale_up_window="0.5")
    try:
        rendezvous_all([a])
        threads = [threading.Thread(target=h.next_rendezvous) for h in (b, c)]
        threads[0].start()
        time.sleep(0.1)
        threads[1].start()
        eventually(lambda: a.membership_change() is not None)
        info = a.next_rendezvous()
        for t in threads:
            t.join(timeout=10)
        assert info.world_size == 3 and a.elastrain_round == 1
    finally:
        for h in (a, b, c):
            h.shutdown()


@pytest.mark.parametrize("how", ["killed", "cut_off"])
def test_twelve_of_sixteen_vanish_together_and_the_four_survivors_form_their_round(how: str) -> None:
    nodes = make_nodes(16, heartbeat_interval="0.1", heartbeat_timeout="1.5", last_call_timeout="30")
    try:
        rendezvous_all(nodes)
        # The judge (the first member) vanishes too, so the survivors also show that taking over works.
        order = st.live_members(nodes[0]._read())
        by_id = {h.node_id: h for h in nodes}
        vanished = [by_id[n] for n in order[:12]]
        survivors = [by_id[n] for n in order[12:]]
        for h in vanished:  # gone at once: no heartbeat; killed: probes refused; cut off: probes unanswered
            h.stop_beating()
            if how == "killed":
                h._probe._sock.close()
        eventually(lambda: all(s.membership_change() is not None for s in survivors), timeout=60)
        infos = rendezvous_all(survivors)
        assert {i.world_size for i in infos} == {4}
        assert len({s.elastrain_round for s in survivors}) == 1
    finally:
        for h in nodes:
            h.stop_beating()


class CountingBackend(C10dRendezvousBackend):
    """torch's c10d backend that counts the compare-and-sets that changed the state.

    torch reports a compare-and-set as done when the stored value equals the one asked for, even if it was
    already there: two nodes that fold the same keys into the same state at once both see success, though the
    state changed once. Calls are serialized here so that the value before each one is known exactly.
    """

    def __init__(self, store: HashStore, run_id: str) -> None:
        super().__init__(store, run_id)
        self.writes = 0
        self._count = threading.Lock()

    def set_state(self, state: bytes, token: object | None = None) -> tuple[bytes, object, bool] | None:
        with self._count:
            before = self.get_state()
            got = super().set_state(state, token)
            if got is not None and got[2] and (before is None or before[0] != state):
                self.writes += 1
        return got


def counted_nodes(n: int, **conf: str) -> tuple[list[ElastrainRendezvousHandler], CountingBackend]:
    store = HashStore()
    backend = CountingBackend(store, "unit")
    return [handler(store, n, lambda _store, _run_id: backend, **conf) for _ in range(n)], backend


def test_survivors_rejoin_through_keys_and_one_compare_and_set_forms_the_round() -> None:
    nodes, backend = counted_nodes(6)
    try:
        rendezvous_all(nodes)
        nodes[3].leave("SIGTERM")
        survivors = [h for i, h in enumerate(nodes) if i != 3]
        eventually(lambda: all(h.membership_change() is not None for h in survivors))
        before = backend.writes
        infos = rendezvous_all(survivors)
        assert {i.world_size for i in infos} == {5} and {h.elastrain_round for h in survivors} == {1}
        assert all(h._keyed is not None for h in survivors)  # every survivor asked through its key
        assert backend.writes - before == 1  # and one compare-and-set folded them in and formed the round
        # Every survivor's fresh worker-store address is in the new round (the keys carry it).
        master = nodes[0]._read().nodes[nodes[0]._read().members[0]]
        assert {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos} == {  # type: ignore[union-attr]
            (master.addr, master.master_port)
        }
    finally:
        for h in nodes:
            h.shutdown()


def test_the_first_member_to_rejoin_writes_the_state_and_the_others_see_a_regroup() -> None:
    nodes, _ = counted_nodes(4)
    try:
        rendezvous_all(nodes)
        first, rest = nodes[2], [h for i, h in enumerate(nodes) if i != 2]
        done: list[RendezvousInfo] = []
        t = threading.Thread(target=lambda: done.append(first.next_rendezvous()))  # its workers failed
        t.start()
        eventually(lambda: first.node_id in nodes[0]._read().joining)
        assert first._keyed is None  # nobody else would have seen a key: it joined through the state
        for h in rest:
            eventually(lambda h=h: h.membership_change() is not None)
            change = h.membership_change()
            assert change is not None and change.kind is st.ChangeKind.REGROUP
        infos = rendezvous_all(rest)
        t.join(timeout=10)
        assert done and {i.world_size for i in [*infos, *done]} == {4}
        assert all(h._keyed is not None for h in rest)
    finally:
        for h in nodes:
            h.shutdown()


def test_the_judge_folds_the_keys_when_the_last_member_is_evicted_instead_of_rejoining(
    caplog: pytest.LogCaptureFixture,
) -> None:
    nodes, _ = counted_nodes(4, heartbeat_timeout="10")  # only a refused probe evicts, when the test says
    try:
        rendezvous_all(nodes)
        order = st.live_members(nodes[0]._read())
        by_id = {h.node_id: h for h in nodes}
        judge, second, silent, leaver = (by_id[n] for n in order)
        silent.stop_beating()  # about to vanish: no heartbeat, so only its probe keeps it in the round
        leaver.leave("SIGTERM")
        eventually(lambda: judge.membership_change() is not None and second.membership_change() is not None)
        infos: list[RendezvousInfo] = []
        threads = [threading.Thread(target=lambda h=h: infos.append(h.next_rendezvous())) for h in (judge, second)]
        with caplog.at_level(logging.INFO, logger="elastrain"):
            for t in threads:
                t.start()
            eventually(lambda: judge._keyed is not None and second._keyed is not None)
            assert not infos  # both wait on their keys: `silent` has not re-joined
            silent._probe._sock.close()  # now it is gone; the judge evicts it and folds the two keys
            for t in threads:
                t.join(timeout=30)
        assert len(infos) == 2 and {i.world_size for i in infos} == {2}
        assert judge.elastrain_round == second.elastrain_round == 1
        assert st.live_members(judge._read()) == (judge.node_id, second.node_id)
        assert any("event=round_folded" in r.getMessage() and "by=judge" in r.getMessage() for r in caplog.records)
    finally:
        for h in nodes:
            h.stop_beating()


def test_a_world_that_loses_the_generation_claim_joins_the_winner(tmp_path: Path) -> None:
    from elastrain import fence

    root = str(tmp_path)
    (a,) = make_nodes(1, checkpoint_root=root)
    try:
        rendezvous_all([a])
        assert a.generation == 0 and fence.newest(root).generation == 0  # type: ignore[union-attr]
        fence.claim_after(root, "unit", 3, "127.0.0.1:1", ("x",), parent=0)  # another world of this job took over
        eventually(lambda: a.membership_change() is not None)
        assert a.membership_change().kind is st.ChangeKind.FENCED  # type: ignore[union-attr]
        with pytest.raises(Exception, match=r"127\.0\.0\.1:1"):
            a.next_rendezvous()  # no c10d stores here: the redirect names the winner's store
    finally:
        a.shutdown()


def test_a_world_superseded_by_a_claim_on_its_own_rendezvous_joins_the_newer_worlds_next_round(tmp_path: Path) -> None:
    """A rendezvous that never moves (etcd: every claim names it) has no store to follow: a node whose world was
    superseded there (it was frozen past its eviction) joins the newer world's next round from where it is. Before,
    it raised "this backend cannot move there" and left the job."""
    from elastrain import fence

    root = str(tmp_path)
    (a,) = make_nodes(1, checkpoint_root=root)
    try:
        rendezvous_all([a])
        fence.claim_after(root, "unit", 3, "127.0.0.1:0", ("x",), parent=0)  # a later world, on this same store
        eventually(lambda: a.membership_change() is not None)
        assert a.membership_change().kind is st.ChangeKind.FENCED  # type: ignore[union-attr]
        a.next_rendezvous()
        assert a.generation == 2 and fence.newest(root).generation == 2  # type: ignore[union-attr]
    finally:
        a.shutdown()


def test_a_leader_whose_round_is_gone_when_it_claims_never_claims_past_the_later_rounds(tmp_path: Path) -> None:
    """A round's leader frozen between forming its round and claiming its generation wakes up after a later round's
    leader claimed the next generation on the same store: its round is gone, and it claims nothing. Before, it took
    that claim for its own lineage's (a leader that died before recording it), claimed the one after, and fenced the
    world that had just started."""
    from dataclasses import replace

    from elastrain import fence
    from elastrain.rendezvous.rounds import RoundLost

    root = str(tmp_path)
    (a,) = make_nodes(1, checkpoint_root=root)
    try:
        rendezvous_all([a])  # round 0, generation 0
        formed = replace(a._read(), round=a._read().round + 1)  # a's next round, formed; its claim still to make
        a._state.update(lambda cur: replace(cur, round=cur.round + 2))  # the job went on without it meanwhile
        fence.claim_after(root, "unit", formed.round + 1, "127.0.0.1:0", ("x",), parent=0)  # that round's claim
        with pytest.raises(RoundLost):
            a._fencing.settle(formed, time.monotonic() + 10)
        assert fence.newest(root).generation == 1  # type: ignore[union-attr]
    finally:
        a.shutdown()


def test_a_claim_whose_store_names_no_member_of_the_job_is_not_followed(tmp_path: Path) -> None:
    from elastrain import fence

    root = str(tmp_path)
    (a,) = make_nodes(1, checkpoint_root=root)
    try:
        rendezvous_all([a])
        fence.claim_after(root, "unit", 3, "10.9.9.9:1", ("x",), parent=0)  # unsigned, on a host of no node
        eventually(lambda: a.membership_change() is not None)
        assert a.membership_change().kind is st.ChangeKind.FENCED  # type: ignore[union-attr]
        with pytest.raises(Exception, match=r"its store: unknown") as err:
            a.next_rendezvous()  # fenced all the same (the number counts), but never sent to 10.9.9.9
        assert "10.9.9.9" not in str(err.value)
    finally:
        a.shutdown()


def test_another_job_taking_over_the_checkpoint_dir_stops_this_one_with_one_line(tmp_path: Path) -> None:
    from elastrain import fence
    from elastrain.errors import RendezvousError

    root = str(tmp_path)
    (a,) = make_nodes(1, checkpoint_root=root)
    try:
        rendezvous_all([a])
        fence.claim_after(root, "another-job", 0, "10.9.9.9:1", ("x",), parent=0)
        eventually(lambda: a.membership_change() is not None)
        with pytest.raises(RendezvousError, match="one checkpoint directory serves one job"):
            a.next_rendezvous()
    finally:
        a.shutdown()


def test_a_second_store_founded_for_the_same_job_joins_the_running_one(tmp_path: Path) -> None:
    """A node started again at an endpoint where nobody runs any more finds the running job's store."""
    from elastrain import fence
    from elastrain.rendezvous.backends.c10d import create_c10d_handler

    root = str(tmp_path)

    def node(port: int) -> ElastrainRendezvousHandler:
        params = RendezvousParameters(
            backend="c10d",
            endpoint=f"127.0.0.1:{port}",
            run_id="unit",
            min_nodes=1,
            max_nodes=2,
            local_addr="127.0.0.1",
            is_host="true",
            checkpoint_root=root,
            **{**FAST, "last_call_timeout": "0.3"},
        )
        h = create_c10d_handler(params)
        assert isinstance(h, ElastrainRendezvousHandler)
        return h

    from elastrain.binding import free_port

    a = node(free_port("127.0.0.1"))
    b = None
    try:
        rendezvous_all([a])
        assert a.generation == 0
        b = node(free_port("127.0.0.1"))  # its own endpoint: founds a fresh store unless it finds the published one
        got: list[RendezvousInfo] = []
        t = threading.Thread(target=lambda: got.append(b.next_rendezvous()))  # type: ignore[union-attr]
        t.start()
        eventually(lambda: a.membership_change() is not None, timeout=20)
        a.next_rendezvous()
        t.join(timeout=20)
        assert got and got[0].world_size == 2
        assert a.elastrain_round == b.elastrain_round == 1
        assert a.generation == b.generation == 1 == fence.newest(root).generation  # type: ignore[union-attr]
    finally:
        a.shutdown()
        if b is not None:
            b.shutdown()


def test_a_store_call_into_a_network_cut_is_abandoned_and_later_calls_fail_fast() -> None:
    """A TCPStore client whose packets are dropped blocks in its receive forever; the handler gives up in time."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from elastrain.errors import RendezvousStoreLostError
    from elastrain.rendezvous.backends.c10d import create_c10d_handler

    master = TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, timeout=timedelta(seconds=10))
    hole = TcpProxy(master.port)
    params = RendezvousParameters(
        backend="c10d",
        endpoint=f"127.0.0.1:{hole.port}",
        run_id="unit",
        min_nodes=1,
        max_nodes=1,
        local_addr="127.0.0.1",
        is_host="false",
        store_op_timeout="3",
        **FAST,
    )
    a = create_c10d_handler(params)
    assert isinstance(a, ElastrainRendezvousHandler)
    try:
        rendezvous_all([a])
        a.stop_beating()
        hole.drop.set()
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            a._call(lambda: a._store.get("elastrain/unit/version"))
        # The wedged client is not used again: a bounded reconnect is tried, then the store counts as lost.
        with pytest.raises((TimeoutError, RendezvousStoreLostError)):
            a._call(lambda: a._store.get("elastrain/unit/version"))
        assert time.monotonic() - started < 30  # bounded (the cut itself would block forever)
        assert a.membership_change() is None  # the agent's tick returns instead of hanging
    finally:
        hole.drop.clear()
        del master


def test_a_call_stuck_on_a_store_left_meanwhile_never_replaces_the_store_hosted_here() -> None:
    """A frozen store host (SIGSTOP): a heartbeat call stuck on its store times out *after* the main thread moved
    the state onto a store this node hosts (failover). Only the store the call was stuck on counts as wedged: the
    hosted one is never swapped for a client of it, which dropped its server (the node lost its own store, and the
    job, with it: tests/e2e/test_membership.py's frozen node, seen once in the full suite)."""
    from elastrain.rendezvous.backends.c10d import C10dBackend
    from elastrain.rendezvous.connection import Connection, StoreSwitched
    from elastrain.rendezvous.pacing import Throttled
    from elastrain.rendezvous.settings import HandlerSettings

    class Successors:
        movable = True
        resumes = False

        def __init__(self) -> None:
            self.reconnected: list[str] = []

        def finished(self) -> bool:
            return False

        def failover(self, *args: object) -> None:
            return None  # the main thread's failover below stands for it

        def connect_to(self, address: str, timeout_s: float) -> tuple[C10dBackend, HashStore]:
            self.reconnected.append(address)
            store = HashStore()
            return C10dBackend(store, "unit"), store

    frozen, hosted = HashStore(), HashStore()
    hosted.set("k", b"v")
    stores = Successors()
    conn = Connection(
        C10dBackend(frozen, "unit"), frozen, "10.0.0.9:1", False, stores,  # type: ignore[arg-type]
        HandlerSettings(store_op_timeout_s=0.5), "me", "", Throttled(),
    )  # fmt: skip
    conn.joined = True  # a member of the job
    release = threading.Event()
    stuck: list[BaseException] = []

    def heartbeat() -> None:
        try:
            conn.call(lambda: release.wait(5))  # the frozen host does not answer
        except StoreSwitched as exc:  # its time out, on the store left meanwhile: retried on the new one
            stuck.append(exc)

    beat = threading.Thread(target=heartbeat)
    beat.start()
    with conn.lock:  # the failover, on the main thread: this node hosts the store now
        conn.backend, conn.store, conn.address, conn.hosted_here = C10dBackend(hosted, "unit"), hosted, "me:2", True
    beat.join(timeout=10)
    release.set()
    assert stuck, "the stuck call must end: its time out is the old store's, retried on the new one"
    assert conn.call(lambda: conn.store.get("k")) == b"v"  # the hosted store answers, untouched
    assert conn.store is hosted and not stores.reconnected
