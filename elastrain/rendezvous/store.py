"""The job's rendezvous state as one node reads and writes it: versioned reads, compare-and-set, liveness keys.

The state blob is read only when it changed: every write bumps a version counter next to it, and readers
(monitor ticks, waiting joiners and spares) compare that counter first, a few bytes whatever the number of
nodes. Heartbeats never touch the blob (see :mod:`elastrain.rendezvous.heartbeat`). What this node accepts
from the store (forged or corrupt values) is decided in :mod:`elastrain.rendezvous.trust`; the calls
themselves, and the store's moves, in :mod:`elastrain.rendezvous.connection`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from torch._C._distributed_c10d import Store
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import Token

from elastrain.errors import RendezvousError, RendezvousStateCorruptError, RendezvousStoreLostError
from elastrain.log import lifecycle
from elastrain.rendezvous import state as st
from elastrain.rendezvous import trust
from elastrain.rendezvous.auth import RendezvousAuth, compare_set_bytes, set_bytes
from elastrain.rendezvous.connection import STORE_ERRORS, Connection, StoreSwitched
from elastrain.rendezvous.pacing import Backoff, Throttled
from elastrain.rendezvous.settings import HandlerSettings

_T = TypeVar("_T")


class StateStore:
    """One node's access to the job's state (the counterpart of torch's ``_BackendRendezvousStateHolder``)."""

    def __init__(
        self,
        conn: Connection,
        run_id: str,
        node_id: str,
        settings: HandlerSettings,
        auth: RendezvousAuth,
        job_hosts: trust.JobHosts,
        quiet: Throttled,
    ) -> None:
        self.conn = conn
        self.beats = 0
        """This node's heartbeat counter, written under its key (see :meth:`ensure_keys`)."""
        self._run_id = run_id
        self._node_id = node_id
        self._settings = settings
        self._auth = auth
        self._job_hosts = job_hosts
        self._quiet = quiet
        self._standin = trust.StandIn(settings.heartbeat_timeout_s, secret=auth.enabled)
        self._keys_on: object | None = None  # the store on which this node's liveness keys exist
        self._version_at = 0.0

    @property
    def store(self) -> Store:
        """The store the state lives in now (it moves: read it again for each operation)."""
        return self.conn.store

    @property
    def cached(self) -> st.RendezvousState:
        return self.conn.cached

    def call(self, op: Callable[[], _T], on: Store | None = None) -> _T:
        """One store call (see :meth:`Connection.call`); ``on``: the store ``op`` uses, when taken before."""
        return self.conn.call(op, on)

    def key(self, what: str) -> str:
        return f"elastrain/{self._run_id}/{what}"

    def ensure_keys(self) -> None:
        """Create this node's heartbeat key and the version counter on the current store (once per store)."""

        def once() -> None:
            store = self.conn.store
            if self._keys_on is store:
                return
            key = self.key(f"beat/{self._node_id}")
            beat = self._auth.seal(key, str(self.beats))
            self.call(lambda: set_bytes(store, key, beat), store)
            self.call(lambda: store.add(self.key("version"), 0), store)
            self._keys_on = store

        self.conn.retrying(once)

    def _version(self) -> int:
        store = self.conn.store
        raw = self.call(lambda: store.get(self.key("version")), store)
        try:
            return int(raw)
        except ValueError as exc:
            # Not a counter (written by something else): read the state again, and restart the counter at a value
            # no reader has cached (adds to a non-number fail, and readers compare versions for equality only).
            key = self.key("version")
            self._quiet.log("rendezvous_value_ignored", exc, key=key)
            fresh = str(time.time_ns())
            self.call(lambda: compare_set_bytes(store, key, bytes(raw), fresh.encode()), store)
            return -1

    def _bump_version(self) -> None:
        store = self.conn.store
        try:
            self.call(lambda: store.add(self.key("version"), 1), store)
        except (StoreSwitched, ValueError, *STORE_ERRORS) as exc:  # ValueError: the counter is not a number
            self.conn.cached_version = None  # readers re-read the blob the next time anyway
            self._quiet.log("version_bump_failed", exc)

    def read_recent(self) -> st.RendezvousState:
        """For monitor ticks: the state as of at most one heartbeat interval ago (the heartbeat thread reads
        the version every beat), so a tick every 0.1 s costs no store round trip."""
        fresh_for = time.monotonic() - self._version_at
        if self.conn.cached_version is not None and fresh_for < self._settings.heartbeat_interval_s:
            return self.conn.cached
        return self.read_cached()

    def job_formed(self) -> bool | None:
        """Whether the job has completed a round, read now and written nowhere (no key of this node's made: it may
        not join for a while); None, logged, when the store cannot say now."""
        try:
            state, _, _ = self._decode(self._get())
        except (RendezvousError, *STORE_ERRORS) as exc:
            lifecycle("rendezvous_state_unread", level=logging.WARNING, error=repr(exc)[:200], why="job_formed")
            return None
        return state.round >= 0

    def read_cached(self) -> st.RendezvousState:
        """The state, read again only when its version counter moved (or after a store switch)."""

        def once() -> int:
            self.ensure_keys()  # again after a store switch: the new store starts without them
            version = self._version()
            self._version_at = time.monotonic()
            return version

        version = self.conn.retrying(once)
        if version != self.conn.cached_version or self.conn.cached_version is None:
            state = self.read()
            self.conn.cached_version = version
            return state
        return self.conn.cached

    def read(self) -> st.RendezvousState:
        state, _, ignored = self._decode(self._get())
        if ignored:
            state = self.update(lambda cur: None)  # write the stand-in back over what was ignored
        self.conn.cached = state
        return state

    def _get(self) -> tuple[bytes, Token] | trust.Unreadable | None:
        def once() -> tuple[bytes, Token] | trust.Unreadable | None:
            with self.conn.lock:
                return self.call(lambda: trust.or_unreadable(self.conn.backend.get_state))

        return self.conn.retrying(once)

    def _decode(
        self, got: tuple[bytes, Token] | trust.Unreadable | None
    ) -> tuple[st.RendezvousState, Token | None, bool]:
        """The state in ``got``, its token, and whether it was ignored: a forged or corrupt value, or a state that
        vanished from the store it was read from, is never acted on; the last good one stands in for it
        (:class:`trust.StandIn`, which raises while there is none)."""
        source = self.conn.backend
        if got is None:
            good = self._standin.good(source)
            if good is None:
                return st.RendezvousState(), None, False
            self._quiet.log("rendezvous_value_ignored", RendezvousStateCorruptError("the state vanished"), key="state")
            return good, None, True
        if isinstance(got, trust.Unreadable):
            self._quiet.log("rendezvous_value_ignored", got.exc, key="state")
            return self._standin.replace(source, got.exc), got.token, True
        try:
            state = st.decode(self._auth.open_state(got[0]))
        except RendezvousStateCorruptError as exc:
            self._quiet.log("rendezvous_value_ignored", exc, key="state")
            return self._standin.replace(source, exc), got[1], True
        self._standin.accepted(source, state)
        self._job_hosts.add_state(state)
        return state, got[1], False

    def update(self, fn: Callable[[st.RendezvousState], st.RendezvousState | None]) -> st.RendezvousState:
        """Apply ``fn`` with compare-and-set until it sticks; return the state now stored."""
        return self.conn.retrying(lambda: self._update_once(fn))

    def _update_once(self, fn: Callable[[st.RendezvousState], st.RendezvousState | None]) -> st.RendezvousState:
        backoff = Backoff(0.001, 0.05)
        conn = self.conn
        with conn.lock:
            got = self.call(lambda: trust.or_unreadable(conn.backend.get_state))
            for _ in range(1000):
                state, token, ignored = self._decode(got)
                new = fn(state)
                if new is None or new == state:
                    if not ignored:
                        conn.cached = state
                        return state
                    new = state  # what stood in for an ignored value: written back over it
                payload = self._auth.seal_state(st.encode(new))
                result = self.call(
                    lambda p=payload, t=token: trust.or_unreadable(lambda: conn.backend.set_state(p, t))  # type: ignore[misc]
                )
                if result is None:
                    got = self.call(lambda: trust.or_unreadable(conn.backend.get_state))
                    continue
                if isinstance(result, trust.Unreadable):
                    got = result  # another unreadable value won the race
                    backoff.sleep()
                    continue
                data, new_token, ok = result
                if ok:
                    if ignored:
                        lifecycle(
                            "rendezvous_state_restored", level=logging.WARNING, node=self._node_id, round=new.round
                        )
                    conn.cached = new
                    conn.cached_version = None
                    self._standin.accepted(conn.backend, new)  # what this node wrote is the newest good state
                    self._bump_version()
                    return new
                got = (data, new_token)
                backoff.sleep()  # lost a race: back off with jitter before the next try
        raise RendezvousStoreLostError("compare-and-set on the rendezvous state kept losing races (1000 tries)")
