"""elastrain's rendezvous handler: torch's ``RendezvousHandler`` over any compare-and-set ``RendezvousBackend``.

Faster than torch's dynamic handler where membership changes: sub-second heartbeats from a thread that
runs from the first join until shutdown (independent of rounds, so a node never evicts itself), a round
that completes as soon as every live member re-joined, graceful leave, and ``num_nodes_waiting`` that
also counts departed members, so torch's own monitor loop restarts survivors without using a restart.
Nodes that arrive while the round is full wait as hot spares (``event=standby``) and take a departed
member's place in the next round. Each round gets its own store prefix and its own worker store
(MASTER_PORT picked by the rank-0 node), never the agent's shared store (pytorch#135712).

The handler composes its parts and implements :class:`~elastrain.rendezvous.api.Membership`:
:mod:`~elastrain.rendezvous.settings` (the ``--rdzv-conf`` keys), :mod:`~elastrain.rendezvous.connection` (the
store, bounded calls, failover), :mod:`~elastrain.rendezvous.store` (versioned reads, compare-and-set),
:mod:`~elastrain.rendezvous.rounds` (join, wait, re-join keys, fold), :mod:`~elastrain.rendezvous.claim` (the
fencing generation), :mod:`~elastrain.rendezvous.heartbeat` (the beat, the judge, the failure watch). Liveness
probes live in :mod:`elastrain.rendezvous.liveness`; moving the c10d store to a successor with the c10d backend
(:mod:`elastrain.rendezvous.backends.c10d`); the job's secret, which signs every value written, in
:mod:`elastrain.rendezvous.auth`; what a node accepts from the store (forged or corrupt values, redirects) in
:mod:`elastrain.rendezvous.trust`; where it listens in :mod:`elastrain.binding`.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

from torch._C._distributed_c10d import PrefixStore, Store
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

from elastrain import binding
from elastrain.errors import RendezvousError
from elastrain.log import lifecycle
from elastrain.rendezvous import liveness, trust
from elastrain.rendezvous import state as st
from elastrain.rendezvous.auth import RendezvousAuth, SignedStore
from elastrain.rendezvous.claim import Fencing
from elastrain.rendezvous.connection import (
    STORE_ERRORS,
    Connection,
    FixedStores,
    StoreFactory,
    StoreSwitched,
)
from elastrain.rendezvous.deadline import with_deadline
from elastrain.rendezvous.heartbeat import Heartbeat, linger_until_seen
from elastrain.rendezvous.history import RoundHistory
from elastrain.rendezvous.pacing import Backoff, Throttled
from elastrain.rendezvous.rounds import RoundLost, Rounds, Superseded
from elastrain.rendezvous.settings import HandlerSettings, node_address
from elastrain.rendezvous.store import StateStore

_T = TypeVar("_T")


class ElastrainRendezvousHandler(RendezvousHandler):
    """One node's view of the job's rendezvous (see the module docstring)."""

    def __init__(
        self,
        backend: RendezvousBackend,
        store: Store,
        params: RendezvousParameters,
        settings: HandlerSettings | None = None,
        on_store_lost: str = "",
        stores: StoreFactory | None = None,
        hosts_store: bool = False,
        store_address: str = "",
        fence_root: str | None = None,
        auth: RendezvousAuth | None = None,
    ) -> None:
        self._params = params
        self._settings = s = settings or HandlerSettings.from_params(params)
        self.node_id = f"{socket.gethostname()}_{os.getpid()}_{uuid.uuid4().hex[:6]}"
        self._addr = node_address(params)
        self._history = RoundHistory(self.node_id)
        self._decided: st.Change | None = None
        self._decision_fresh = False
        self._probe = liveness.ProbeListener(binding.listen_host(self._addr))
        # What this node accepts from the store (the job's secret; the hosts of the job).
        self._auth = auth = auth if auth is not None else RendezvousAuth.from_params(params)
        job_hosts = trust.JobHosts(str(params.endpoint), self._addr)
        self._quiet = quiet = Throttled()
        self._conn = Connection(
            backend, store, store_address or str(params.endpoint), hosts_store, stores or FixedStores(), s,
            self.node_id, on_store_lost, quiet,
        )  # fmt: skip
        self._standby_port = binding.free_port(self._addr) if self._conn.movable else 0
        self._state = StateStore(self._conn, str(params.run_id), self.node_id, s, auth, job_hosts, quiet)
        root = fence_root if fence_root is not None else (params.get("checkpoint_root", None) or None)
        self._beat = Heartbeat(self.node_id, s, self._state, auth, quiet, fenced=bool(root))
        self._rounds = Rounds(self.node_id, params, s, self._state, auth, quiet, on_joined=self._beat.start)
        self._fencing = Fencing(root, self.node_id, params, s, self._state, auth, job_hosts, quiet)

    # -- torch's RendezvousHandler ---------------------------------------------------------------
    def get_backend(self) -> str:
        return str(self._params.backend)

    @property
    def use_agent_store(self) -> bool:
        return False

    @property
    def elastrain_round(self) -> int:
        """The job-wide round of the last completed rendezvous (identical on every node)."""
        return self._history.round

    def get_run_id(self) -> str:
        return str(self._params.run_id)

    def next_rendezvous(self) -> RendezvousInfo:
        deadline = time.monotonic() + self._settings.join_timeout_s
        nnodes = (self._params.min_nodes, self._params.max_nodes)
        info = st.NodeInfo(self._addr, binding.free_port(self._addr), self._probe.port, self._standby_port, nnodes)
        self._decided, self._decision_fresh = None, False
        if self._fencing.foreign is not None:
            raise self._fencing.foreign
        if self._fencing.fenced_by is not None:
            self._redirect(self._fencing.fenced_by, deadline)
        store_backoff = Backoff(0.1, 1.0)
        for _ in range(1000):
            try:
                state = self._rounds.form(info, deadline)
                if self._fencing.root:
                    state = self._fencing.settle(state, deadline)
                break
            except RoundLost:
                continue
            except Superseded as exc:
                self._redirect(exc.store, deadline)
            except (StoreSwitched, trust.StateUnsettledError, *STORE_ERRORS) as exc:
                # The store failed while this node joined and no failover has taken over yet (a newcomer that
                # never read the state knows no successor: it looks for the published store). The connection
                # gives up with RendezvousStoreLostError once the store has failed for store_lost_timeout.
                self._quiet.log("rendezvous_store_failed", exc, node=self.node_id)
                store_backoff.sleep()
        else:
            raise RendezvousTimeoutError("no round settled after 1000 attempts (the membership kept changing)")
        self._history.formed(state, self._beat.silent_since)  # kept every member, or left behind?
        self._conn.joined = True
        master = state.nodes[state.members[0]]
        rank = state.members.index(self.node_id)
        prefix = f"elastrain/{self.get_run_id()}/round{state.round}/"
        store: Store = PrefixStore(prefix, self._conn.store)
        if self._auth.enabled:
            store = SignedStore(store, self._auth, prefix)  # torch's agent keys (ranks, barriers), sealed too
        bootstrap = RendezvousStoreInfo(master_addr=master.addr, master_port=master.master_port)
        return RendezvousInfo(store, rank, len(state.members), bootstrap)

    def _redirect(self, address: str, deadline: float) -> None:
        """Follow the winning world to its store at ``address``, or start this lineage over (:meth:`Fencing.follow`)."""
        got = self._fencing.follow(address, deadline)
        with self._conn.lock:
            if got is not None:
                self._conn.switch(*got)
            self._beat.forget()
            self._fencing.forget()
        self._history.redirected()  # its world lost the claim: another one trained on

    def is_closed(self) -> bool:
        return self._state.read().closed

    def set_closed(self) -> None:
        self._state.update(st.close)

    def num_nodes_waiting(self) -> int:
        """torch's monitor loop asks this right after the agent's own check; both see one decision."""
        if self._decision_fresh:
            self._decision_fresh = False
            change = self._decided
        else:
            change = self._change()
        return 0 if change is None else max(1, st.nodes_waiting(self._conn.cached, self._params.max_nodes))

    def shutdown(self) -> bool:
        """The job is over for this node: close the rendezvous (as torch's handlers do) and stop beating."""
        self._beat.stop()
        self._fencing.mark_closed()  # first: a node still warming when the store leaves learns that the job is over
        try:
            self._state.update(lambda cur: st.close(st.remove(cur, [self.node_id], st.Departure.FINISHED.value)))
        except RendezvousClosedError:
            return True  # it finished before this node joined a round: closed already, by its world
        except (RendezvousError, *STORE_ERRORS) as exc:
            lifecycle("rendezvous_close_failed", level=logging.WARNING, error=repr(exc)[:200])
            return False
        if self._conn.hosted_here:  # the spares and joiners learn that the job is over, not that the store died
            linger_until_seen(self._beat, self._state, self.node_id, self._settings, self._quiet)
        return True

    # -- elastrain's additions: the Membership seam (elastrain.rendezvous.api) ----------------------
    @property
    def round(self) -> int | None:
        """:class:`~elastrain.rendezvous.api.Membership`'s name for :attr:`elastrain_round`."""
        return self._history.round

    @property
    def generation(self) -> int | None:
        """The fencing generation this node's world claimed (None without a checkpoint root)."""
        return self._fencing.generation

    @property
    def fatal_error(self) -> Exception | None:
        """Set by the heartbeat thread when the state store is gone; the agent raises it."""
        return self._beat.fatal_error

    @property
    def kept_every_member(self) -> bool:
        """Whether the round just formed holds every member of this node's previous round (nodes joined,
        none left): the same answer on every node of both rounds. A live regroup then moves at a step the
        workers agree on, finishing the step in flight (see :class:`elastrain.control.RegroupNotice`)."""
        return self._history.continuity.kept_every_member

    @property
    def left_behind(self) -> bool:
        """:attr:`elastrain.rendezvous.state.Continuity.left_behind` of the round just formed."""
        return self._history.continuity.left_behind

    @property
    def membership_grace_s(self) -> float:
        """How long after a worker failure a departed peer can take to show up (none in a round of one node)."""
        return 0.0 if self._history.alone else self._settings.departure_grace_s

    @property
    def store_failing(self) -> bool:
        return self._conn.failing

    @property
    def verdict_pending(self) -> bool:
        """Whether a worker failure cannot be judged yet: the store fails, or (bounded by a heartbeat timeout
        past the grace) a member of this round has not beaten since the failure. A peer frozen with ours, or
        the job gone on without us while we were frozen, shows up as an eviction, not as our failure."""
        return self.store_failing or self._beat.peers_unseen(self._conn.cached, self._history.round)

    def probe_peers(self) -> None:
        """Probe every peer at the next heartbeat tick (the agent calls this when its workers fail)."""
        self._beat.probe_peers()

    def report_worker_failure(self, echo: bool = False) -> None:
        """This node's workers failed: record it in the round (``echo``: they said a collective broke under
        them; see :func:`state.report_failure`) and probe every peer at the next heartbeat tick."""
        watch_s = self.membership_grace_s + self._settings.heartbeat_timeout_s
        self._beat.report_failure(self._history.round, echo, watch_s)

    def on_formed_without_this_node(self, callback: Callable[[], None]) -> None:
        self._rounds.formed_without = callback

    def job_formed(self) -> bool | None:
        return self._state.job_formed()

    def membership_change(self) -> st.Change | None:
        """Why this node's current round is over; the next ``num_nodes_waiting`` answers the same."""
        change = self._change()
        self._decided, self._decision_fresh = change, True
        return change

    def _change(self) -> st.Change | None:
        if self._history.round < 0:
            return None
        fenced = self._fencing.change()
        return fenced if fenced is not None else self._rounds.change(self._history.round)

    def leave(self, reason: str, kind: st.Departure = st.Departure.LEFT) -> None:
        """Announce that this node leaves (survivors re-form at once) and stop its heartbeat; bounded."""
        if self._rounds.left:
            return
        self._rounds.left = True
        self._beat.stop()
        gone = [self.node_id]
        try:
            after = with_deadline(
                lambda: self._state.update(lambda cur: st.remove(cur, gone, f"{kind.value}:{reason}")),
                self._settings.leave_timeout_s,
            )
        except Exception as exc:  # the store did not answer in time, or failed: the others evict us by heartbeat
            lifecycle("node_leave_unannounced", level=logging.WARNING, node=self.node_id, error=repr(exc)[:200])
            return
        lifecycle("node_left", node=self.node_id, reason=reason, kind=kind.value, round=self._history.round)
        if self._conn.hosted_here:  # the store leaves with this node
            self._fencing.mark_vacated(after)  # nobody left to carry the world on: a node on its way in starts over
            linger_until_seen(self._beat, self._state, self.node_id, self._settings, self._quiet)

    def stop_beating(self) -> None:
        """This node's liveness threads end (bounded), the rendezvous left as it is (see :class:`Membership`)."""
        self._beat.stop()

    # -- what tests reach into (not part of any seam) ------------------------------------------------
    @property
    def _store(self) -> Store:
        return self._conn.store

    @property
    def _store_address(self) -> str:
        return self._conn.address

    @property
    def _keyed(self) -> tuple[object, int] | None:
        return self._rounds.keyed

    def _read(self) -> st.RendezvousState:
        return self._state.read()

    def _call(self, op: Callable[[], _T]) -> _T:
        return self._conn.call(op)


def create_handler(
    backend: RendezvousBackend,
    store: Store,
    params: RendezvousParameters,
    on_store_lost: str = "",
    store_address: str = "",
) -> RendezvousHandler:
    """torch's handler-creator shape: elastrain's handler over ``backend`` (state) and ``store`` (per-round data);
    ``store_address``: the store's name in fencing claims (default: ``--rdzv-endpoint`` as given)."""
    return ElastrainRendezvousHandler(backend, store, params, on_store_lost=on_store_lost, store_address=store_address)
