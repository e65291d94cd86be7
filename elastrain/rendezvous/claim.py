"""The fencing generation of a node's world: settle it for each round, claim it, redirect, check it while running.

With a checkpoint root (``elastrain-run --checkpoint-dir``), every round's leader claims the job's next fencing
generation there before any worker starts (:mod:`elastrain.fence`): a world that loses the claim (the other side
of a partition, a store founded again at the original endpoint) stops and joins the winner's store, and a world
that finds a newer claim while it runs stops its workers. A claim's store is followed only when the job's secret
signs it, or (without a secret) when it names a member of the job (:mod:`elastrain.rendezvous.trust`).
"""

from __future__ import annotations

import logging
import time

from torch._C._distributed_c10d import Store
from torch.distributed.elastic.rendezvous import RendezvousParameters, RendezvousTimeoutError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

from elastrain import fence, fence_moves
from elastrain.errors import RendezvousError, StaleGenerationError
from elastrain.log import lifecycle
from elastrain.rendezvous import fence_marks, trust
from elastrain.rendezvous import state as st
from elastrain.rendezvous.auth import RendezvousAuth
from elastrain.rendezvous.connection import STORE_ERRORS, StoreSwitched
from elastrain.rendezvous.pacing import Backoff, Throttled
from elastrain.rendezvous.rounds import RoundLost, Superseded
from elastrain.rendezvous.settings import HandlerSettings
from elastrain.rendezvous.store import StateStore
from elastrain.rendezvous.winner import WinnerDial, WinnerGone


def other_job(root: str, claim: fence.Claim, run_id: str) -> RendezvousError:
    return RendezvousError(
        f"--checkpoint-dir {root} was taken over by another job (run id {claim.run_id!r}, generation "
        f"{claim.generation}); one checkpoint directory serves one job: give this job its own --checkpoint-dir, "
        f"or start it with that job's --rdzv-id to join it (this one is {run_id!r})"
    )


class Fencing:
    """This node's world's fencing generation in the checkpoint root ``root`` (None: no fencing)."""

    def __init__(
        self,
        root: str | None,
        node_id: str,
        params: RendezvousParameters,
        settings: HandlerSettings,
        state: StateStore,
        auth: RendezvousAuth,
        job_hosts: trust.JobHosts,
        quiet: Throttled,
    ) -> None:
        self.root = root
        self.generation: int | None = None
        """The fencing generation this node's world claimed (None without a checkpoint root)."""
        self.fenced_by: str | None = None
        """The store of the newer world found while this one ran ("unknown" when it cannot be trusted)."""
        self.foreign: RendezvousError | None = None
        """Set when another job took over the checkpoint root: this node stops with it."""
        self._node_id = node_id
        self._run_id = str(params.run_id)
        self._params = params
        self._settings = settings
        self._state = state
        self._auth = auth
        self._job_hosts = job_hosts
        self._quiet = quiet
        self._next_check = 0.0
        self._winner = WinnerDial(state.conn.stores, settings)

    def settle(self, state: st.RendezvousState, deadline: float) -> st.RendezvousState:
        """The round's leader claims its generation; every member waits (bounded) for it."""
        root = self.root
        if root is None:
            return state
        round_ = state.round
        if state.members[0] == self._node_id and state.generation_round != round_:
            try:
                generation = self._claim(state, root)
            except OSError as exc:
                raise RendezvousError(
                    f"--checkpoint-dir {root}: cannot claim the job's fencing generation there ({exc}); "
                    "it must be a directory (or URL) that every node can write"
                ) from exc
            after = self._state.update(lambda cur: st.record_generation(cur, round_, generation))
            if after.round != round_:
                raise RoundLost()
            address = self._state.conn.address
            lifecycle("generation_claimed", generation=generation, round=round_, store=address, root=root)
        backoff = Backoff(self._settings.poll_min_s, self._settings.poll_max_s)
        while True:
            cur = self._state.read_cached()
            if cur.superseded_by:
                raise Superseded(cur.superseded_by)
            if cur.round != round_ or self._node_id not in cur.members:
                raise RoundLost()
            change = st.change_for(cur, self._node_id, round_, self._params.max_nodes)
            if change is not None and change.kind is not st.ChangeKind.SCALE_UP:
                raise RoundLost()  # the leader died (or a member left) before the generation was settled
            if cur.generation_round == round_:
                self.generation = cur.generation
                return cur
            if time.monotonic() > deadline:
                raise RendezvousTimeoutError(f"round {round_}'s leader claimed no generation in time")
            backoff.sleep()

    def _claim(self, state: st.RendezvousState, root: str) -> int:
        """Claim this round's generation in ``root``, or tombstone the lineage and raise :class:`Superseded`."""
        round_ = state.round
        run_id, address = self._run_id, self._state.conn.address
        if state.generation_round < 0:
            # A fresh store: a job is either starting, or running elsewhere (a store founded again at the
            # original endpoint, a restarted worker-0 pod): join that job rather than found a second one.
            top = fence.newest(root)
            if top is not None and top.store and top.run_id == run_id:
                for store, mac in fence_moves.stores_of(root, top):  # where its store last moved since, then its own
                    if store != address and self._state.conn.answers(store) and self._trusted(store, mac, top):
                        self._tombstone(store, f"generation {top.generation} runs at {store}")
            got = fence.claim_fresh(
                root, run_id, round_, address, state.members, store_mac=self._auth.store_mac(address),
            )  # fmt: skip
            return got.generation
        if not state.majority:
            # Perhaps the minority side of a partition: let a majority side claim first.
            lifecycle("claim_delayed", round=round_, grace_s=self._settings.grace_s, why="no majority of voters")
            end = time.monotonic() + self._settings.grace_s
            while time.monotonic() < end:
                time.sleep(min(0.25, max(0.0, end - time.monotonic())))
                if self._state.read().round != round_:
                    raise RoundLost()
        parent = state.generation
        for _ in range(100):
            address = self._state.conn.address
            won = fence.claim_after(
                root, run_id, round_, address, state.members, parent, store_mac=self._auth.store_mac(address),
            )  # fmt: skip
            if won is not None:
                return won.generation
            winner = fence.read_claim(root, parent + 1)
            if winner is not None and winner.store == self._state.conn.address and winner.run_id == run_id:
                if self._state.read().round != round_:  # a later round's leader claimed it: this one woke up late
                    raise RoundLost()
                parent += 1  # our own lineage's claim, by a leader that died before recording it
                continue
            if winner is not None and winner.run_id and winner.run_id != run_id:
                raise other_job(root, winner, run_id)
            store = winner.store if winner is not None and self._trusted(winner.store, winner.store_mac, winner) else ""
            self._tombstone(store, f"generation {parent + 1} was claimed by another world")
        raise StaleGenerationError(f"could not claim a generation after {parent} in {root} (100 tries)")

    def _tombstone(self, store: str, why: str) -> None:
        lifecycle("world_superseded", level=logging.WARNING, node=self._node_id, winner_store=store, why=why)
        self._state.update(lambda cur: st.supersede(cur, store))
        raise Superseded(store)

    def connect_winner(self, address: str, deadline: float) -> tuple[RendezvousBackend, Store, str]:
        """Connect to ``address`` (the winning world's store, or where that world moved it since), if this node may
        follow the state there; the store, and its address."""
        if not self._state.conn.movable or not address or address == "unknown":
            raise RendezvousError(
                f"another world of run {self._run_id} holds a newer generation in {self.root} "
                f"(its store: {address or 'unknown'}) and this backend cannot move there; start this node "
                "again to join it"
            )
        if not self._auth.enabled and not self._names_member(address):
            # Without a secret the state is anyone's to write: follow it only to a store of the job's own nodes.
            raise RendezvousError(
                f"the rendezvous state sends this node to {address}, which names no node of run "
                f"{self._run_id}; refused (a forged state?). Give every node a shared secret "
                "(--rdzv-conf secret_file=PATH) so that only the job's nodes can write its rendezvous"
            )
        return self._winner.connect(address, deadline, self._winner_store)

    def _winner_store(self) -> str | None:
        """Where the job's newest world runs its store now (its claim, or where it moved since), read again from the
        root; None when unknown (no root, unreadable, another job's claim, nothing trusted)."""
        if not self.root:
            return None
        _, top = fence_marks.newest_claim(self.root)
        if top is None or not top.store or top.run_id != self._run_id:
            return None
        store = self._running_at(top)
        return None if store == "unknown" else store

    def follow(self, address: str, deadline: float) -> tuple[RendezvousBackend, Store, str] | None:
        """Connect to the winning world's store at ``address`` (retrying until ``deadline``, and following it where it
        moves meanwhile); the store and its address, or None once that world is
        gone whole (nothing listens there: :class:`WinnerGone`), after lifting this lineage's tombstone, so that its
        next round claims the job's next free generation afresh and trains on from the newest checkpoint (or joins a
        store published meanwhile that answers). None as well when that world runs on this node's own rendezvous,
        which never moves (etcd: one for the job; a node frozen past its eviction): it joins the next round here."""
        if not self._state.conn.movable and address == self._state.conn.address:
            lifecycle("redirected", node=self._node_id, store=address, why="the newer world runs on this rendezvous")
            return None
        try:
            got = self.connect_winner(address, deadline)
        except WinnerGone as gone:
            store, refused_s = gone.address, gone.refused_s
            lifecycle(
                "winner_gone",
                level=logging.WARNING,
                node=self._node_id,
                store=store,
                refused_s=round(refused_s, 1),
                why="its store refused every connection for refound_after",
            )
            self._state.conn.resumes_job = True
            try:
                self._state.update(lambda cur: st.revive(cur, store))
            except (StoreSwitched, *STORE_ERRORS) as exc:  # the next round's forming meets the store again
                self._quiet.log("rendezvous_store_failed", exc, node=self._node_id)
            return None
        lifecycle("redirected", node=self._node_id, store=got[2])
        return got

    def mark_closed(self) -> None:
        """The job finished in this node's world: record it beside the claims (the first mark stays) before the
        close, so that a joiner whose store then falls silent learns the job is over (``StoreFactory.finished``)."""
        if self.root and self.generation is not None:
            g = self.generation
            self._record("job_close", fence.Closed(g, self._run_id, time.time(), self._auth.close_mac(g)))

    def mark_vacated(self, state: st.RendezvousState) -> None:
        """This node, which hosts its world's store, left it and nobody is left (``state``: after the leave; no
        member, joiner or spare): record it beside the claims, so that a node on its way in whose store then falls
        silent starts the job over at once instead of waiting ``refound_after`` (``StoreFactory.vacated``)."""
        if self.root and self.generation is not None and st.vacated(state):
            g = self.generation
            self._record("world_vacated", fence.Vacated(g, self._run_id, time.time(), self._auth.vacate_mac(g)))

    def _record(self, event: str, mark: fence.Closed) -> None:
        root = self.root or ""
        try:
            if fence.mark_closed(root, mark):
                lifecycle(f"{event}_recorded", generation=mark.generation, root=root)
        except OSError as exc:
            lifecycle(f"{event}_unrecorded", level=logging.WARNING, generation=mark.generation, root=root,
                      error=repr(exc)[:200])  # fmt: skip

    def forget(self) -> None:
        """This node left its world for another's: no generation, nothing fenced."""
        self.fenced_by = None
        self.generation = None

    def change(self) -> st.Change | None:
        """Every heartbeat timeout, whether a newer world claimed the checkpoint root (then: stop, join it)."""
        if not self.root or self.generation is None:
            return None
        now = time.monotonic()
        if self.fenced_by is None and now >= self._next_check:
            self._next_check = now + self._settings.heartbeat_timeout_s / 2
            try:
                fence.check(self.root, self.generation)
            except StaleGenerationError as exc:
                top = fence.newest(self.root)
                if top is not None and top.run_id and top.run_id != self._run_id:
                    self.foreign = other_job(self.root, top, self._run_id)
                self.fenced_by = self._running_at(top) if top is not None else "unknown"
                lifecycle("world_superseded", level=logging.WARNING, node=self._node_id, why=str(exc))
            except OSError as exc:
                self._quiet.log("fence_check_failed", exc, root=self.root)
        if self.fenced_by is not None:
            return st.Change(st.ChangeKind.FENCED, f"a newer world runs at {self.fenced_by}")
        return None

    def _names_member(self, address: str) -> bool:
        """Whether ``address`` is on a host of the job: known to this node, or vouched for by the store there."""
        if self._job_hosts.names_member(address):
            return True
        hosts = self._state.conn.vouches(address)
        self._job_hosts.add(hosts)
        return bool(hosts)

    def _trusted(self, store: str, mac: str, claim: fence.Claim) -> bool:
        """A fencing claim's store (or where it moved) is followed only if the job's secret signs it, or (without a
        secret) it names a member of the job."""
        ok = self._auth.signed_store(store, mac) if self._auth.enabled else self._names_member(store)
        if not ok:
            why = "not signed with the job's secret" if self._auth.enabled else "it names no node of the job"
            lifecycle("fence_claim_untrusted", level=logging.WARNING, store=store, generation=claim.generation,
                      why=why)  # fmt: skip
        return ok

    def _running_at(self, claim: fence.Claim) -> str:
        """The trusted store where the world of ``claim`` runs (see :func:`fence_moves.stores_of`), or "unknown"; this
        node's own needs no trust (following it sends the node nowhere; on etcd, every claim names it)."""
        own, stores = self._state.conn.address, fence_moves.stores_of(self.root or "", claim)
        return next((a for a, mac in stores if a == own or self._trusted(a, mac, claim)), "unknown")
