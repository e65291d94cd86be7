"""elastrain's rendezvous handler in one process: several handlers ("nodes") over one in-memory store."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from torch.distributed import HashStore
from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

from elastrain.errors import NodeLeftError
from elastrain.rendezvous import state as st
from elastrain.rendezvous.handler import ElastrainRendezvousHandler, HandlerSettings
from elastrain.rendezvous.registry import ETCD_V3, TORCH_C10D, etcd_v3_handler_creator, register_handlers

FAST = {"heartbeat_interval": "0.05", "heartbeat_timeout": "0.5", "last_call_timeout": "5"}


def make_nodes(n: int, **conf: str) -> list[ElastrainRendezvousHandler]:
    store = HashStore()
    params = RendezvousParameters(
        backend="c10d", endpoint="127.0.0.1:0", run_id="unit", min_nodes=1, max_nodes=n, **{**FAST, **conf}
    )
    return [ElastrainRendezvousHandler(C10dRendezvousBackend(store, "unit"), store, params) for _ in range(n)]


def rendezvous_all(nodes: list[ElastrainRendezvousHandler]) -> list[RendezvousInfo]:
    out: list[RendezvousInfo | None] = [None] * len(nodes)

    def go(i: int) -> None:
        out[i] = nodes[i].next_rendezvous()

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert all(o is not None for o in out), "a rendezvous did not complete"
    return [o for o in out if o is not None]


def eventually(pred: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


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
    finally:
        a.shutdown()
        b.shutdown()


def test_leave_makes_survivor_reform_at_once() -> None:
    a, b = make_nodes(2)
    try:
        rendezvous_all([a, b])
        b.leave("SIGTERM")
        change = a.membership_change()
        assert change is not None and change.kind is st.ChangeKind.DEPARTED
        assert a.num_nodes_waiting() >= 1
        started = time.monotonic()
        info = a.next_rendezvous()
        assert time.monotonic() - started < 5  # no last call: a was the only live member
        assert (info.world_size, info.rank, a.elastrain_round) == (1, 0, 1)
        with pytest.raises(NodeLeftError):
            b.next_rendezvous()
    finally:
        a.shutdown()


def test_silent_node_is_evicted_by_heartbeat_and_rejoins_as_newcomer() -> None:
    a, b = make_nodes(2)
    try:
        rendezvous_all([a, b])
        b._stop_heartbeat()  # b "freezes": its heartbeat stops, its process (probe) stays alive
        eventually(lambda: str(a.membership_change()).startswith("departed"))
        assert str(b.membership_change()) == "evicted: this node was evicted"
        a.next_rendezvous()
        assert a.elastrain_round == 1
        # b comes back: it is a newcomer now, a sees it waiting, both form round 2.
        joined = threading.Thread(target=b.next_rendezvous)
        joined.start()
        eventually(lambda: str(a.membership_change()) == f"scale_up: waiting: {b.node_id}")
        info = a.next_rendezvous()
        joined.join(timeout=10)
        assert info.world_size == 2
        assert a.elastrain_round == b.elastrain_round == 2
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


def test_settings_refuse_a_timeout_that_evicts_busy_nodes() -> None:
    with pytest.raises(Exception, match="heartbeat_timeout"):
        HandlerSettings(heartbeat_interval_s=1.0, heartbeat_timeout_s=1.5)


def test_registry_serves_elastrain_c10d_and_keeps_torch_and_etcd_names() -> None:
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    register_handlers()
    known = rendezvous_handler_registry._registry
    assert known["c10d"].__module__ == "elastrain.rendezvous.registry"
    assert TORCH_C10D in known and ETCD_V3 in known
    assert callable(etcd_v3_handler_creator())
