"""A store call that fails, and whether the state store moves for it: real TCPStores, real broken connections.

The state store moves to a successor only when its host is gone. A failure that says nothing about the current
store (a call on a store the node already left, or a connection that broke while its host lives) must never pass
over a live host: the node would host a store of its own, and the job would run as two worlds that never meet.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from support.processes import free_port
from support.rendezvous_nodes import eventually
from support.tcp_proxy import TcpProxy
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastrain import fence, fence_moves
from elastrain.rendezvous import fence_marks
from elastrain.rendezvous import state as st
from elastrain.rendezvous.backends.c10d import C10dBackend, C10dStores
from elastrain.rendezvous.connection import Connection, StoreSwitched
from elastrain.rendezvous.pacing import Throttled
from elastrain.rendezvous.settings import HandlerSettings

TIMEOUT = timedelta(seconds=5)


class _Stores(C10dStores):
    """The real c10d store factory, its failover recorded and refused (no successor is needed here)."""

    def __init__(self, endpoint: str) -> None:
        params = RendezvousParameters(
            backend="c10d", endpoint=endpoint, run_id="unit", min_nodes=1, max_nodes=3, is_host="false"
        )
        super().__init__(params)
        self.failovers: list[BaseException] = []

    def failover(self, cached: st.RendezvousState, me: str, exc: BaseException, timeout_s: float) -> None:  # type: ignore[override]
        self.failovers.append(exc)
        return None


def _a_member_of(store: TCPStore, address: str, stores: _Stores) -> Connection:
    """Node c's connection to ``store``, hosted by node b, as a member of a job of nodes b and c."""
    conn = Connection(
        C10dBackend(store, "unit"), store, address, False, stores,
        HandlerSettings(store_op_timeout_s=5.0, store_lost_timeout_s=3.0), "c", "", Throttled(),
    )  # fmt: skip
    nodes = {n: st.NodeInfo(addr="127.0.0.1", master_port=1) for n in ("b", "c")}
    conn.cached = st.RendezvousState(nodes=nodes, members=["b", "c"], store_host="b")
    conn.joined = True
    return conn


def test_a_call_on_the_store_this_node_just_left_is_retried_on_the_new_one_and_never_passes_over_its_host() -> None:
    """Node c failed over to b's store; a call still on the dead host's store (taken before the move, or in flight
    during it) fails there. That failure is retried on b's store: c never fails over again, past b (seen once: c
    then hosted a store of its own, and the two survivors waited apart until they gave up)."""
    dead_host = TCPStore("127.0.0.1", 0, is_master=True, timeout=TIMEOUT)
    old = TCPStore("127.0.0.1", dead_host.port, is_master=False, timeout=TIMEOUT)
    old.set("k", b"v")
    b_store = TCPStore("127.0.0.1", 0, is_master=True, timeout=TIMEOUT)
    stores = _Stores(f"127.0.0.1:{dead_host.port}")
    conn = _a_member_of(old, f"127.0.0.1:{dead_host.port}", stores)
    del dead_host  # its host's process is gone: calls on ``old`` fail with a broken connection

    # In flight: the call starts on the old store; another thread (the heartbeat's) moves to b's meanwhile.
    moved = threading.Event()

    def in_flight() -> bytes:
        moved.wait(5)
        return old.get("k")

    def move() -> None:
        with conn.lock:
            conn.backend, conn.store, conn.address = C10dBackend(b_store, "unit"), b_store, f"127.0.0.1:{b_store.port}"
        moved.set()

    threading.Timer(0.2, move).start()
    with pytest.raises(StoreSwitched):
        conn.call(in_flight)
    # Taken before the move: never sent to the old store at all.
    with pytest.raises(StoreSwitched):
        conn.call(lambda: old.get("k"), on=old)
    assert not stores.failovers and conn.store is b_store and not conn.failing
    b_store.set("x", b"1")
    assert conn.call(lambda: conn.store.get("x")) == b"1"  # the retry, on b's store


def test_a_broken_connection_to_a_live_store_is_replaced_by_a_fresh_one_not_failed_over() -> None:
    """The connection to b's store breaks while b lives (its port still listens): c connects to b's store again
    and retries there, instead of taking b for silent and hosting a store of its own."""
    b_store = TCPStore("127.0.0.1", 0, is_master=True, timeout=TIMEOUT)
    b_store.set("k", b"v")
    proxy = TcpProxy(b_store.port)
    address = f"127.0.0.1:{proxy.port}"
    stores = _Stores(address)
    client = TCPStore("127.0.0.1", proxy.port, is_master=False, timeout=TIMEOUT)
    conn = _a_member_of(client, address, stores)
    try:
        assert conn.call(lambda: conn.store.get("k")) == b"v"
        proxy.cut()
        with pytest.raises(StoreSwitched):
            conn.call(lambda: conn.store.get("k"))
        assert not stores.failovers
        assert conn.store is not client and conn.address == address
        assert conn.call(lambda: conn.store.get("k")) == b"v"  # the fresh connection, to the same store
    finally:
        proxy.close()


def test_a_store_port_that_listens_again_after_its_hosts_process_died_is_not_reconnected_to() -> None:
    """b's process is gone (its probe port refuses), yet something listens at its store's port again (a replaced VM
    that hosts the endpoint anew, with a fresh state): that is not b's store, and c fails over as before."""
    b_store = TCPStore("127.0.0.1", 0, is_master=True, timeout=TIMEOUT)
    proxy = TcpProxy(b_store.port)
    address = f"127.0.0.1:{proxy.port}"
    stores = _Stores(address)
    conn = _a_member_of(TCPStore("127.0.0.1", proxy.port, is_master=False, timeout=TIMEOUT), address, stores)
    b = conn.cached.nodes["b"]
    nodes = {
        **conn.cached.nodes,
        "b": st.NodeInfo(b.addr, b.master_port, probe_port=int(_dead_address().split(":")[1])),
    }
    conn.cached = dataclasses.replace(conn.cached, nodes=nodes)
    try:
        proxy.cut()
        with pytest.raises(Exception) as failed:
            conn.call(lambda: conn.store.get("k"))
        assert not isinstance(failed.value, StoreSwitched)
        assert len(stores.failovers) == 1  # straight to the failover (the recording factory finds no successor)
    finally:
        proxy.close()


def test_a_store_whose_host_is_gone_still_fails_over() -> None:
    """Nothing listens at the store's port any more (its host's process died): no reconnect is tried, and the
    failover to a successor goes ahead."""
    b_store = TCPStore("127.0.0.1", 0, is_master=True, timeout=TIMEOUT)
    address = f"127.0.0.1:{b_store.port}"
    client = TCPStore("127.0.0.1", b_store.port, is_master=False, timeout=TIMEOUT)
    stores = _Stores(address)
    conn = _a_member_of(client, address, stores)
    del b_store
    with pytest.raises(Exception) as failed:
        conn.call(lambda: conn.store.get("k"))
    assert not isinstance(failed.value, StoreSwitched)  # the recording factory found no successor
    assert len(stores.failovers) == 1 and conn.store is client and conn.failing


def _dead_address() -> str:
    """``127.0.0.1:port`` where nothing listens any more (a store whose host's process is gone)."""
    gone = TCPStore("127.0.0.1", 0, is_master=True, timeout=TIMEOUT)
    address = f"127.0.0.1:{gone.port}"
    del gone
    return address


def test_the_successor_that_hosts_the_store_records_where_it_moved_and_a_node_on_its_way_in_finds_it(
    tmp_path: Path,
) -> None:
    """The world of generation 3 formed on b's store (its claim says so); b left or died and c hosts the store on
    its standby port, with no new round to claim it. c records the move beside the claim, and a node starting later
    joins c's store, instead of founding the job again at the original endpoint (whose port b's departure freed)
    and fencing the running world 30 s later (seen once in tests/e2e/test_membership.py's spare)."""
    root = str(tmp_path)
    b_store = _dead_address()
    fence.claim_fresh(root, "unit", 1, b_store, ("b", "c"))  # generation 0
    fence.claim_fresh(root, "unit", 1, b_store, ("b", "c"))  # generation 1, the running world's
    standby = free_port()
    nodes = {
        "b": st.NodeInfo(addr="127.0.0.1", master_port=1, probe_port=int(b_store.split(":")[1]), standby_port=1),
        "c": st.NodeInfo(addr="127.0.0.1", master_port=1, standby_port=standby),
    }
    cached = st.RendezvousState(
        round=1, nodes=nodes, members=["b", "c"], store_host="b", generation=1, generation_round=1
    )
    c = C10dStores(_params(b_store, root))
    c.root = root
    got = c.failover(cached, "c", ConnectionResetError("the store's host is gone"), 3.0)
    assert got is not None
    _, hosted, address, here = got
    assert here and address == f"127.0.0.1:{standby}"
    eventually(lambda: [m.store for m in fence_moves.moves(root, 1)] == [address])

    newcomer = C10dStores(_params(b_store, root))
    _, hosts, found = newcomer.first(_params(b_store, root))
    assert found == address and not hosts
    del hosted


def test_a_move_of_an_older_generation_or_another_job_is_not_followed(tmp_path: Path) -> None:
    root = str(tmp_path)
    live = TCPStore("127.0.0.1", 0, is_master=True, timeout=TIMEOUT)
    address = f"127.0.0.1:{live.port}"
    state = st.RendezvousState(round=0, nodes={"a": st.NodeInfo("127.0.0.1", 1)}, members=["a"], store_host="a")
    C10dBackend(live, "unit").set_state(st.encode(state), None)
    dead = _dead_address()
    fence.claim_fresh(root, "unit", 0, dead, ("a",))
    fence_moves.record(root, fence_moves.Moved(0, "other-job", address))
    assert C10dStores(_params(dead, root))._published(root, fence_marks.newest_claim(root)[1]) is None
    fence.claim_fresh(root, "unit", 1, dead, ("a",))  # generation 1: the move of generation 0 is history
    fence_moves.record(root, fence_moves.Moved(0, "unit", address))
    assert C10dStores(_params(dead, root))._published(root, fence_marks.newest_claim(root)[1]) is None
    fence_moves.record(root, fence_moves.Moved(1, "unit", address))
    published = C10dStores(_params(dead, root))._published(root, fence_marks.newest_claim(root)[1])
    assert published is not None and published[2] == address


def _params(endpoint: str, root: str) -> RendezvousParameters:
    return RendezvousParameters(
        backend="c10d", endpoint=endpoint, run_id="unit", min_nodes=1, max_nodes=3, is_host="false",
        local_addr="127.0.0.1", checkpoint_root=root, read_timeout="2",
    )  # fmt: skip


def test_two_threads_whose_calls_fail_together_move_the_store_once() -> None:
    """The heartbeat and the main thread both meet the dead host's store: one fails over, and the other, whose
    call failed on that same store while the first moved, retries on the new store instead of failing over again
    (seen: a member hosted its store twice, 2 ms apart, each time seeded from its stale state)."""
    dead_host = TCPStore("127.0.0.1", 0, is_master=True, timeout=TIMEOUT)
    old = TCPStore("127.0.0.1", dead_host.port, is_master=False, timeout=TIMEOUT)
    successor = TCPStore("127.0.0.1", 0, is_master=True, timeout=TIMEOUT)

    class Slow(_Stores):
        def failover(self, cached: st.RendezvousState, me: str, exc: BaseException, timeout_s: float):  # type: ignore[no-untyped-def]
            self.failovers.append(exc)
            time.sleep(0.5)  # the other thread's call fails meanwhile
            return C10dBackend(successor, "unit"), successor, f"127.0.0.1:{successor.port}", False

    stores = Slow(f"127.0.0.1:{dead_host.port}")
    conn = _a_member_of(old, f"127.0.0.1:{dead_host.port}", stores)
    del dead_host
    start = threading.Barrier(2)
    ended: list[BaseException] = []

    def beat() -> None:
        start.wait()
        try:
            conn.call(lambda: old.get("k"))
        except StoreSwitched as exc:
            ended.append(exc)

    threads = [threading.Thread(target=beat) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(ended) == 2 and len(stores.failovers) == 1 and conn.store is successor
