"""Following the world that won the job's generation claim to its store, and giving up on it once it is gone.

A world that loses the claim joins the winner's store (:mod:`elastrain.rendezvous.claim`). That store may be slow to
answer (a host frozen, cut off), which is waited for, or refuse every connection (its host's process is gone), which
is counted across tries: after ``refound_after`` the winner is taken for gone (:class:`WinnerGone`). While it does not
answer, where the winning world runs its store is read again (its claim, and where a failover of its own moved the
store since: :mod:`elastrain.fence_moves`): a winner whose store's host died after this node first looked has moved
its store to a successor, which is followed at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from torch._C._distributed_c10d import Store
from torch.distributed.elastic.rendezvous import RendezvousTimeoutError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

from elastrain.log import lifecycle
from elastrain.rendezvous import liveness
from elastrain.rendezvous.connection import STORE_ERRORS, StoreFactory
from elastrain.rendezvous.pacing import Backoff
from elastrain.rendezvous.settings import HandlerSettings


class WinnerGone(Exception):
    """Nothing has listened at the winning world's store for ``refound_after``: its host's process is gone (every
    connection refused, not merely unanswered), and no node of that world published another store since."""

    def __init__(self, address: str, refused_s: float) -> None:
        super().__init__(f"the winning world's store at {address} has refused connections for {refused_s:.1f}s")
        self.address = address
        self.refused_s = refused_s


class WinnerDial:
    """Connections to the winning world's store after a lost claim, and how long each such store refused them."""

    def __init__(self, stores: StoreFactory, settings: HandlerSettings) -> None:
        self._stores = stores
        self._settings = settings
        self._refused_since: dict[str, float] = {}
        """Winning worlds' stores (``host:port``) whose every connection was refused since then (monotonic)."""

    def connect(
        self, address: str, deadline: float, moved: Callable[[], str | None] = lambda: None
    ) -> tuple[RendezvousBackend, Store, str]:
        """Connect to the store at ``address`` (the winning world's), retrying until ``deadline``; the store
        connected to, and its address.

        ``moved``: where the winning world runs its store now (read again after each failed try; None: unknown). When
        that is another address (the winner failed its store over since), it is followed at once.

        Raises :class:`WinnerGone` once that store has refused every connection for ``refound_after`` (counted
        across calls): its host's process is gone, and with it the world that won (a world whose host died but
        whose other nodes live fails over and records where its store moved within that time). A
        store that is merely silent (a host frozen, cut off or taken away) is waited for until ``deadline``: a
        node on the cut-off side of a partition must not start over and fence a live world.
        """
        backoff = Backoff(0.5, 5.0)
        while True:
            try:
                got = self._stores.connect_to(address, self._settings.store_lost_timeout_s)
            except STORE_ERRORS as exc:
                now = time.monotonic()
                elsewhere = moved()
                if elsewhere and elsewhere != address:
                    lifecycle("redirect_moved", store=elsewhere, was=address)
                    self._refused_since.pop(address, None)
                    address = elsewhere
                    continue
                if liveness.refused_at(address):
                    since = self._refused_since.setdefault(address, now)
                else:
                    since = None
                    self._refused_since.pop(address, None)
                refused_s = 0.0 if since is None else now - since
                lifecycle("redirect_waiting", level=logging.WARNING, store=address, refused_s=round(refused_s, 1),
                          error=repr(exc)[:120])  # fmt: skip
                if refused_s >= self._settings.refound_after_s:
                    raise WinnerGone(address, refused_s) from exc
                if now > deadline:
                    raise RendezvousTimeoutError(f"the winning world's store at {address} did not answer") from exc
                backoff.sleep()
            else:
                self._refused_since.pop(address, None)
                return (*got, address)
