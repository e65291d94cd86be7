"""The job's rendezvous secret: seals, forgeries, refusals, and the store torch's agent sees (no processes)."""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import DistStoreError, HashStore, PrefixStore
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastrain.env import RDZV_SECRET_FILE
from elastrain.errors import RendezvousForgeryError, RendezvousSecretError, UsageError
from elastrain.fence import Claim, Closed, Vacated
from elastrain.rendezvous import auth
from elastrain.rendezvous import state as st
from elastrain.rendezvous.auth import RendezvousAuth, SignedStore
from elastrain.rendezvous.trust import JobHosts, StandIn, StateUnsettledError, host_of

SECRET = b"0123456789abcdef0123456789abcdef"


def secret_file(tmp_path: Path, secret: bytes = SECRET, name: str = "secret") -> str:
    path = tmp_path / name
    path.write_bytes(secret + b"\n")
    path.chmod(0o600)
    return str(path)


def params(**conf: str) -> RendezvousParameters:
    return RendezvousParameters("c10d", "127.0.0.1:1", "job", 1, 2, **conf)


def test_a_sealed_state_opens_only_with_the_same_secret_and_run() -> None:
    a = RendezvousAuth(SECRET, "job")
    sealed = a.seal_state(b'{"x":1}')
    assert auth.is_sealed(sealed) and a.open_state(sealed) == b'{"x":1}'
    with pytest.raises(RendezvousForgeryError) as other:
        RendezvousAuth(b"another secret of 32 bytes......", "job").open_state(sealed)
    assert other.value.foreign
    with pytest.raises(RendezvousForgeryError) as other_run:
        RendezvousAuth(SECRET, "another-job").open_state(sealed)  # same secret, another job: no replay
    assert not other_run.value.foreign


@pytest.mark.parametrize(
    "forged",
    [
        b'{"round":0}',  # unsigned
        auth.MAGIC + b"short",  # an envelope cut short
        RendezvousAuth(SECRET, "job").seal_state(b'{"x":1}').replace(b'{"x":1}', b'{"x":2}'),  # content changed
    ],
)
def test_forged_states_are_refused(forged: bytes) -> None:
    with pytest.raises(RendezvousForgeryError):
        RendezvousAuth(SECRET, "job").open_state(forged)


def test_a_node_without_the_secret_is_refused_naming_the_setting() -> None:
    sealed = RendezvousAuth(SECRET, "job").seal_state(b"{}")
    with pytest.raises(RendezvousSecretError) as err:
        RendezvousAuth(None, "job").open_state(sealed)
    assert str(err.value).startswith("--rdzv-conf secret_file") and RDZV_SECRET_FILE in str(err.value)
    assert RendezvousAuth(None, "job").open_state(b"{}") == b"{}"  # no secret anywhere: as before


def test_a_key_value_is_bound_to_its_key() -> None:
    a = RendezvousAuth(SECRET, "job")
    sealed = a.seal("elastrain/job/beat/n1", "7")
    assert a.open("elastrain/job/beat/n1", sealed) == b"7"
    with pytest.raises(RendezvousForgeryError):
        a.open("elastrain/job/beat/n2", sealed)  # copied to another node's key


def test_the_secret_comes_from_a_file_never_from_the_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(RDZV_SECRET_FILE, raising=False)
    assert auth.secret_from(params()) is None
    assert auth.secret_from(params(secret_file=secret_file(tmp_path))) == SECRET
    monkeypatch.setenv(RDZV_SECRET_FILE, secret_file(tmp_path, name="env"))
    assert auth.secret_from(params()) == SECRET
    with pytest.raises(UsageError, match=r"^--rdzv-conf secret: a secret on the command line") as err:
        auth.secret_from(params(secret="hunter2hunter2hunter2"))
    assert "hunter2" not in str(err.value)


def test_a_short_or_missing_secret_file_is_one_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="at least 16"):
        auth.secret_from(params(secret_file=secret_file(tmp_path, b"short")))
    with pytest.raises(UsageError, match="cannot be read"):
        auth.secret_from(params(secret_file=str(tmp_path / "missing")))


def test_a_secret_file_others_may_read_is_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = secret_file(tmp_path)
    os.chmod(path, 0o644)
    with caplog.at_level(logging.WARNING):
        auth.secret_from(params(secret_file=path))
    assert "secret_file_shared" in caplog.text


def test_a_claims_store_is_signed_for_its_job() -> None:
    a = RendezvousAuth(SECRET, "job")
    claim = Claim(3, "job", 2, "10.0.0.1:29400", ("n",), 0.0, a.store_mac("10.0.0.1:29400"))
    assert a.signed_store(claim.store, claim.store_mac)
    assert Claim.from_json(claim.to_json()).store_mac == claim.store_mac
    assert not a.signed_store("10.6.6.6:1", claim.store_mac)  # the signature does not move to another store
    assert not RendezvousAuth(None, "job").signed_store(claim.store, claim.store_mac)


def test_the_end_of_a_job_is_signed_for_its_job_and_generation() -> None:
    a = RendezvousAuth(SECRET, "job")
    mark = Closed(4, "job", 0.0, a.close_mac(4))
    assert a.signed_close(mark.generation, Closed.from_json(mark.to_json()).mac)
    assert not a.signed_close(5, mark.mac)  # not another generation's end
    assert not RendezvousAuth(SECRET, "other").signed_close(4, mark.mac)  # nor another job's
    assert not a.signed_close(4, a.store_mac("4"))  # nor a claim's signature
    assert not RendezvousAuth(None, "job").signed_close(4, mark.mac)


def test_the_vacating_of_a_world_is_signed_apart_from_its_close() -> None:
    a = RendezvousAuth(SECRET, "job")
    mark = Vacated(4, "job", 0.0, a.vacate_mac(4))
    assert a.signed_vacate(mark.generation, Vacated.from_json(mark.to_json()).mac)
    assert not a.signed_vacate(5, mark.mac)  # not another generation's
    assert not RendezvousAuth(SECRET, "other").signed_vacate(4, mark.mac)  # nor another job's
    assert not a.signed_vacate(4, a.close_mac(4)) and not a.signed_close(4, mark.mac)  # a close is no vacating
    assert not RendezvousAuth(None, "job").signed_vacate(4, mark.mac)


def test_the_store_torch_agent_sees_seals_values_and_refuses_forged_ones() -> None:
    a = RendezvousAuth(SECRET, "job")
    raw = HashStore()
    raw.set_timeout(timedelta(seconds=5))
    signed = SignedStore(PrefixStore("round0", raw), a, "round0/")
    signed.set("ranks/0", b"[0, 1]")
    signed.multi_set(["ranks/1"], [b"[1, 1]"])
    assert signed.get("ranks/0") == b"[0, 1]" and signed.multi_get(["ranks/1"]) == [b"[1, 1]"]
    assert auth.is_sealed(raw.get("round0/ranks/0"))
    assert signed.add("count", 2) == 2 and raw.get("round0/count") == b"2"  # counters stay plain numbers
    raw.set("round0/ranks/0", "[5, 9]")  # written by a process without the secret
    with pytest.raises(DistStoreError, match="not signed"):
        signed.get("ranks/0")
    raw.set("round1/ranks/0", raw.get("round0/ranks/1"))  # a sealed value replayed in another round
    with pytest.raises(DistStoreError):
        SignedStore(PrefixStore("round1", raw), a, "round1/").get("ranks/0")


def test_a_stand_in_is_the_last_good_state_of_the_same_store() -> None:
    good = st.RendezvousState(round=4, members=("a",))
    s = StandIn(grace_s=5.0, secret=True)
    s.accepted("store-1", good)
    forged = RendezvousForgeryError("forged")
    assert s.replace("store-1", forged) == good
    with pytest.raises(StateUnsettledError):
        s.replace("store-2", forged, now=100.0)  # a newcomer there: wait for a member to restore it
    assert s.replace("store-2", forged, now=106.0) == st.RendezvousState()  # nobody did: found it anew
    with pytest.raises(RendezvousSecretError):
        s.replace("store-2", RendezvousForgeryError("other", foreign=True))  # another secret: refused at once


def test_without_a_secret_a_corrupt_state_nobody_restores_stops_a_newcomer_with_one_line() -> None:
    from elastrain.errors import RendezvousStateCorruptError

    s = StandIn(grace_s=5.0, secret=False)
    corrupt = RendezvousStateCorruptError("not elastrain's; is another launcher using the same --rdzv-id?")
    with pytest.raises(StateUnsettledError):
        s.replace("store", corrupt, now=0.0)
    with pytest.raises(RendezvousStateCorruptError, match="rdzv-id"):
        s.replace("store", corrupt, now=6.0)


def test_job_hosts_name_the_members_seen_and_the_endpoint() -> None:
    hosts = JobHosts("node0:29400", "10.0.0.2")
    hosts.add_state(st.RendezvousState(nodes={"n3": st.NodeInfo("10.0.0.3", 1, 2, 3)}))
    assert hosts.names_member("node0:1") and hosts.names_member("10.0.0.3:555") and hosts.names_member("10.0.0.2:1")
    assert not hosts.names_member("10.6.6.6:29400")
    assert host_of("[fd00::1]:29400") == "fd00::1" and host_of("10.0.0.1:1") == "10.0.0.1"
