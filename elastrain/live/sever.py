"""Severing a left round's TCP connections: how a live worker makes its abandoned gloo collectives end.

gloo cannot be aborted (pytorch#130345). A collective the watchdog gave up on stays in gloo's threads
until the collective timeout, and until then two things can happen that must not:

- a peer cut off by a partition, still blocked in that same collective, completes it once the network
  heals: a step of a superseded world, trained by a node the job moved on without;
- the process waits for it before it may exit (:meth:`~elastrain.live.group.TrainingGroup.drain`).

The connections a round's group made are the TCP sockets that appeared in this process while it
joined (its store client and server, gloo's pairs). When the worker leaves a round with work still
pending, it shuts them down: gloo fails the pending work here at once ("Connection closed by peer"),
and the peer's as soon as the FIN or an RST reaches it, so a healed peer's collective fails instead of
completing. Listening sockets are never touched (gloo aborts the process when ``accept`` fails), nor a
descriptor that now holds another socket. Linux only (``/proc/self/fd``); elsewhere nothing is severed
and abandoned work ends at the collective timeout, as before.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from elastrain.log import lifecycle

_FD_DIR = Path("/proc/self/fd")


@dataclass(frozen=True)
class Connection:
    """One socket descriptor of this process and the socket it named (``socket:[inode]``)."""

    fd: int
    inode: str


def tcp_sockets() -> frozenset[Connection]:
    """Every socket descriptor of this process now (empty where ``/proc/self/fd`` does not exist)."""
    if not _FD_DIR.is_dir():
        return frozenset()
    out = set()
    for entry in os.listdir(_FD_DIR):
        try:
            target = os.readlink(_FD_DIR / entry)
        except OSError:  # closed meanwhile (this listing's own descriptor among them)
            continue
        if target.startswith("socket:"):
            out.add(Connection(int(entry), target))
    return frozenset(out)


def sever(connections: frozenset[Connection]) -> int:
    """Shut down (both ways) every one of ``connections`` that is still the same connected TCP socket; how many.

    The descriptors stay open (their owner, gloo or the store, closes them): ``shutdown`` acts on the
    socket, through a duplicate that is closed at once."""
    severed = 0
    for conn in sorted(connections, key=lambda c: c.fd):
        try:
            if os.readlink(_FD_DIR / str(conn.fd)) != conn.inode:
                continue  # closed, and the number reused by another socket or file
            sock = socket.socket(fileno=os.dup(conn.fd))
        except OSError:
            continue
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                continue
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                continue  # a listener: gloo aborts the process if its accept fails
            sock.shutdown(socket.SHUT_RDWR)
            severed += 1
        except OSError as exc:  # not connected (any more): nothing to sever
            lifecycle("connection_not_severed", level=logging.DEBUG, fd=conn.fd, error=repr(exc)[:120])
        finally:
            sock.close()
    return severed
