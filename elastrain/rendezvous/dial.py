"""How a node connects to a peer's probe port: at every address the peer's name resolves to, in its own family.

A peer advertises a name (its FQDN, by default) or an address literal, IPv4 or IPv6. It listens on one address of
its own interfaces (:func:`elastrain.binding.listen_host`), which may be of either family when its name resolves to
both, and this node cannot tell which: the order in which a name's addresses come back differs between machines. So
a probe dials each address the name resolves to here, and only a refusal at all of them proves that nothing listens
(a refusal at one of them proves nothing: the peer may listen at another). A literal is dialled as it is, with no
lookup.
"""

from __future__ import annotations

import errno
import logging
import socket
from dataclasses import dataclass
from typing import Any

from elastrain.log import lifecycle

Address = tuple[int, tuple[Any, ...]]
"""One address to dial: (address family, socket address as ``connect`` takes it)."""

UNDER_WAY = frozenset({0, errno.EINPROGRESS, errno.EAGAIN})
"""What a non-blocking ``connect_ex`` returns for a connection made, or under way."""


def addresses(host: str, port: int) -> list[Address]:
    """Every address ``host`` resolves to here, in the resolver's order (a literal: itself); [] when it does not
    resolve (no proof of anything)."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        lifecycle("probe_address_unresolved", level=logging.DEBUG, host=host, error=repr(exc)[:120])
        return []
    return list(dict.fromkeys((int(family), tuple(sockaddr)) for family, _, _, _, sockaddr in infos))


def start(address: Address) -> tuple[socket.socket | None, int]:
    """A non-blocking connection to ``address``, begun: (the socket, ``connect_ex``'s code). The socket is None, and
    the code -1, when none could be made (no proof of anything); the caller closes it otherwise."""
    family, sockaddr = address
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        lifecycle("probe_socket_failed", level=logging.WARNING, error=repr(exc)[:120])
        return None, -1
    sock.setblocking(False)
    try:
        return sock, sock.connect_ex(sockaddr)
    except OSError as exc:
        lifecycle("probe_failed", level=logging.DEBUG, address=str(sockaddr[0]), error=repr(exc)[:120])
        sock.close()
        return None, -1


@dataclass(frozen=True)
class Begun:
    """Connections begun to every address of one host: those under way (the caller closes them), how many addresses
    refused at once, and how many there were."""

    under_way: list[socket.socket]
    refused: int
    addresses: int


def begin(host: str, port: int) -> Begun:
    """A non-blocking connection begun to each address ``host`` resolves to (:func:`addresses`). One refused at once,
    or that no socket could be made for, is closed here; one that failed otherwise is no proof of anything."""
    under_way, refused, addrs = [], 0, addresses(host, port)
    for address in addrs:
        sock, code = start(address)
        if sock is not None and code in UNDER_WAY:
            under_way.append(sock)
            continue
        refused += code == errno.ECONNREFUSED
        if sock is not None:
            sock.close()
    return Begun(under_way, refused, len(addrs))
