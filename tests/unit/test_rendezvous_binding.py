"""Where a node listens: the interface of the address it advertises (the servers themselves:
tests/integration/test_rendezvous_binding_listen.py)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import psutil
import pytest

from elastrain import binding, ports


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("localhost", True), ("127.0.0.1", True), ("127.0.1.1", True), ("::1", True), ("[::1]", True),
     ("10.0.0.1", False), ("node0", False), ("0.0.0.0", False)],
)  # fmt: skip
def test_is_loopback(host: str, loopback: bool) -> None:
    assert binding.is_loopback(host) is loopback


@pytest.mark.parametrize(
    ("endpoint", "hosts", "loopback"),
    [
        ("localhost:0", ["localhost"], True),
        ("127.0.0.1:29400", ["127.0.0.1"], True),
        ("http://127.0.0.1:2379,https://[::1]:2380", ["127.0.0.1", "::1"], True),
        ("127.0.0.1:2379,10.0.0.2:2379", ["127.0.0.1", "10.0.0.2"], False),
        ("node0", ["node0"], False),
        ("", [], False),
    ],
)
def test_a_loopback_run_is_one_whose_endpoints_are_all_loopback(
    endpoint: str, hosts: list[str], loopback: bool
) -> None:
    assert binding.endpoint_hosts(endpoint) == hosts
    assert binding.loopback_run(endpoint) is loopback


def test_a_node_of_a_loopback_run_advertises_loopback_unless_told_otherwise() -> None:
    assert binding.advertised_address(None, "localhost:0") == "127.0.0.1"
    assert binding.advertised_address("10.0.0.7", "localhost:0") == "10.0.0.7"


def test_listen_host_is_the_named_interface_or_every_one_when_none_fits() -> None:
    assert binding.listen_host("localhost") == "127.0.0.1"
    assert binding.listen_host("127.0.0.1") == "127.0.0.1"
    assert binding.listen_host("192.0.2.254") == binding.ANY  # TEST-NET: no interface of this machine
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            ip = a.address.split("%", 1)[0]
            if a.family.name == "AF_INET" and not ipaddress.ip_address(ip).is_loopback:
                assert binding.listen_host(ip) == ip, name


def test_the_loopback_interface_is_found() -> None:
    assert binding.loopback_interface() is not None


def test_free_port_is_one_a_node_hands_out() -> None:
    port = binding.free_port("127.0.0.1")
    assert port in ports.handed_out(ports.ephemeral_range(Path(ports.EPHEMERAL_RANGE_FILE).read_text()))
