"""What a node accepts from the shared rendezvous store, and where it lets the store send it.

* A state that this node cannot accept (JSON of the wrong shape, bytes that are not elastrain's, or a value not
  signed with the job's secret: :mod:`elastrain.rendezvous.auth`) is never acted on (:class:`StandIn`). The last
  good state read from the same store stands in for it, and the handler writes it back with the forged value's
  token (a compare-and-set: whoever restores first wins, the others read the restored state). A node that never
  read a good state there (a newcomer) waits, bounded, for a member to restore it; after that, with a secret it
  founds the state anew (an attacker's leftover), without one it stops with one line (another launcher on the
  same ``--rdzv-id``?). A value signed with another secret stops a newcomer at once: its secret is wrong.
* A redirect (``superseded_by``), a fencing claim's store and a failover target are followed only when they name a
  member of the job (:class:`JobHosts`): a host that this node saw in the job's accepted states, the rendezvous
  endpoint's, or one that the store at that address lists among its own job's nodes. Failover targets are the
  state's members and joiners by construction (:func:`state.store_successors`); MASTER_ADDR is the first member's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from elastrain.binding import endpoint_hosts
from elastrain.errors import (
    RendezvousError,
    RendezvousForgeryError,
    RendezvousSecretError,
    RendezvousStateCorruptError,
    RendezvousValueCorruptError,
)
from elastrain.rendezvous import state as st
from elastrain.rendezvous.auth import SECRET_SETTING

_T = TypeVar("_T")


class Unreadable:
    """A state value that the backend could not decode (not elastrain's), with its token to write over it."""

    def __init__(self, exc: RendezvousValueCorruptError) -> None:
        self.exc = exc
        self.token = exc.token


def or_unreadable(op: Callable[[], _T]) -> _T | Unreadable:
    """``op()`` (a backend's ``get_state`` or ``set_state``), or what it could not decode."""
    try:
        return op()
    except RendezvousValueCorruptError as exc:
        return Unreadable(exc)


class StateUnsettledError(RendezvousError):
    """The rendezvous state cannot be accepted yet and this node has nothing to stand in for it: try again soon."""


class StandIn:
    """The last good state of each store, standing in for a value that cannot be accepted (see the module doc)."""

    def __init__(self, grace_s: float, secret: bool) -> None:
        self._grace_s = grace_s
        self._secret = secret
        self._good: tuple[object, st.RendezvousState] | None = None
        self._bad_since: float | None = None

    def accepted(self, source: object, state: st.RendezvousState) -> None:
        self._good = (source, state)
        self._bad_since = None

    def good(self, source: object) -> st.RendezvousState | None:
        return self._good[1] if self._good is not None and self._good[0] is source else None

    def replace(self, source: object, exc: RendezvousStateCorruptError, now: float | None = None) -> st.RendezvousState:
        """The state that stands in for an unacceptable value read from ``source``; raises when there is none yet."""
        good = self.good(source)
        if good is not None:
            return good
        if isinstance(exc, RendezvousForgeryError) and exc.foreign:
            raise RendezvousSecretError(
                SECRET_SETTING,
                f"{exc}: this node's secret is not the one the job's nodes use; start it with the job's secret file",
            ) from exc
        now = time.monotonic() if now is None else now
        if self._bad_since is None:
            self._bad_since = now
        if now - self._bad_since < self._grace_s:
            raise StateUnsettledError(f"{exc}; waiting up to {self._grace_s:.0f}s for a member to restore it")
        if self._secret:
            return st.RendezvousState()  # nobody restored it: an attacker's leftover, not a job's state
        raise exc


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as (host, port); ValueError when the port is not a number."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def host_of(address: str) -> str:
    """The host of ``host:port`` (``[v6]:port`` too)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return address.strip("[]")
    return host.strip("[]")


class JobHosts:
    """The hosts this node knows to be the job's: its endpoint's, its own, and every node of an accepted state."""

    def __init__(self, endpoint: str, own: str) -> None:
        self._hosts: set[str] = {h.lower() for h in endpoint_hosts(endpoint)} | {own.lower()}

    def add_state(self, state: st.RendezvousState) -> None:
        self._hosts.update(info.addr.lower() for info in state.nodes.values())

    def add(self, hosts: set[str]) -> None:
        self._hosts.update(h.lower() for h in hosts)

    def names_member(self, address: str) -> bool:
        return host_of(address).lower() in self._hosts
