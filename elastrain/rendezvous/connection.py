"""The connection to the job's state store: which store it is, every call to it (bounded), and its moves.

A call that fails is retried by its caller once the store moved (:class:`StoreSwitched`, through
:meth:`Connection.retrying`, the one place that bounds those retries). The store moves when its host died
(failover to the host's first reachable successor), when this node never joined a round and the job has no
live store any more (refound at the endpoint), and when another world of the job holds the newer generation
(a redirect, see :mod:`elastrain.rendezvous.claim`). What a backend can do here comes from its
:class:`StoreFactory`: the c10d store lives in a node and moves; an etcd cluster (:class:`FixedStores`) never
does, and its client bounds every call itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import NoReturn, Protocol, TypeVar

from torch._C._distributed_c10d import Store
from torch.distributed import DistError, DistNetworkError
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

from elastrain.errors import RendezvousError, RendezvousStoreLostError
from elastrain.log import lifecycle
from elastrain.rendezvous import liveness
from elastrain.rendezvous import state as st
from elastrain.rendezvous.deadline import with_deadline
from elastrain.rendezvous.pacing import Throttled
from elastrain.rendezvous.settings import HandlerSettings
from elastrain.rendezvous.trust import split_address

_T = TypeVar("_T")

# What a store operation may raise when the store is slow, gone or unreachable (typed, never matched by text).
STORE_ERRORS = (DistError, RendezvousConnectionError, TimeoutError, ConnectionError)


class StoreSwitched(Exception):
    """The state store moved to a successor; the operation restarts on the new one."""


class StoreFactory(Protocol):
    """Where a backend's state store can go: a node-hosted store (c10d) moves, an external cluster does not."""

    movable: bool
    """Whether the store lives in a node: its calls get a deadline (a TCPStore client whose packets are dropped
    blocks forever), and it can fail over, be founded again, or be left for another world's."""

    resumes: bool
    """Whether this node started on a store founded afresh for a job that had trained and not finished (a claim of
    its own is in the fencing root, and no store of it answered): its nodes were launched again, and the first round
    there goes on with that job (``state.last_call``)."""

    def failover(
        self, cached: st.RendezvousState, me: str, exc: BaseException, timeout_s: float
    ) -> tuple[RendezvousBackend, Store, str, bool] | None:
        """Move to the dead host's first reachable successor: (backend, store, address, hosted here) or None."""
        ...

    def connect_to(self, address: str, timeout_s: float) -> tuple[RendezvousBackend, Store]:
        """Connect to the state store at ``host:port`` (another world's store, after a lost claim)."""
        ...

    def answers(self, address: str, timeout_s: float) -> bool:
        """Whether a live job's rendezvous answers at ``host:port``."""
        ...

    def vouches(self, address: str, timeout_s: float) -> set[str]:
        """The node addresses of the live job at ``host:port``, if one of them is that host (else empty)."""
        ...

    def refound(self) -> tuple[RendezvousBackend, Store, str, bool] | None:
        """The store at the endpoint, where a job with no live store starts over: (backend, store, address,
        hosted here); None where the store never moves; raises :class:`RendezvousStoreLostError` when it can be
        neither hosted nor reached."""
        ...

    def finished(self) -> bool:
        """Whether the job finished since this node first looked for its store (its close is recorded beside the
        fencing claims): a store that falls silent before this node joined a round left with the job's end."""
        ...

    def vacated(self) -> bool:
        """Whether the job's newest world was left by its last node, which hosted its store (recorded beside the
        fencing claims): a store that falls silent before this node joined a round left with that node, and no
        world of the job runs any more."""
        ...

    def known_gone(self, cached: st.RendezvousState) -> bool:
        """Whether every node of the job this node knows of is proved gone (its probe port refuses): the nodes of
        ``cached``, else those of the state it found the job's store with; knowing none (a world formed on its store
        without it), whether every store the newest world ran refuses. Only where the job can be started over safely
        (a fencing root: a world still alive somewhere is fenced, never doubled)."""
        ...

    def no_world_since_start(self) -> bool:
        """Whether no world of the job formed since this node started at the endpoint (no store of the job answered
        then): no newer fencing claim in the root. A store no world ran on, once silent, moved nowhere (a world moves
        its store), and the job is started over at once."""
        ...


class FixedStores:
    """:class:`StoreFactory` of a store that never moves (etcd): no failover, no refound, no other world's store."""

    movable = False
    resumes = False  # the state lives on in the cluster: its rounds say that the job ran

    def failover(
        self, cached: st.RendezvousState, me: str, exc: BaseException, timeout_s: float
    ) -> tuple[RendezvousBackend, Store, str, bool] | None:
        return None

    def connect_to(self, address: str, timeout_s: float) -> tuple[RendezvousBackend, Store]:
        raise RendezvousError(f"this rendezvous backend cannot move to another store ({address})")

    def answers(self, address: str, timeout_s: float) -> bool:
        return False

    def vouches(self, address: str, timeout_s: float) -> set[str]:
        return set()

    def refound(self) -> tuple[RendezvousBackend, Store, str, bool] | None:
        return None

    def finished(self) -> bool:
        return False  # the state lives on in the cluster and says so itself

    def vacated(self) -> bool:
        return False

    def known_gone(self, cached: st.RendezvousState) -> bool:
        return False

    def no_world_since_start(self) -> bool:
        return False


class Connection:
    """The state store this node talks to now, the last state read from it, and every call to it."""

    def __init__(
        self,
        backend: RendezvousBackend,
        store: Store,
        address: str,
        hosted_here: bool,
        stores: StoreFactory,
        settings: HandlerSettings,
        node_id: str,
        on_store_lost: str,
        quiet: Throttled,
    ) -> None:
        self.backend = backend
        self.store = store
        self.address = address
        self.hosted_here = hosted_here
        """Whether this node's process hosts the store (it dies with it)."""
        self.lock = threading.RLock()  # RLock: a signal handler on the main thread may leave mid-update
        self.cached = st.RendezvousState()
        """The state last read or written (a failover picks the successor from it)."""
        self.cached_version: int | None = None
        self.joined = False
        """Whether this node was ever a member of a completed round (then it has something at stake)."""
        self.resumes_job = stores.resumes
        """Whether the first round on this node's store continues a job that ran: the store was founded afresh
        for it, by this node's start (its nodes launched again), a refound, or a lineage revived after its winner
        died."""
        self._stores = stores
        self._settings = settings
        self._node_id = node_id
        self._on_store_lost = on_store_lost
        self._quiet = quiet
        self._failing_since: float | None = None
        self._wedged: object | None = None
        self._next_reconnect = 0.0
        self._reconnect_pause = 0.0

    @property
    def stores(self) -> StoreFactory:
        return self._stores

    @property
    def movable(self) -> bool:
        return self._stores.movable

    @property
    def failing(self) -> bool:
        return self._failing_since is not None

    def retrying(self, op: Callable[[], _T]) -> _T:
        """``op()``, again on the new store each time the store moved under it (10 moves at most)."""
        for _ in range(10):
            try:
                return op()
            except StoreSwitched:
                continue
        raise RendezvousStoreLostError("the rendezvous store kept moving (10 failovers in a row)")

    def call(self, op: Callable[[], _T], on: Store | None = None) -> _T:
        """One store call, bounded (see :meth:`_failed`). ``on``: the store ``op`` talks to, when the caller took it
        before (default: the current one). A failure on a store that another thread left since is no failure of the
        current one: never a failover past its live host (a survivor once split from the others that way)."""
        target = self.store if on is None else on
        if target is not self.store:
            raise StoreSwitched()  # taken before a move: the caller retries on the new store
        try:
            out = self._bounded(op, target)
        except STORE_ERRORS as exc:
            with self.lock:  # one move at a time: a call that failed on the same store meanwhile waits, then retries
                self._failed(exc, target)
        self._failing_since = None
        return out

    def _failed(self, exc: BaseException, target: Store) -> NoReturn:
        """After a failed call on ``target`` (under :attr:`lock`): :class:`StoreSwitched` once the store moved (now,
        or since the call began), RendezvousStoreLostError once it has failed for too long, else ``exc`` again."""
        if target is not self.store:
            lifecycle("store_call_on_old_store", level=logging.INFO, store=self.address, error=repr(exc)[:120])
            raise StoreSwitched() from exc
        now = time.monotonic()
        # The main and heartbeat threads both get here: read the shared field once.
        since = self._failing_since
        if since is None:
            since = self._failing_since = now
        # A node that never joined a round has nothing at stake. When the job finished meanwhile (its store's host
        # left with the close), it ends too, neither taking the store over from its stale state nor founding it again.
        if not self.joined and self._stores.finished():
            raise RendezvousClosedError(
                f"the job finished while this node waited to join it (its store at {self.address} left with it)"
            ) from exc
        # A node that never read the state knows no successor: it looks for the store the job's world publishes
        # (its claim, or where its store moved since) as long as it would wait for a round; with none alive for
        # refound_after, it starts the job over at the endpoint; at once when the world's last node left it.
        newcomer = not self.joined and self._node_id not in self.cached.nodes
        if self._failover(exc) or (newcomer and self._refound_if_gone(now - since)):
            self._failing_since = None
            raise StoreSwitched() from exc
        limit = self._settings.join_timeout_s if newcomer else self._settings.store_lost_timeout_s
        if now - since >= limit:
            raise RendezvousStoreLostError(
                f"the rendezvous store stopped answering for {now - since:.1f}s ({exc})"
                + (f"; {self._on_store_lost}" if self._on_store_lost else "")
            ) from exc
        raise exc

    def _bounded(self, op: Callable[[], _T], store: Store) -> _T:
        """Run one store call with a deadline (see ``store_op_timeout_s``).

        A call past its deadline is left blocked in its (daemon) thread and its client is marked wedged:
        later calls fail fast until a fresh connection to the same store answers (tried with a growing
        pause, 1 s up to 30 s), so a long network cut neither blocks the agent nor piles up threads.
        """
        if not self._stores.movable:
            return op()  # etcd: its client bounds every request and rides out outages (retry_timeout)
        address = self.address
        if self._wedged is not None and self._wedged is store is self.store and not self.hosted_here:
            self._reconnect()
        try:
            return with_deadline(op, self._settings.store_op_timeout_s)
        except TimeoutError:
            # The store this call was stuck on: another thread may have moved to a successor meanwhile, and a
            # store hosted here (its server lives in self.store) is never replaced by a client of it.
            self._wedged = store
            lifecycle("store_call_stuck", level=logging.WARNING, store=address,
                      waited_s=self._settings.store_op_timeout_s)  # fmt: skip
            raise

    def _reconnect(self) -> None:
        """Replace a wedged store client by a fresh connection, or fail fast (tries back off up to 30 s)."""
        now = time.monotonic()
        stores = self._stores
        if now < self._next_reconnect:
            raise TimeoutError(f"the rendezvous store at {self.address} does not answer (client wedged)")
        self._reconnect_pause = min(30.0, max(1.0, 2 * self._reconnect_pause))
        self._next_reconnect = now + self._reconnect_pause
        wedged, address = self.store, self.address
        timeout, deadline = self._settings.store_lost_timeout_s, self._settings.store_op_timeout_s
        try:
            backend, store = with_deadline(lambda: stores.connect_to(address, timeout), deadline)
        except STORE_ERRORS as exc:
            raise TimeoutError(f"the rendezvous store at {address} does not answer ({exc!r:.80})") from exc
        with self.lock:
            if self.store is wedged:
                self.backend, self.store, self._wedged = backend, store, None
                self.cached_version = None
                self._reconnect_pause = 0.0
        lifecycle("store_reconnected", store=address)

    def _refound_if_gone(self, silent_s: float) -> bool:
        why = refound_why(self._stores, self.cached, silent_s, self._settings)
        return why is not None and self._refound(silent_s, why)

    def _refound(self, silent_s: float, why: str) -> bool:
        """Start the job over at the endpoint's store (c10d; hosted here when this node may host it)."""
        try:
            got = self._stores.refound()
        except RendezvousStoreLostError as exc:
            self._quiet.log("refound_failed", exc, node=self._node_id)
            return False
        if got is None:
            return False
        self.backend, self.store, self.address, self.hosted_here = got
        address, hosts = self.address, self.hosted_here
        self.cached, self.cached_version = st.RendezvousState(), None
        self.resumes_job = True
        lifecycle(
            "job_refounded",
            level=logging.WARNING,
            node=self._node_id,
            store=address,
            hosts=hosts,
            silent_s=round(silent_s, 1),
            why=f"no live store of this job: {why}, and this node never joined a round",
        )
        return True

    def _failover(self, exc: BaseException) -> bool:
        """Move the state store to the first reachable successor of its dead host (c10d only)."""
        cached = self.cached
        if cached.store_host == self._node_id:
            return False
        if not cached.store_host and self._node_id in cached.nodes:
            return False  # a state without a host (never on c10d): no successor can be picked from it
        if self._reconnected(exc):
            return True
        got = self._stores.failover(cached, self._node_id, exc, self._settings.store_lost_timeout_s)
        if got is None:
            return False
        self.backend, self.store, self.address, self.hosted_here = got
        self.cached_version = None
        lifecycle(
            "store_failover",
            level=logging.WARNING,
            old_host=cached.store_host,
            endpoint=self.address,
            cause=repr(exc)[:120],
        )
        return True

    def _reconnected(self, exc: BaseException) -> bool:
        """Whether a fresh connection to the same store replaced a broken one (not a timeout) while its host's process
        lives: passing over that host would split the job in two stores. Bounded by ``store_lost_timeout``."""
        if self.hosted_here or not caused_by(exc, (DistNetworkError, ConnectionError)):  # broken, not slow
            return False
        address, stores = self.address, self._stores
        probes = {"store": split_address(address)}
        host = self.cached.nodes.get(self.cached.store_host)
        if host is not None and host.probe_port:  # its host's process: a store there now may be another's
            probes["host"] = (host.addr, host.probe_port)
        if liveness.refused(probes, 0.5):
            return False
        limit = self._settings.store_lost_timeout_s
        try:
            backend, store = with_deadline(lambda: stores.connect_to(address, limit), limit)
            with_deadline(lambda: store.check(["elastrain/reconnect"]), limit)  # it answers (the key need not exist)
        except (*STORE_ERRORS, RuntimeError, ValueError) as err:  # RuntimeError, ValueError: the client's constructor
            lifecycle("store_reconnect_failed", level=logging.INFO, store=address, error=repr(err)[:120])
            return False
        with self.lock:
            self.backend, self.store, self._wedged, self.cached_version = backend, store, None, None
        lifecycle("store_reconnected", level=logging.WARNING, store=address, cause=repr(exc)[:120])
        return True

    def answers(self, address: str) -> bool:
        """Whether a live job's rendezvous answers at ``address`` (never, for a store that does not move)."""
        try:
            return self._stores.answers(address, self._settings.store_lost_timeout_s)
        except STORE_ERRORS as exc:
            lifecycle("store_probe_failed", level=logging.INFO, address=address, error=repr(exc)[:120])
            return False

    def vouches(self, address: str) -> set[str]:
        """The node addresses of the live job whose store answers at ``address`` (empty if none does)."""
        return self._stores.vouches(address, self._settings.store_lost_timeout_s)

    def switch(self, backend: RendezvousBackend, store: Store, address: str) -> None:
        """Talk to another world's store from now on (hosted elsewhere); call with :attr:`lock` held."""
        self.backend, self.store = backend, store
        self.hosted_here = False
        self.address = address
        self.cached = st.RendezvousState()
        self.cached_version = None


def refound_why(
    stores: StoreFactory, cached: st.RendezvousState, silent_s: float, settings: HandlerSettings
) -> str | None:
    """Why a newcomer whose store failed ``silent_s`` ago, with no live store found since, starts the job over now;
    None while it looks on. At once when its world's last node left it (the mark is read only once the failover found
    no store), or when no world of the job formed since it started at the endpoint (no store of the job answered then:
    a relaunch whose store's host went away before the first round); after ``heartbeat_timeout`` when every node of
    the job it knows of refuses its probe (they died together: a member it never saw, had it taken the store over,
    would have recorded the move by then, and the failover would have found it; knowing no node, when every store
    the newest world ran refuses, by the same argument); else once it has looked for ``refound_after``."""
    if stores.vacated():
        return "its world's last node left it"
    if stores.no_world_since_start():
        return "its store held no world of the job (no newer fencing claim since this node started)"
    if silent_s >= settings.refound_after_s:
        return "its published store is silent"
    if silent_s >= settings.heartbeat_timeout_s and stores.known_gone(cached):
        return "every node and store of the job it knew of is gone (probes refused)"
    return None


def caused_by(exc: BaseException | None, types: tuple[type[BaseException], ...]) -> bool:
    """Whether ``exc``, or what caused it (``raise ... from``), is one of ``types``."""
    while exc is not None:
        if isinstance(exc, types):
            return True
        exc = exc.__cause__
    return False
