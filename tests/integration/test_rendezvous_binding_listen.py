"""Where the stores and the probe listen: real servers in this process, on loopback only."""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def _taken_on_ipv6_only(tries: int = 20) -> Iterator[socket.socket]:
    """A socket listening on an IPv6-only port that an IPv4 bind would get (the check the old free_port made, which
    passed): the kernel's port for IPv6 may be one another process holds on IPv4 (the tests run two at a time), and
    then another is taken."""
    for _ in range(tries):
        taken = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        taken.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        taken.bind(("::", 0))
        taken.listen(1)
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as v4:
                v4.bind(("", int(taken.getsockname()[1])))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            taken.close()
            continue
        with taken:
            yield taken
        return
    raise AssertionError(f"no IPv6-only port free on IPv4 in {tries} tries")


def test_a_port_taken_on_ipv6_only_is_not_free_for_every_interface(monkeypatch: pytest.MonkeyPatch) -> None:
    # A node that listens on every interface binds both families there (as torch's TCPStore does): a port another
    # process holds on IPv6 alone is not free for it, though an IPv4 bind of it would succeed.
    with _taken_on_ipv6_only() as taken:
        port = int(taken.getsockname()[1])
        monkeypatch.setattr(binding.ports, "handed_out", lambda *_: [port])
        got = binding.free_port("")
        assert got != port and got > 0
        with binding.bound_socket(binding.ANY, got):
            pass
