"""Forged and corrupt rendezvous values, in one process: several handlers ("nodes") over one in-memory store and a
"stranger" that writes into the same store without the job's secret. The job must carry on; nothing it reads
from the stranger may become a member, an address or a redirect."""

from __future__ import annotations

import json
import logging
import time
from base64 import b64encode
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from support.rendezvous_nodes import FAST, eventually, handler, rendezvous_all
from torch.distributed import HashStore
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastrain.env import RDZV_SECRET_FILE
from elastrain.errors import RendezvousError, RendezvousSecretError, RendezvousStateCorruptError
from elastrain.rendezvous import auth
from elastrain.rendezvous import state as st
from elastrain.rendezvous.auth import RendezvousAuth, SignedStore
from elastrain.rendezvous.backends.c10d import C10dBackend
from elastrain.rendezvous.handler import ElastrainRendezvousHandler

SECRET = b"0123456789abcdef0123456789abcdef"
STATE_KEY = "torch.rendezvous.unit"


@pytest.fixture(autouse=True)
def _no_secret_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RDZV_SECRET_FILE, raising=False)


def secret_file(tmp_path: Path, secret: bytes = SECRET) -> str:
    path = tmp_path / f"secret-{len(list(tmp_path.iterdir()))}"
    path.write_bytes(secret)
    path.chmod(0o600)
    return str(path)


def node(store: HashStore, max_nodes: int, **conf: str) -> ElastrainRendezvousHandler:
    return handler(store, max_nodes, **conf)


def stays(pred: Callable[[], object], seconds: float) -> None:
    """``pred`` holds at every check for ``seconds`` (heartbeats run every 0.05 s meanwhile)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert pred()
        time.sleep(0.02)


def stored_state(store: HashStore, secret: bytes | None) -> st.RendezvousState | None:
    try:
        got = C10dBackend(store, "unit").get_state()
        return None if got is None else st.decode(RendezvousAuth(secret, "unit").open_state(got[0]))
    except RendezvousStateCorruptError:
        return None


def forge(store: HashStore, payload: bytes) -> None:
    """What a process without the secret can do: overwrite the state, and tell every node to read it again."""
    store.set(STATE_KEY, b64encode(payload).decode())
    store.add("elastrain/unit/version", 1)


@pytest.fixture
def job(tmp_path: Path) -> Iterator[tuple[HashStore, list[ElastrainRendezvousHandler]]]:
    store = HashStore()
    path = secret_file(tmp_path)
    nodes = [node(store, 2, secret_file=path) for _ in range(2)]
    rendezvous_all(nodes)
    yield store, nodes
    for n in nodes:
        n.shutdown()


def test_a_forged_state_is_ignored_and_restored_and_the_job_carries_on(
    job: tuple[HashStore, list[ElastrainRendezvousHandler]], caplog: pytest.LogCaptureFixture
) -> None:
    store, (a, b) = job
    good = stored_state(store, SECRET)
    assert good is not None and good.round == 0
    evil = st.NodeInfo("10.6.6.6", 1, 2, 3)
    forged = replace(
        good,
        members=("stranger", *good.members),  # the stranger first: its address would become MASTER_ADDR
        nodes={**good.nodes, "stranger": evil},
        heartbeats={**good.heartbeats, "stranger": 0},
        superseded_by="10.6.6.6:29400",  # and every node would be sent to its store
    )
    with caplog.at_level(logging.WARNING):
        forge(store, st.encode(forged))
        eventually(lambda: stored_state(store, SECRET) == good)  # a member wrote its last good state back
        stays(lambda: a.membership_change() is None and b.membership_change() is None, 1.0)
    assert "rendezvous_value_ignored" in caplog.text and "rendezvous_state_restored" in caplog.text
    # The job goes on as before: b leaves, a re-forms alone, and nothing of the stranger's is in its round.
    b.leave("test")
    eventually(lambda: a.membership_change() is not None)
    info = a.next_rendezvous()
    assert info.world_size == 1 and info.bootstrap_store_info.master_addr == "127.0.0.1"  # type: ignore[union-attr]


def test_forged_keys_beside_the_state_are_ignored(job: tuple[HashStore, list[ElastrainRendezvousHandler]]) -> None:
    store, (a, b) = job
    good = stored_state(store, SECRET)
    assert good is not None
    for n in good.members:
        store.set(f"elastrain/unit/beat/{n}", "not a counter")
        store.set(f"elastrain/unit/rejoin/0/{n}", json.dumps(["10.6.6.6", 1, 2, 3]))
    store.set("elastrain/unit/silence", json.dumps({n: 999.0 for n in good.members}))
    store.add("elastrain/unit/rejoin/0/count", 5)
    store.set("elastrain/unit/version", "junk")  # not even a number: the nodes read the state again
    stays(lambda: a.membership_change() is None and b.membership_change() is None, 1.5)
    assert stored_state(store, SECRET) == good


def test_the_store_handed_to_torch_agent_is_sealed(job: tuple[HashStore, list[ElastrainRendezvousHandler]]) -> None:
    _, (a, b) = job
    b.leave("test")
    eventually(lambda: a.membership_change() is not None)
    info = a.next_rendezvous()
    assert isinstance(info.store, SignedStore)
    info.store.set("torchelastic/role_info/0", b'{"role": "default"}')
    assert info.store.get("torchelastic/role_info/0") == b'{"role": "default"}'


def test_a_node_without_the_secret_is_refused_with_one_line(
    job: tuple[HashStore, list[ElastrainRendezvousHandler]],
) -> None:
    store, _ = job
    stranger = node(store, 3)
    with pytest.raises(RendezvousSecretError) as err:
        stranger.next_rendezvous()
    assert str(err.value).startswith("--rdzv-conf secret_file") and "\n" not in str(err.value)
    stranger.stop_beating()


def test_a_node_with_another_secret_is_refused_with_one_line(
    job: tuple[HashStore, list[ElastrainRendezvousHandler]], tmp_path: Path
) -> None:
    store, (a, b) = job
    other = node(store, 3, secret_file=secret_file(tmp_path, b"another secret, 32 bytes long..."))
    with pytest.raises(RendezvousSecretError, match="another secret"):
        other.next_rendezvous()
    other.stop_beating()
    assert a.membership_change() is None and b.membership_change() is None


@pytest.mark.parametrize(
    "payload",
    [
        b'{"round": 0, "members": [], "joining": [], "departed": [], "nodes": {}, "heartbeats": {}, "closed": false}',
        b'{"round": 0, "members": "ab", "joining": [], "departed": {}, "nodes": {}, "heartbeats": {}, "closed": 0}',
        b"[1, 2, 3]",
        b"\xff\xfe not even text",
    ],
)
def test_without_a_secret_a_corrupt_state_is_a_typed_error_that_the_job_survives(
    payload: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    store = HashStore()
    a, b = node(store, 2), node(store, 2)
    try:
        rendezvous_all([a, b])
        good = stored_state(store, None)
        with caplog.at_level(logging.WARNING):
            forge(store, payload)
            eventually(lambda: stored_state(store, None) == good)
            stays(lambda: a.membership_change() is None and b.membership_change() is None, 0.5)
        assert "RendezvousStateCorruptError" in caplog.text
    finally:
        a.shutdown()
        b.shutdown()


def test_a_state_that_is_not_base64_is_written_over(job: tuple[HashStore, list[ElastrainRendezvousHandler]]) -> None:
    store, (a, b) = job
    good = stored_state(store, SECRET)
    store.set(STATE_KEY, "%%% not base64 %")
    store.add("elastrain/unit/version", 1)
    eventually(lambda: stored_state(store, SECRET) == good)
    assert a.membership_change() is None and b.membership_change() is None


def test_a_newcomer_waits_for_a_member_to_restore_a_forged_state_then_founds_the_job_anew(tmp_path: Path) -> None:
    store = HashStore()
    forge(store, st.encode(st.RendezvousState(round=7, members=("ghost",))))  # before any node started
    (a,) = [node(store, 1, secret_file=secret_file(tmp_path))]
    try:
        started = time.monotonic()
        info = a.next_rendezvous()
        assert time.monotonic() - started >= 0.5  # it waited heartbeat_timeout for a member to restore it
        assert info.world_size == 1 and a.elastrain_round == 0
        assert auth.is_sealed(C10dBackend(store, "unit").get_state()[0])  # type: ignore[index]
    finally:
        a.shutdown()


def test_without_a_secret_a_redirect_to_a_host_of_no_member_is_refused(tmp_path: Path) -> None:
    """The state is anyone's to write without a secret: a redirect is followed only to a node of the job."""
    from torch.distributed import TCPStore

    from elastrain.binding import free_port
    from elastrain.rendezvous.backends.c10d import create_c10d_handler

    port = free_port("127.0.0.1")
    params = RendezvousParameters(
        backend="c10d", endpoint=f"127.0.0.1:{port}", run_id="unit", min_nodes=1, max_nodes=1, **FAST
    )
    a = create_c10d_handler(params)
    assert isinstance(a, ElastrainRendezvousHandler)
    try:
        a.next_rendezvous()
        stranger = TCPStore("127.0.0.1", port, is_master=False)
        good = st.decode(C10dBackend(stranger, "unit").get_state()[0])  # type: ignore[index]
        stranger.set(STATE_KEY, b64encode(st.encode(replace(good, superseded_by="10.6.6.6:29400"))).decode())
        stranger.add("elastrain/unit/version", 1)
        eventually(lambda: a.membership_change() is not None)
        with pytest.raises(RendezvousError, match=r"10\.6\.6\.6:29400, which names no node") as err:
            a.next_rendezvous()
        assert "secret_file" in str(err.value)
    finally:
        a.shutdown()
