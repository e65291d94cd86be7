"""etcd-v3 options from --rdzv-endpoint / --rdzv-conf, and the state framing: pure, no server."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters, RendezvousStateError

from elastrain.errors import RendezvousError, UsageError
from elastrain.rendezvous.backends.etcd_options import EtcdOptions, options_from_params, parse_endpoints, store_address
from elastrain.rendezvous.backends.etcd_v3 import STATE_MAGIC, decode_state, encode_state


def params(endpoint: str = "127.0.0.1:2379", **conf: str) -> RendezvousParameters:
    return RendezvousParameters("etcd-v3", endpoint, "job", 1, 2, **conf)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:2379", (("127.0.0.1", 2379),)),
        ("etcd-a", (("etcd-a", 2379),)),
        ("http://a:1,https://b:2/", (("a", 1), ("b", 2))),
        (" a:1 , b:2 ,", (("a", 1), ("b", 2))),
        ("[::1]:2379", (("::1", 2379),)),
    ],
)
def test_parse_endpoints(text: str, expected: tuple[tuple[str, int], ...]) -> None:
    assert parse_endpoints(text) == expected


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("a:1,b:2", "b:2,a:1"),
        ("a:2379,b:2", "http://b:2, a"),
        ("[::1]:2379,a:1", "a:1,[::1]"),
        ("https://a:1/,a:1", "a:1"),
    ],
)
def test_the_store_address_is_one_string_however_the_endpoints_are_spelled(one: str, other: str) -> None:
    assert store_address(one) == store_address(other)


def test_the_store_address_tells_clusters_apart() -> None:
    assert store_address("a:1,b:2") != store_address("a:1,b:3")
    assert store_address("[::1]:2379,a:1") == "[::1]:2379,a:1"


@pytest.mark.parametrize("text", ["a:b", "a:0", ":2379", "a:70000"])
def test_parse_endpoints_rejects(text: str) -> None:
    with pytest.raises(UsageError, match="--rdzv-endpoint"):
        parse_endpoints(text)


def test_defaults() -> None:
    o = options_from_params(params())
    assert o.endpoints == (("127.0.0.1", 2379),)
    assert o.key_prefix == "/elastrain"
    assert not o.secure
    assert (o.connect_timeout_s, o.request_timeout_s, o.retry_timeout_s, o.lease_ttl_s) == (10.0, 5.0, 60.0, 60)
    assert o.compact_interval_s == 300.0


def test_conf_keys_and_torch_aliases(tmp_path: Path) -> None:
    ca, cert, key, pw = (tmp_path / n for n in ("ca.pem", "c.pem", "k.pem", "pw"))
    for f in (ca, cert, key):
        f.write_text("x")
    pw.write_text("s3cret\n")
    o = options_from_params(
        params(
            "h1:1,h2:2",
            key_prefix="/jobs/",
            cacert=str(ca),
            cert=str(cert),
            key=str(key),
            user="u",
            password_file=str(pw),
            connect_timeout="2.5",
            request_timeout="1",
            retry_timeout="30",
            lease_ttl="20",
        )
    )
    assert o.key_prefix == "/jobs"
    assert (o.ca_cert, o.client_cert, o.client_key) == (str(ca), str(cert), str(key))
    assert (o.user, o.password) == ("u", "s3cret")
    assert (o.connect_timeout_s, o.request_timeout_s, o.retry_timeout_s, o.lease_ttl_s) == (2.5, 1.0, 30.0, 20)
    assert o.describe() == "https://h1:1,https://h2:2"


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ({"user": "u"}, "user and password"),
        ({"client_cert": "/nonexistent"}, "client_cert and client_key"),
        ({"ca_cert": "/nonexistent"}, "ca_cert=/nonexistent is not a readable file"),
        ({"key_prefix": "jobs"}, "must start with '/'"),
        ({"connect_timeout": "soon"}, "connect_timeout must be a number"),
        ({"request_timeout": "0"}, "request_timeout must be > 0"),
        ({"lease_ttl": "1"}, "lease_ttl must be at least 5"),
        ({"compact_interval": "-1"}, "compact_interval must be >= 0"),
        ({"password_file": "/nonexistent"}, "password_file=/nonexistent cannot be read"),
    ],
)
def test_bad_conf_names_the_key(conf: dict[str, str], message: str) -> None:
    with pytest.raises(UsageError, match="--rdzv-conf") as info:
        options_from_params(params(**conf))
    assert message in str(info.value)


def test_a_password_without_tls_is_refused_for_a_remote_etcd_unless_allowed(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"^--rdzv-conf password: .*clear text.*allow_insecure_password=true") as err:
        options_from_params(params("127.0.0.1:2379,10.0.0.9:2379", user="u", password="hunter2"))
    assert "hunter2" not in str(err.value) and "10.0.0.9:2379" in str(err.value)
    assert options_from_params(params("127.0.0.1:2379", user="u", password="p")).password == "p"  # loopback only
    allowed = options_from_params(params("10.0.0.9:2379", user="u", password="p", allow_insecure_password="true"))
    assert allowed.allow_insecure_password
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    assert options_from_params(params("10.0.0.9:2379", user="u", password="p", ca_cert=str(ca))).secure
    with pytest.raises(UsageError, match="allow_insecure_password must be true or false"):
        options_from_params(params(allow_insecure_password="maybe"))


def test_no_endpoint() -> None:
    with pytest.raises(UsageError, match="--rdzv-endpoint"):
        EtcdOptions(endpoints=())


def test_state_framing_round_trips_and_rejects_foreign_values() -> None:
    assert decode_state(encode_state(b"\x00abc"), "k") == b"\x00abc"
    assert encode_state(b"").startswith(STATE_MAGIC)
    with pytest.raises(RendezvousStateError) as info:
        decode_state(b"garbage", "/elastrain/job/state")
    # Both torch's error (its handlers catch it) and elastrain's hierarchy.
    assert isinstance(info.value, RendezvousError)
    assert "/elastrain/job/state" in str(info.value)
