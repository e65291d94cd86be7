"""The etcd-v3 backend and store against a real etcd 3.5 (started here on a free loopback port).

The backend contract follows pytorch's rendezvous_backend_test.py (empty state, set with no/stale/invalid
token, corrupt state) plus concurrent writers and a large state; the store contract covers what torch's
agent and rendezvous call (through a PrefixStore, as they do). Then outages: an unreachable endpoint at
start, failover between endpoints, an etcd restart mid-call, TLS with client certificates and auth.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from support.processes import free_port
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters, RendezvousStateError

from bench.support.etcd_server import EtcdCluster, EtcdServer, make_tls_files
from elastrain.errors import RendezvousError, UsageError
from elastrain.rendezvous.backends.etcd_client import EtcdUnavailableError
from elastrain.rendezvous.backends.etcd_store import EtcdStore
from elastrain.rendezvous.backends.etcd_v3 import EtcdV3RendezvousBackend, create_backend

pytestmark = pytest.mark.etcd


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    with EtcdServer(tmp_path_factory.mktemp("etcd")) as server:
        yield server


_made: list[EtcdV3RendezvousBackend] = []


def make(endpoint: str, run_id: str | None = None, **conf: str) -> tuple[EtcdV3RendezvousBackend, EtcdStore]:
    params = RendezvousParameters("etcd-v3", endpoint, run_id or uuid.uuid4().hex, 1, 3, **conf)
    backend, store = create_backend(params)
    assert isinstance(backend, EtcdV3RendezvousBackend) and isinstance(store, EtcdStore)
    _made.append(backend)
    return backend, store


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    """Stop each test's lease keep-alive threads (they would go on retrying a stopped server)."""
    yield
    while _made:
        _made.pop().client.close()


@pytest.fixture
def backend(etcd: EtcdServer) -> EtcdV3RendezvousBackend:
    return make(etcd.endpoint)[0]


@pytest.fixture
def store(etcd: EtcdServer) -> Iterator[dist.Store]:
    # Keep the Python store alive while C++ holds it: pybind drops a dead subclass's overrides.
    _, raw = make(etcd.endpoint)
    yield dist.PrefixStore("torch.rendezvous.run.1", raw)
    del raw


# -- backend contract (pytorch's rendezvous_backend_test.py) ------------------------------------------------
def test_name(backend: EtcdV3RendezvousBackend) -> None:
    assert backend.name == "etcd-v3"


def test_get_state_none_when_empty(backend: EtcdV3RendezvousBackend) -> None:
    assert backend.get_state() is None


def test_set_state_when_absent_then_get(backend: EtcdV3RendezvousBackend) -> None:
    assert backend.set_state(b"x") == (b"x", pytest.approx(0, abs=10**12), True)
    got = backend.get_state()
    assert got is not None and got[0] == b"x" and got[1] is not None


def test_set_state_with_current_token(backend: EtcdV3RendezvousBackend) -> None:
    _, token1, ok1 = backend.set_state(b"x") or (None, None, False)
    state2, token2, ok2 = backend.set_state(b"y", token1) or (None, None, False)
    assert (state2, ok1, ok2) == (b"y", True, True)
    assert token2 != token1
    assert backend.get_state() == (b"y", token2)


def test_set_state_with_stale_token_returns_current(backend: EtcdV3RendezvousBackend) -> None:
    _, token1, _ = backend.set_state(b"x") or (None, None, False)
    state2, token2, _ = backend.set_state(b"y", token1) or (None, None, False)
    assert backend.set_state(b"z", token1) == (state2, token2, False)


@pytest.mark.parametrize("token", [None, "invalid", True, 10**15])
def test_set_state_with_none_or_invalid_token_returns_current(backend: EtcdV3RendezvousBackend, token: object) -> None:
    state1, token1, _ = backend.set_state(b"x") or (None, None, False)
    assert backend.set_state(b"y", token) == (state1, token1, False)


def test_get_state_raises_on_corrupt_state(etcd: EtcdServer, backend: EtcdV3RendezvousBackend) -> None:
    etcd.client().put(backend.key, b"not written by elastrain")
    with pytest.raises(RendezvousStateError, match=backend.key):
        backend.get_state()


def test_large_state(backend: EtcdV3RendezvousBackend) -> None:
    big = bytes(range(256)) * 1400  # 350 KiB, about the state of 4,096 nodes
    state, token, ok = backend.set_state(big) or (None, None, False)
    assert ok and state == big
    assert backend.get_state() == (big, token)


def test_concurrent_writers_never_lose_an_update(etcd: EtcdServer) -> None:
    """Four clients (four 'nodes') increment a counter in the state by compare-and-set."""
    run_id = uuid.uuid4().hex
    backends = [make(etcd.endpoint, run_id)[0] for _ in range(4)]
    per_writer = 25
    errors: list[BaseException] = []

    def writer(b: EtcdV3RendezvousBackend) -> None:
        try:
            done = 0
            while done < per_writer:
                got = b.get_state()
                value, token = (0, None) if got is None else (int(got[0]), got[1])
                result = b.set_state(str(value + 1).encode(), token)
                if result is not None and result[2]:
                    done += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(b,)) for b in backends]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    final = backends[0].get_state()
    assert final is not None and int(final[0]) == 4 * per_writer


# -- store contract ---------------------------------------------------------------------------------------
def test_store_set_get_and_blocking_get(store: dist.Store) -> None:
    store.set("a", "1")
    assert store.get("a") == b"1"
    threading.Timer(0.3, lambda: store.set("late", b"\x00\xff")).start()
    assert store.get("late") == b"\x00\xff"


def test_store_get_times_out_with_diststoreerror(store: dist.Store) -> None:
    store.set_timeout(timedelta(seconds=0.3))
    with pytest.raises(dist.DistStoreError, match="missing"):
        store.get("missing")
    with pytest.raises(dist.DistStoreError):
        store.wait(["missing"], timedelta(milliseconds=50))


def test_store_add_is_atomic(etcd: EtcdServer) -> None:
    run_id = uuid.uuid4().hex
    stores = [make(etcd.endpoint, run_id)[1] for _ in range(3)]
    results: list[int] = []

    def adder(s: EtcdStore) -> None:
        results.extend(s.add("counter", 1) for _ in range(20))

    threads = [threading.Thread(target=adder, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(results) == list(range(1, 61))
    assert stores[0].add("counter", 0) == 60


def test_store_add_to_a_non_number_is_a_typed_store_error(store: dist.Store) -> None:
    store.set("counter", "not a number")  # written by something else: c10d's stores refuse it too
    with pytest.raises(dist.DistStoreError, match="no integer"):
        store.add("counter", 1)


def test_store_compare_set_semantics(store: dist.Store) -> None:
    assert store.compare_set("k", "", "v1") == b"v1"  # absent + empty expected: set
    assert store.compare_set("k", "v1", "v2") == b"v2"  # matches: set
    assert store.compare_set("k", "v1", "v3") == b"v2"  # stale: current value
    assert store.compare_set("absent", "x", "y") == b"x"  # absent + non-empty expected: expected
    assert store.get("k") == b"v2"
    assert not store.check(["absent"])


def test_store_wait_check_multi(store: dist.Store) -> None:
    assert not store.check(["m1", "m2"])
    threading.Timer(0.2, lambda: store.multi_set(["m1", "m2"], ["a", b"b"])).start()
    store.wait(["m1", "m2"], timedelta(seconds=10))
    assert store.check(["m1", "m2"])
    assert store.multi_get(["m2", "m1"]) == [b"b", b"a"]
    many = [f"r{i}" for i in range(300)]  # more than one etcd transaction (128 ops)
    store.multi_set(many, [str(i) for i in range(300)])
    assert store.multi_get(many) == [str(i).encode() for i in range(300)]


def test_store_delete_and_num_keys(etcd: EtcdServer) -> None:
    _, raw = make(etcd.endpoint)
    raw.set("x", "1")
    raw.set("y", "2")
    assert raw.num_keys() == 2
    assert raw.delete_key("x") is True
    assert raw.delete_key("x") is False
    assert raw.num_keys() == 1


def test_torch_barrier_and_rank_exchange(etcd: EtcdServer) -> None:
    """torch's own store utilities, as the agent runs them (exit barrier, synchronize)."""
    from torch.distributed.elastic.utils import store as store_util

    run_id = uuid.uuid4().hex
    raw = [make(etcd.endpoint, run_id)[1] for _ in range(3)]
    stores = [dist.PrefixStore("agents", s) for s in raw]
    out: dict[int, list[bytes]] = {}

    def agent(rank: int) -> None:
        out[rank] = store_util.synchronize(stores[rank], f"data{rank}".encode(), rank, 3, "sync/", timeout=30)
        store_util.barrier(stores[rank], 3, "exit/", barrier_timeout=30)

    threads = [threading.Thread(target=agent, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert out == {r: [b"data0", b"data1", b"data2"] for r in range(3)}


# -- keys, leases, cleanup ----------------------------------------------------------------------------------
def test_every_key_is_under_the_run_and_on_the_job_lease(etcd: EtcdServer) -> None:
    run_id = uuid.uuid4().hex
    backend, store = make(etcd.endpoint, run_id, key_prefix="/custom")
    backend2, _ = make(etcd.endpoint, run_id, key_prefix="/custom")
    backend.set_state(b"s")
    store.set("a", "1")
    kvs = list(etcd.client().get_prefix("/custom/"))
    assert {m.key.decode() for _, m in kvs} == {f"/custom/{run_id}/{k}" for k in ("lease", "state", "store/a")}
    lease = backend.client.lease_id()
    assert backend2.client.lease_id() == lease  # one lease for the whole job
    assert {m.lease_id for _, m in kvs} == {lease}
    ttl = etcd.client().get_lease_info(lease).TTL
    assert 0 < ttl <= 60


def test_expired_job_lease_is_replaced(etcd: EtcdServer) -> None:
    """If every agent was gone long enough for the lease to expire, writes re-create it."""
    backend, store = make(etcd.endpoint)
    backend.set_state(b"s")
    old = backend.client.lease_id()
    etcd.client().revoke_lease(old)  # what expiry does: every key of the job disappears
    assert backend.get_state() is None
    store.set("again", "1")
    assert backend.client.lease_id() != old
    assert backend.set_state(b"t") is not None


# -- outages ------------------------------------------------------------------------------------------------
def test_unreachable_etcd_fails_fast_naming_the_endpoint() -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(EtcdUnavailableError) as info:
        make(endpoint, connect_timeout="1")
    assert time.monotonic() - start < 10
    assert endpoint in str(info.value) and "--rdzv-endpoint" in str(info.value)
    assert isinstance(info.value, RendezvousError) and isinstance(info.value, RendezvousConnectionError)


def test_failover_to_a_live_endpoint(etcd: EtcdServer) -> None:
    dead = f"127.0.0.1:{free_port()}"
    backend, _ = make(f"{dead},{etcd.endpoint},{dead}", connect_timeout="5")
    for i in range(5):
        assert backend.set_state(str(i).encode(), (backend.get_state() or (b"", None))[1]) is not None


def test_failover_when_a_cluster_member_dies(tmp_path: Path) -> None:
    """A three-member cluster: whichever member the client uses dies, the next request goes to another."""
    with EtcdCluster(tmp_path / "cluster", size=3) as cluster:
        backend, store = make(cluster.endpoints, connect_timeout="10")
        _, token, _ = backend.set_state(b"0") or (None, None, False)
        for i in range(2):  # two of three down would lose quorum: one at a time
            in_use = backend.client._current().endpoint_in_use.netloc
            member = next(m for m in cluster.members if m.endpoint == in_use)
            member.stop()
            got = backend.set_state(str(i + 1).encode(), token)
            assert got is not None and got[2], got
            token = got[1]
            store.set(f"k{i}", "v")
            assert backend.client._current().endpoint_in_use.netloc != in_use
            member.start()
        assert backend.get_state() == (b"2", token)


def test_etcd_restart_pauses_then_resumes(tmp_path: Path) -> None:
    with EtcdServer(tmp_path / "etcd") as server:
        backend, store = make(server.endpoint)
        backend.set_state(b"before")
        server.stop()
        threading.Timer(1.5, server.start).start()
        start = time.monotonic()
        got = backend.get_state()  # blocks through the outage, within retry_timeout
        assert got is not None and got[0] == b"before"
        assert time.monotonic() - start >= 1.0
        store.set("after", "1")
        assert store.get("after") == b"1"


def test_outage_longer_than_retry_timeout_raises(tmp_path: Path) -> None:
    with EtcdServer(tmp_path / "etcd") as server:
        backend, _ = make(server.endpoint, retry_timeout="1")
        server.stop()
        with pytest.raises(EtcdUnavailableError, match=server.endpoint):
            backend.get_state()


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "tls"])
def test_auth_and_tls_survive_a_restart(tmp_path: Path, tls: bool) -> None:
    files = make_tls_files(tmp_path / "tls") if tls else None
    with EtcdServer(tmp_path / "etcd", tls=files) as server:
        server.enable_auth("trainer", "pw", prefix="/elastrain/")
        conf = {"user": "trainer", "password": "pw"}
        if files is not None:
            conf.update(
                ca_cert=str(files.ca_cert), client_cert=str(files.client_cert), client_key=str(files.client_key)
            )
        backend, store = make(server.endpoint, **conf)
        backend.set_state(b"secure")
        server.restart()  # etcd forgets auth tokens: the client logs in again
        assert (backend.get_state() or (None,))[0] == b"secure"
        store.set("k", "v")
        assert store.get("k") == b"v"
        # Without a user: refused (with a client certificate, etcd takes its common name as the user).
        with pytest.raises(UsageError, match="certificate's common name" if tls else "requires authentication"):
            make(server.endpoint, **{k: v for k, v in conf.items() if k not in ("user", "password")})
        with pytest.raises(UsageError, match="user/password"):
            make(server.endpoint, **{**conf, "password": "wrong"})
        with pytest.raises(UsageError, match="denied"):
            make(server.endpoint, **{**conf, "key_prefix": "/elsewhere"})
        if files is not None:
            # Without the CA the TLS handshake fails: unreachable, named, fast.
            with pytest.raises(EtcdUnavailableError, match=server.endpoint):
                make(server.endpoint, connect_timeout="1")


def test_history_is_compacted(etcd: EtcdServer) -> None:
    """Every heartbeat rewrites the state; old versions must not pile up until etcd's quota is hit."""
    backend, _ = make(etcd.endpoint, compact_interval="300")
    _, first, _ = backend.set_state(b"v0") or (None, 0, False)
    token = first
    for i in range(1, 5):
        token = (backend.set_state(f"v{i}".encode(), token) or (None, 0, False))[1]
    backend.client.compact_history()  # sets the mark
    backend.client.compact_history()  # compacts up to it
    with pytest.raises(Exception) as info:
        etcd.client().get(backend.key, revision=first)
    assert "compacted" in str(info.value) or "OUT_OF_RANGE" in str(info.value)
    assert backend.get_state() == (b"v4", token)


def test_torch_dynamic_handler_forms_a_round_on_this_backend(etcd: EtcdServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cross-check with torch's own DynamicRendezvousHandler: two nodes, one round, one store."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # no TCPStore server in this test process
    run_id = uuid.uuid4().hex
    handlers = []
    for _ in range(2):
        backend, store = make(etcd.endpoint, run_id)
        params = RendezvousParameters("etcd-v3", etcd.endpoint, run_id, 2, 2, join_timeout="60", local_addr="127.0.0.1")
        handlers.append((create_handler(store, backend, params), store))
    results: dict[int, tuple[int, int, str]] = {}

    def join(i: int) -> None:
        info = handlers[i][0].next_rendezvous()
        results[i] = (info.rank, info.world_size, info.bootstrap_store_info.master_addr)

    threads = [threading.Thread(target=join, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(r[:2] for r in results.values()) == [(0, 2), (1, 2)]
    for handler, _ in handlers:
        handler.shutdown()
