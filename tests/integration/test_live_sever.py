"""Severing a left round's connections (elastrain.live.sever), on real loopback sockets."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from elastrain.live.sever import sever, tcp_sockets

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd (Linux)")


def _pair(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(listener.getsockname()[:2], timeout=5)
    server, _ = listener.accept()
    return client, server


def test_only_the_connections_made_since_are_shut_down_and_never_a_listener() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    old_client, old_server = _pair(listener)
    before = tcp_sockets()
    own_listener = socket.create_server(("127.0.0.1", 0))  # like gloo's: must survive
    client, server = _pair(listener)
    made = tcp_sockets() - before
    try:
        assert sever(made) == 2  # the new connection's two ends; not the new listener
        server.settimeout(5)
        assert server.recv(1) == b""  # the peer sees the connection end (FIN) at once
        with pytest.raises(OSError):
            client.sendall(b"x" * 65536 * 8)
        own_listener.settimeout(0.01)
        with pytest.raises(TimeoutError):
            own_listener.accept()  # still listening: no error but the timeout
        old_client.sendall(b"ok")  # made before: untouched
        assert old_server.recv(2) == b"ok"
    finally:
        for s in (listener, old_client, old_server, own_listener, client, server):
            s.close()


def test_a_descriptor_reused_by_another_socket_is_left_alone() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    before = tcp_sockets()
    client, server = _pair(listener)
    made = tcp_sockets() - before
    client.close()
    server.close()
    again, again_server = _pair(listener)  # likely the same descriptor numbers, other sockets
    try:
        assert sever(made) == 0
        again.sendall(b"ok")
        assert again_server.recv(2) == b"ok"
    finally:
        for s in (listener, again, again_server):
            s.close()
