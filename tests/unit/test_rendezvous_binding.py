"""Where a node listens: the interface of the address it advertises (sockets in this process only)."""

from __future__ import annotations

import ipaddress
from datetime import timedelta

import psutil
import pytest

from elastrain import binding
from elastrain.rendezvous import liveness


def listening() -> set[tuple[str, int]]:
    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process().net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }


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


def test_the_stores_and_the_probe_listen_on_loopback_only() -> None:
    store = binding.tcp_store_server("localhost", 0, timedelta(seconds=5))  # --standalone's localhost:0
    probe = liveness.ProbeListener(binding.listen_host("127.0.0.1"))
    port = binding.free_port("127.0.0.1")
    ours = {p for ip, p in listening() if ip == "127.0.0.1"}
    assert store.port in ours and probe.port in ours
    assert all(ip == "127.0.0.1" for ip, p in listening() if p in (store.port, probe.port))
    assert port > 0
    store.set("k", "v")
    # A second server for the same port in this process shares the first (multi-tenant), as torch's own does.
    again = binding.tcp_store_server("127.0.0.1", store.port, timedelta(seconds=5))
    assert again.get("k") == b"v"


def test_rank_zero_starts_the_workers_store_on_master_addr_before_the_script() -> None:
    port = binding.free_port("127.0.0.1")
    env = {"RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    binding.host_worker_store({**env, "RANK": "1"})
    assert port not in {p for _, p in listening()}  # only rank 0 hosts it
    binding.host_worker_store(env)
    assert ("127.0.0.1", port) in listening() and not any(p == port and ip != "127.0.0.1" for ip, p in listening())
    # torch's env:// init then creates its own multi-tenant TCPStore on that port: it shares the server.
    from torch.distributed import TCPStore

    torch_store = TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=5), multi_tenant=True)
    torch_store.set("a", "b")
    assert torch_store.get("a") == b"b"


def test_the_loopback_interface_is_found() -> None:
    assert binding.loopback_interface() is not None
