"""Forming a round: join, wait (as a joiner or a hot spare), re-join through keys, fold, and the next change.

Once a round is visibly over, its live members re-join through keys of their own (one write and one count each)
and one node folds them into the state in a single compare-and-set (:func:`state.fold`), so 63 survivors do not
race 63 compare-and-sets of the whole state.

A live member of a round that is visibly over asks for the next one with two O(1) writes: its address under
``rejoin/<round>/<node>`` and one ``add`` to ``rejoin/<round>/count``. The re-joiner whose add reaches the
number of members still to re-join, or else the round's judge (polling the count), reads the keys and completes
the round with ONE compare-and-set of the state (state.fold). Keys are never deleted (a reader that saw them
exist may still read them); they cost ~100 bytes per member and round, as torch's own per-round
rank-assignment keys do.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol, runtime_checkable

from torch._C._distributed_c10d import Store
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousParameters,
    RendezvousTimeoutError,
)

from elastrain.errors import NodeLeftError, RendezvousError, RendezvousStateCorruptError, UsageError
from elastrain.log import lifecycle
from elastrain.rendezvous import state as st
from elastrain.rendezvous.auth import RendezvousAuth, set_bytes
from elastrain.rendezvous.connection import STORE_ERRORS, StoreSwitched
from elastrain.rendezvous.pacing import Backoff, Throttled
from elastrain.rendezvous.settings import HandlerSettings
from elastrain.rendezvous.store import StateStore


@runtime_checkable
class PrefixCounter(Protocol):
    """A store that counts the keys under a prefix in one request (etcd, where ``add`` is a compare-and-set loop)."""

    def count_prefix(self, prefix: str) -> int: ...


class RoundLost(Exception):
    """The round this node formed was superseded before its generation was settled: join again."""


class Superseded(Exception):
    """Another world of this job holds the newest generation; this node leaves for that world's store."""

    def __init__(self, store: str) -> None:
        super().__init__(store)
        self.store = store


class Rounds:
    """This node's part in forming rounds, and its view of why the current one is over."""

    def __init__(
        self,
        node_id: str,
        params: RendezvousParameters,
        settings: HandlerSettings,
        state: StateStore,
        auth: RendezvousAuth,
        quiet: Throttled,
        on_joined: Callable[[], None],
    ) -> None:
        self.keyed: tuple[object, int] | None = None
        """(store, round) whose end this node asked for through its key."""
        self.left = False
        """Whether this node left the job (it joins no round any more)."""
        self._node_id = node_id
        self._params = params  # read at each use: max_nodes may be changed on it
        self._settings = settings
        self._state = state
        self._auth = auth
        self._quiet = quiet
        self._on_joined = on_joined
        self._fold_hint = False
        self.formed_without: Callable[[], None] | None = None
        """Called once, the first time this node waits for a round of a job that formed one without it."""
        self._scale_up_seen: tuple[tuple[str, ...], float] | None = None

    def form(self, info: st.NodeInfo, deadline: float) -> st.RendezvousState:
        """Join and wait until this node is a member of a completed round; return that state."""
        s = self._settings
        min_nodes, max_nodes = self._params.min_nodes, self._params.max_nodes
        self._scale_up_seen = None
        if self.left:
            raise NodeLeftError(f"node {self._node_id} left the job")
        self._state.ensure_keys()
        state = self._ask(info)
        self._on_joined()
        target = state.round + 1
        lifecycle(
            "rendezvous_joined",
            node=self._node_id,
            target_round=target,
            joining=len(state.joining),
            via="key" if self.keyed is not None else "state",
        )
        ready_since: float | None = None
        standby_logged = False
        backoff = Backoff(s.poll_min_s, s.poll_max_s)
        forming = Backoff(s.poll_min_s, max(s.poll_min_s, s.poll_forming_s))
        seen: tuple[st.RendezvousState, int] = (state, -1)
        while True:
            if state.closed:
                raise RendezvousClosedError()
            if self.left:
                raise NodeLeftError(f"node {self._node_id} left the job")
            if state.superseded_by:
                raise Superseded(state.superseded_by)
            if self._node_id in state.joining or self._waits_by_key(state):
                target = state.round + 1
                if state.round >= 0 and self.formed_without is not None:
                    told, self.formed_without = self.formed_without, None
                    told()
            elif self._node_id in state.members and state.round >= target:
                self.formed_without = None  # it is a member: the job did not form without it
                return state
            else:
                # Evicted while waiting (we were frozen), dropped from the state, or our key was written on a
                # store that has since moved: ask again.
                state = self._ask(info)
                continue
            now = time.monotonic()
            live = st.live_members(state)
            if self._node_id in st.spares(state, max_nodes) and live:
                # A full round runs: wait as a hot spare, as long as the job runs (no join timeout).
                deadline = now + s.join_timeout_s
                if not standby_logged:
                    standby_logged = True
                    lifecycle("standby", node=self._node_id, round=state.round, members=len(live), max_nodes=max_nodes)
            ready_since = (now if ready_since is None else ready_since) if len(state.joining) >= min_nodes else None
            ready_for = 0.0 if ready_since is None else now - ready_since
            started_over = self._state.conn.resumes_job
            last_call = st.last_call(state, started_over, s.last_call_s, s.scale_up_window_s)
            if st.can_complete(state, min_nodes, max_nodes, ready_for, last_call):

                def _complete(
                    cur: st.RendezvousState, ready_for: float = ready_for, started_over: bool = started_over
                ) -> st.RendezvousState | None:
                    wait = st.last_call(cur, started_over, s.last_call_s, s.scale_up_window_s)
                    ok = st.can_complete(cur, min_nodes, max_nodes, ready_for, wait)
                    return st.complete(cur, max_nodes) if ok else None

                state = self._state.update(_complete)
                continue
            folded = self._fold(state, min_nodes, max_nodes, ready_for)
            if folded is not None:
                state = folded
                continue
            if now > deadline:
                raise RendezvousTimeoutError(
                    f"no round formed within join_timeout={s.join_timeout_s:.0f}s "
                    f"({len(state.joining)} of min {min_nodes} nodes joined)"
                )
            (forming if st.round_over(state) and self._node_id in st.live_members(state) else backoff).sleep()
            state = self._state.read_cached()
            count = self._rejoin_count(state)
            if (state, count) != seen:
                seen = (state, count)
                backoff.reset()
                forming.reset()

    def _ask(self, info: st.NodeInfo) -> st.RendezvousState:
        """Ask for the next round: through this node's key when the state allows it, else through the state."""

        def once() -> st.RendezvousState:
            state = self._state.read_cached()
            hosted = self._state.conn.hosted_here
            if not st.rejoins_by_key(state, self._node_id) or (hosted and state.store_host != self._node_id):
                self.keyed, self._fold_hint = None, False
                return self._state.update(self._joined(info))
            count = self._write_rejoin(state.round, info)
            # The last to re-join (by the count) folds at once instead of waiting for the judge's next poll.
            self._fold_hint = count >= len(st.unfolded(state))
            return state

        return self._state.conn.retrying(once)

    def _write_rejoin(self, round_: int, info: st.NodeInfo) -> int:
        """Our key for the end of ``round_``, then one add to the round's count; returns the count."""
        key = self._state.key(f"rejoin/{round_}/{self._node_id}")
        store, payload = self._state.store, self._auth.seal(key, st.encode_info(info))
        self._state.call(lambda: set_bytes(store, key, payload), store)
        count = self._count_rejoins(store, round_, 1)
        self.keyed = (store, round_)
        return count

    def _count_rejoins(self, store: Store, round_: int, add: int) -> int:
        """How many re-joins ``round_`` has seen. etcd counts the keys themselves in one request: its ``add`` is
        a compare-and-set loop, which 63 re-joiners at once turn into O(N^2) transactions (measured: up to 2 s
        per re-join at 64 agents); c10d adds ``add`` to a counter, atomically in the store."""
        if isinstance(store, PrefixCounter):
            counter = store
            return int(self._state.call(lambda: counter.count_prefix(self._state.key(f"rejoin/{round_}/")), store))
        return int(self._state.call(lambda: store.add(self._state.key(f"rejoin/{round_}/count"), add), store))

    def _waits_by_key(self, state: st.RendezvousState) -> bool:
        """Whether our key (on the current store) asks for the end of ``state``'s round, and still counts."""
        keyed = self.keyed
        return (
            keyed is not None
            and keyed == (self._state.store, state.round)
            and self._node_id in st.live_members(state)
            and self._node_id not in state.joining
        )

    def _rejoin_count(self, state: st.RendezvousState) -> int:
        """The judge's poll of the re-join count (one O(1) read); -1 for everyone else, or when not needed."""
        if not st.round_over(state) or st.judge(state) != self._node_id or not st.unfolded(state):
            return -1
        try:
            return self._count_rejoins(self._state.store, state.round, 0)
        except StoreSwitched:
            return -1

    def _fold(
        self, state: st.RendezvousState, min_nodes: int, max_nodes: int, ready_for: float
    ) -> st.RendezvousState | None:
        """As the judge (or the last re-joiner), complete the round from the members' keys in one
        compare-and-set; the state now stored, or None if the keys do not complete it yet."""
        hint, self._fold_hint = self._fold_hint, False
        if not st.round_over(state) or not (hint or st.judge(state) == self._node_id):
            return None
        pending = st.unfolded(state)
        if not pending:
            return None
        round_, store = state.round, self._state.store
        if not hint and self._rejoin_count(state) < len(pending):
            return None  # the count is a hint only (a re-joiner evicted since counts too): the keys decide
        keys = [self._state.key(f"rejoin/{round_}/{m}") for m in pending]
        try:
            if not self._state.call(lambda: store.check(keys), store):
                return None
            raw = self._state.call(lambda: store.multi_get(keys), store)
        except StoreSwitched:
            return None
        rejoined = self._opened_rejoins(list(pending), keys, raw)
        s = self._settings
        if not st.can_complete(st.fold(state, round_, rejoined), min_nodes, max_nodes, ready_for, s.last_call_s):
            return None

        formed: list[bool] = [False]  # whether our compare-and-set formed the round (not someone else's)

        def _complete(cur: st.RendezvousState) -> st.RendezvousState | None:
            folded = st.fold(cur, round_, rejoined)
            formed[0] = st.can_complete(folded, min_nodes, max_nodes, ready_for, s.last_call_s)
            return st.complete(folded, max_nodes) if formed[0] else None

        after = self._state.update(_complete)
        if formed[0] and after.round == round_ + 1:
            lifecycle("round_folded", round=after.round, keys=len(rejoined), by="count" if hint else "judge")
        return after

    def _opened_rejoins(self, nodes: list[str], keys: list[str], raw: list[bytes]) -> dict[str, st.NodeInfo]:
        """The re-join keys of ``nodes`` that this node accepts (a forged or corrupt one is ignored)."""
        out: dict[str, st.NodeInfo] = {}
        for n, k, v in zip(nodes, keys, raw, strict=True):
            try:
                out[n] = st.decode_info(self._auth.open(k, bytes(v)))
            except RendezvousStateCorruptError as exc:
                self._quiet.log("rendezvous_value_ignored", exc, key=k)
        return out

    def _joined(self, info: st.NodeInfo) -> Callable[[st.RendezvousState], st.RendezvousState]:
        def fn(cur: st.RendezvousState) -> st.RendezvousState:
            conflict = st.nnodes_conflict(cur, self._node_id, info.nnodes)
            if conflict is not None and info.nnodes != (0, 0):
                other, theirs = conflict
                raise UsageError(
                    "--nnodes",
                    f"this node says {info.nnodes[0]}:{info.nnodes[1]}, but node {other} ({theirs.addr}) of the same "
                    f"job (--rdzv-id) says {theirs.nnodes[0]}:{theirs.nnodes[1]}; every node decides rounds by its "
                    "own, so launch them all with the same --nnodes",
                )
            new = st.join(cur, self._node_id, info)
            if self._state.conn.hosted_here and new.store_host != self._node_id:
                new = replace(new, store_host=self._node_id)
            return new

        return fn

    def change(self, round_: int) -> st.Change | None:
        """Why round ``round_`` is over for this node, as of a recent read (None: it goes on). Newcomers that fit
        wait ``scale_up_window`` first, so that nodes arriving together join in one round."""
        try:
            state = self._state.read_recent()
        except (RendezvousError, *STORE_ERRORS) as exc:
            self._quiet.log("membership_read_failed", exc)
            return None
        change = st.change_for(state, self._node_id, round_, self._params.max_nodes)
        if change is None or change.kind is not st.ChangeKind.SCALE_UP:
            self._scale_up_seen = None
            return change
        fit = st.newcomers(state)
        now = time.monotonic()
        if self._scale_up_seen is None:
            self._scale_up_seen = (fit, now)
        if now - self._scale_up_seen[1] < self._settings.scale_up_window_s:
            return None
        return change
