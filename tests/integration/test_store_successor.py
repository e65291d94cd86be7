"""Whether a failover waits for a successor's standby store (elastrain/rendezvous/backends/c10d.py), read against
real sockets: it waits while the successor lives and has not opened its store yet, and not at all once the
successor's process is gone (killed with the host, say): the next successor is tried at once."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

from elastrain import binding
from elastrain.rendezvous import state as st
from elastrain.rendezvous.backends.c10d import _successor_listens


@contextmanager
def port(listening: bool) -> Iterator[int]:
    """A loopback port that listens (connections wait in its backlog), or one that refuses."""
    if listening:
        with binding.bound_socket("127.0.0.1", 0) as s:
            yield s.getsockname()[1]
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # held, never listening: refused
        yield s.getsockname()[1]


def info(probe: int, standby: int) -> st.NodeInfo:
    return st.NodeInfo("127.0.0.1", 0, probe, standby)


def test_a_successor_whose_store_listens_is_connected_to() -> None:
    with port(True) as probe, port(True) as standby:
        assert _successor_listens("b", info(probe, standby), 3.0)


def test_a_dead_successor_is_passed_over_at_once() -> None:
    with port(False) as probe, port(False) as standby:
        assert not _successor_listens("b", info(probe, standby), 3.0)


def test_a_live_successor_not_listening_yet_is_waited_for_a_second_then_tried() -> None:
    with port(True) as probe, port(False) as standby:
        assert _successor_listens("b", info(probe, standby), 3.0)  # the client's own connect decides then
