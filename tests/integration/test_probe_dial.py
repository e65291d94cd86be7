"""Where a probe dials (elastrain/rendezvous/dial.py), and what a node listening on every interface accepts."""

from __future__ import annotations

import errno
import select
import socket

import pytest

from elastrain import binding
from elastrain.rendezvous import dial


def _outcome(address: dial.Address) -> int:
    """The result of a connection to ``address`` (0: made), waited for up to 5 s."""
    sock, code = dial.start(address)
    assert sock is not None
    with sock:
        if code in dial.UNDER_WAY:
            select.select([], [sock], [], 5)
            code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    return code


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("127.0.0.1", [(socket.AF_INET, ("127.0.0.1", 7))]),
        ("::1", [(socket.AF_INET6, ("::1", 7, 0, 0))]),
        ("[::1]", [(socket.AF_INET6, ("::1", 7, 0, 0))]),  # as split from "[::1]:7"
    ],
)
def test_a_literal_is_dialled_as_it_is_in_its_own_family(host: str, expected: list[dial.Address]) -> None:
    assert dial.addresses(host, 7) == expected


def test_listening_on_every_interface_accepts_both_families() -> None:
    with binding.bound_socket(binding.ANY, 0) as listener:
        port = listener.getsockname()[1]
        for host in ("127.0.0.1", "::1"):
            assert _outcome(dial.addresses(host, port)[0]) == 0, host


def test_a_port_nothing_listens_on_is_refused() -> None:
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
        s.bind(("::1", 0))  # bound, never listening
        assert _outcome(dial.addresses("::1", s.getsockname()[1])[0]) == errno.ECONNREFUSED
