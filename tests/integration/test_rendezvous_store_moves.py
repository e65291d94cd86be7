"""A store call that fails, and whether the state store moves for it: real TCPStores, real broken connections.

The state store moves to a successor only when its host is gone. A failure that says nothing about the current
store (a call on a store the node already left, or a connection that broke while its host lives) must never pass
over a live host: the node would host a store of its own, and the job would run as two worlds that never meet.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from datetime import timedelta

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastrain.rendezvous import state as st
from elastrain.rendezvous.backends.c10d import C10dBackend, C10dStores
from elastrain.rendezvous.connection import Connection, StoreSwitched
from elastrain.rendezvous.pacing import Throttled
from elastrain.rendezvous.settings import HandlerSettings

TIMEOUT = timedelta(seconds=5)


class _CuttableProxy:
    """A TCP proxy in front of a store whose open connections can be reset (the store's process lives on)."""

    def __init__(self, target_port: int) -> None:
        self._target = target_port
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.port = int(self._sock.getsockname()[1])
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self._target))
            with self._lock:
                self._open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        except OSError:
            return
        finally:
            dst.close()

    def cut(self) -> None:
        """Reset every connection open now; new ones go through as before."""
        with self._lock:
            doomed, self._open = self._open, []
        for s in doomed:
            with contextlib.suppress(OSError):  # closed by its pipe meanwhile: nothing left to reset
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
                s.close()

    def close(self) -> None:
        self._sock.close()
        self.cut()


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
    proxy = _CuttableProxy(b_store.port)
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
