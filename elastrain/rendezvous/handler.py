"""elastrain's rendezvous handler: torch's ``RendezvousHandler`` over any compare-and-set ``RendezvousBackend``.

Faster than torch's dynamic handler where membership changes: sub-second heartbeats from a thread that
runs from the first join until shutdown (independent of rounds, so a node never evicts itself), a round
that completes as soon as every live member re-joined, graceful leave, and ``num_nodes_waiting`` that
also counts departed members, so torch's own monitor loop restarts survivors without using a restart.
Nodes that arrive while the round is full wait as hot spares (``event=standby``) and take a departed
member's place in the next round. Each round gets its own store prefix and its own worker store
(MASTER_PORT picked by the rank-0 node), never the agent's shared store (pytorch#135712).

With a checkpoint root (``elastrain-run --checkpoint-dir``), every round's leader claims the job's next
fencing generation there before any worker starts (:mod:`elastrain.fence`): a world that
loses the claim (the other side of a partition, a store founded again at the original endpoint) stops
and joins the winner's store, and a world that finds a newer claim while it runs stops its workers.
Once a round is visibly over, its live members re-join through keys of their own (one write and one count each)
and one node folds them into the state in a single compare-and-set (:func:`state.fold`; see ``_ask``), so 63
survivors do not race 63 compare-and-sets of the whole state.
Liveness (probes, the node's own stall) lives in :mod:`elastrain.rendezvous.liveness`; moving the c10d
store to a successor lives with the c10d backend (:mod:`elastrain.rendezvous.backends.c10d`); the job's secret, which
signs every value written, in :mod:`elastrain.rendezvous.auth`; what a node accepts from the store (forged or
corrupt values, redirects) in :mod:`elastrain.rendezvous.trust`; where it listens in
:mod:`elastrain.rendezvous.binding`.

Options (``--rdzv-conf key=value``), in seconds:

* ``heartbeat_interval`` (0.25) and ``heartbeat_timeout`` (5): a node whose heartbeat did not move
  for the timeout is dead (a node whose agent process is gone is dead at once: its probe port refuses,
  so the timeout only decides for frozen or unreachable nodes; a short one evicts live nodes that are
  merely CPU-starved, as seen with 1.25 s on a loaded 2-core machine);
* ``last_call_timeout`` (30, as torch): how long a job's *first* round waits for more than
  ``min_nodes``; later rounds never wait for it;
* ``join_timeout`` (600): how long a node waits for a round while no round of the job is running
  (a spare waits as long as the job runs);
* ``store_lost_timeout`` (3): how long the store may fail before giving up;
* ``scale_up_window`` (1): a running round waits this long after it first sees a newcomer before it
  re-forms, so that nodes arriving together join in one round;
* ``claim_grace`` (2 x heartbeat_timeout): how long a round that holds no majority of the previous
  round's voters waits before it claims the next generation (a majority side claims first).
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol, TypeVar, cast, runtime_checkable

from torch._C._distributed_c10d import PrefixStore, Store
from torch.distributed import DistError
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from elastrain import fence
from elastrain.errors import (
    NodeLeftError,
    RendezvousError,
    RendezvousStateCorruptError,
    RendezvousStoreLostError,
    StaleGenerationError,
    UsageError,
)
from elastrain.log import lifecycle
from elastrain.rendezvous import binding, liveness, trust
from elastrain.rendezvous import state as st
from elastrain.rendezvous.auth import RendezvousAuth, SignedStore, compare_set_bytes, set_bytes

_T = TypeVar("_T")

# What a store operation may raise when the store is slow, gone or unreachable (typed, never matched by text).
STORE_ERRORS = (DistError, RendezvousConnectionError, TimeoutError, ConnectionError)


@dataclass(frozen=True)
class HandlerSettings:
    heartbeat_interval_s: float = 0.25
    heartbeat_timeout_s: float = 5.0
    last_call_s: float = 30.0
    join_timeout_s: float = 600.0
    store_lost_timeout_s: float = 3.0
    scale_up_window_s: float = 1.0
    claim_grace_s: float | None = None
    poll_min_s: float = 0.02
    poll_max_s: float = 0.25
    poll_forming_s: float = 0.05
    """How often, at most, a node waits between reads while a round it belongs to is forming (a member departed
    or re-joined): the round completes within moments, and every waiter should see it at once."""
    suspect_after: float = 0.9
    """Heartbeat intervals without a move after which the judge probes a node (a refused probe evicts it)."""
    leave_timeout_s: float = 5.0
    store_op_timeout_s: float = 10.0
    """A store call that has not returned by then is abandoned: a TCPStore client whose packets are silently
    dropped (a network cut) blocks in its receive forever, whatever its own timeout."""
    refound_after_s: float = 60.0
    """A node that never joined a round and found no live store of its job for this long (the published store
    silent: every member died with its host) starts the job over at ``--rdzv-endpoint`` (c10d): a first start
    from the newest checkpoint, under the next fencing generation (a world that was only slow is then fenced)."""

    def __post_init__(self) -> None:
        if self.heartbeat_interval_s <= 0:
            raise UsageError("--rdzv-conf heartbeat_interval", f"must be > 0, got {self.heartbeat_interval_s}")
        if self.heartbeat_timeout_s < 2 * self.heartbeat_interval_s + 0.2:
            raise UsageError(
                "--rdzv-conf heartbeat_timeout",
                f"must be at least 2 x heartbeat_interval + 0.2 s ({2 * self.heartbeat_interval_s + 0.2:.2f}), "
                f"got {self.heartbeat_timeout_s}: a shorter one evicts live but busy nodes",
            )
        if self.scale_up_window_s < 0:
            raise UsageError("--rdzv-conf scale_up_window", f"must be >= 0, got {self.scale_up_window_s}")
        if self.claim_grace_s is not None and self.claim_grace_s < 0:
            raise UsageError("--rdzv-conf claim_grace", f"must be >= 0, got {self.claim_grace_s}")
        if self.refound_after_s <= self.store_lost_timeout_s:
            raise UsageError(
                "--rdzv-conf refound_after",
                f"must be > store_lost_timeout ({self.store_lost_timeout_s} s), got {self.refound_after_s}",
            )

    @property
    def stall_s(self) -> float:
        """A heartbeat tick this late (or a store read this slow) means this node itself stalled."""
        return max(self.heartbeat_timeout_s / 2, 0.5)

    @property
    def grace_s(self) -> float:
        return 2 * self.heartbeat_timeout_s if self.claim_grace_s is None else self.claim_grace_s

    @classmethod
    def from_params(cls, params: RendezvousParameters) -> HandlerSettings:
        def num(key: str, default: float | None) -> float | None:
            raw = params.get(key, None)
            if raw is None:
                return default
            try:
                return float(raw)
            except (TypeError, ValueError):
                raise UsageError(f"--rdzv-conf {key}", f"expected seconds, got {raw!r}") from None

        d = cls()

        def req(key: str, default: float) -> float:
            value = num(key, default)
            return default if value is None else value

        return cls(
            heartbeat_interval_s=req("heartbeat_interval", d.heartbeat_interval_s),
            heartbeat_timeout_s=req("heartbeat_timeout", d.heartbeat_timeout_s),
            last_call_s=req("last_call_timeout", d.last_call_s),
            join_timeout_s=req("join_timeout", d.join_timeout_s),
            store_lost_timeout_s=req("store_lost_timeout", d.store_lost_timeout_s),
            scale_up_window_s=req("scale_up_window", d.scale_up_window_s),
            store_op_timeout_s=req("store_op_timeout", d.store_op_timeout_s),
            claim_grace_s=num("claim_grace", None),
            refound_after_s=req("refound_after", d.refound_after_s),
        )


def node_address(params: RendezvousParameters) -> str:
    """What peers and workers use to reach this node: ``--local-addr``, else loopback for a loopback endpoint, else
    the FQDN (as torch's handler); every port it listens on is bound to this address's interface (binding.py)."""
    return binding.advertised_address(params.local_addr, str(params.endpoint))


class StoreFactory(Protocol):
    """What a backend whose store lives in a node (c10d) offers the handler: failover and redirects."""

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

    def refound(self) -> tuple[RendezvousBackend, Store, str, bool]:
        """The store at the endpoint, where a job with no live store starts over: (backend, store, address,
        hosted here); raises :class:`RendezvousStoreLostError` when it can be neither hosted nor reached."""
        ...


@runtime_checkable
class PrefixCounter(Protocol):
    """A store that counts the keys under a prefix in one request (etcd, where ``add`` is a compare-and-set loop)."""

    def count_prefix(self, prefix: str) -> int: ...


class _StoreSwitched(Exception):
    """The state store moved to a successor; the operation restarts on the new one."""


class _RoundLost(Exception):
    """The round this node formed was superseded before its generation was settled: join again."""


class _Superseded(Exception):
    """Another world of this job holds the newest generation; this node leaves for that world's store."""

    def __init__(self, store: str) -> None:
        super().__init__(store)
        self.store = store


def _other_job(root: str, claim: fence.Claim, run_id: str) -> RendezvousError:
    return RendezvousError(
        f"--checkpoint-dir {root} was taken over by another job (run id {claim.run_id!r}, generation "
        f"{claim.generation}); one checkpoint directory serves one job: give this job its own --checkpoint-dir, "
        f"or start it with that job's --rdzv-id to join it (this one is {run_id!r})"
    )


class _Backoff:
    """Waits that start short and grow to a ceiling, with jitter; reset when something changes."""

    def __init__(self, low: float, high: float) -> None:
        self._low, self._high, self._cur = low, high, low

    def reset(self) -> None:
        self._cur = self._low

    def sleep(self) -> None:
        time.sleep(self._cur * random.uniform(0.8, 1.2))
        self._cur = min(self._high, self._cur * 1.5)


class _Throttled:
    """One log line per kind of swallowed error and interval, with a count of the ones not logged."""

    def __init__(self, every_s: float = 10.0) -> None:
        self._every = every_s
        self._last: dict[str, float] = {}
        self._hidden: dict[str, int] = {}

    def log(self, event: str, exc: BaseException, **fields: object) -> None:
        key = f"{event}:{type(exc).__name__}"
        now = time.monotonic()
        if now - self._last.get(key, -1e18) < self._every:
            self._hidden[key] = self._hidden.get(key, 0) + 1
            return
        hidden = self._hidden.pop(key, 0)
        self._last[key] = now
        lifecycle(event, level=logging.WARNING, error=repr(exc)[:200], not_logged_since=hidden, **fields)


def _with_deadline(op: Callable[[], _T], timeout_s: float) -> _T:
    """``op()`` in a daemon thread; TimeoutError if it has not returned within ``timeout_s`` (it is abandoned)."""
    box: dict[str, object] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["out"] = op()
        except BaseException as exc:  # handed to the caller below
            box["err"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name="elastrain-store-call", daemon=True).start()
    if not done.wait(timeout_s):
        raise TimeoutError(f"a rendezvous store call did not return in {timeout_s}s")
    if "err" in box:
        raise cast(BaseException, box["err"])
    return cast(_T, box["out"])


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
        self._backend = backend
        self._store = store
        self._params = params
        self._settings = settings or HandlerSettings.from_params(params)
        self._on_store_lost = on_store_lost
        self.node_id = f"{socket.gethostname()}_{os.getpid()}_{uuid.uuid4().hex[:6]}"
        self._addr = node_address(params)
        self._lock = threading.RLock()  # RLock: a signal handler on the main thread may leave mid-update
        self._cached = st.RendezvousState()
        self._round = -1
        self._members: tuple[str, ...] = ()  # of the round this node last joined
        self._kept_every_member = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._obs = st.Observations()
        self._store_failing_since: float | None = None
        self._left = False
        self.fatal_error: Exception | None = None
        """Set by the heartbeat thread when the state store is gone; the agent raises it."""
        self._probe = liveness.ProbeListener(binding.listen_host(self._addr))
        self._stores = stores
        self._hosts_store = hosts_store
        self._standby_port = binding.free_port(self._addr) if stores is not None else 0
        # What this node accepts from the store (the job's secret; stand-ins for forged or corrupt states).
        self._auth = auth if auth is not None else RendezvousAuth.from_params(params)
        self._standin = trust.StandIn(self._settings.heartbeat_timeout_s, secret=self._auth.enabled)
        self._job_hosts = trust.JobHosts(str(params.endpoint), self._addr)
        self._clock = liveness.TickClock(self._settings.heartbeat_interval_s, self._settings.stall_s)
        self._probe_all = False
        self._quiet = _Throttled()
        self._store_address = store_address or str(params.endpoint)
        self._fence_root = fence_root if fence_root is not None else (params.get("checkpoint_root", None) or None)
        self.generation: int | None = None
        """The fencing generation this node's world claimed (None without a checkpoint root)."""
        self._fenced_by: str | None = None
        self._foreign: RendezvousError | None = None
        self._next_fence_check = 0.0
        self._keyed: tuple[object, int] | None = None  # (store, round) whose end we asked for through our key
        self._fold_hint = False
        self._decided: st.Change | None = None
        self._decision_fresh = False
        self._scale_up_seen: tuple[tuple[str, ...], float] | None = None
        self._beats = 0
        self._keys_on: object | None = None  # the store on which this node's liveness keys exist
        self._cached_version: int | None = None
        self._judged_last: str | None = None
        self._wedged: object | None = None
        self._next_reconnect = 0.0
        self._reconnect_pause = 0.0
        self._version_at = 0.0
        # After this node's workers fail: until when it watches every member's heartbeat, the counters it
        # first read in that window, and the members whose counter moved since (alive, so no excuse).
        self._failure_watch_until = 0.0
        self._watch_first: dict[str, int] = {}
        self._watch_moved: set[str] = set()

    # -- torch's RendezvousHandler ---------------------------------------------------------------
    def get_backend(self) -> str:
        return str(self._params.backend)

    @property
    def use_agent_store(self) -> bool:
        return False

    @property
    def elastrain_round(self) -> int:
        """The job-wide round of the last completed rendezvous (identical on every node)."""
        return self._round

    @property
    def round(self) -> int | None:
        """:class:`~elastrain.rendezvous.api.Membership`'s name for :attr:`elastrain_round`."""
        return self._round

    def get_run_id(self) -> str:
        return str(self._params.run_id)

    def next_rendezvous(self) -> RendezvousInfo:
        s = self._settings
        deadline = time.monotonic() + s.join_timeout_s
        info = st.NodeInfo(self._addr, binding.free_port(self._addr), self._probe.port, self._standby_port)
        self._decided, self._decision_fresh, self._scale_up_seen = None, False, None
        if self._foreign is not None:
            raise self._foreign
        if self._fenced_by is not None:
            self._redirect(self._fenced_by, deadline)
        store_backoff = _Backoff(0.1, 1.0)
        for _ in range(1000):
            try:
                state = self._form_round(info, deadline)
                if self._fence_root:
                    state = self._settle_generation(state, deadline)
                break
            except _RoundLost:
                continue
            except _Superseded as exc:
                self._redirect(exc.store, deadline)
            except (_StoreSwitched, trust.StateUnsettledError, *STORE_ERRORS) as exc:
                # The store failed while this node joined and no failover has taken over yet (a newcomer that
                # never read the state knows no successor: it looks for the published store). _call gives up
                # with RendezvousStoreLostError once the store has failed for store_lost_timeout.
                self._quiet.log("rendezvous_store_failed", exc, node=self.node_id)
                store_backoff.sleep()
        else:
            raise RendezvousTimeoutError("no round settled after 1000 attempts (the membership kept changing)")
        # Only a round that directly follows this node's last one can have kept its members: a node that missed
        # rounds (cut off, then back) was left behind, whoever the new round holds.
        follows = self._round >= 0 and state.round == self._round + 1
        self._round = state.round
        self._kept_every_member = follows and self.node_id in self._members and set(self._members) <= set(state.members)
        self._members = state.members
        master = state.nodes[state.members[0]]
        rank = state.members.index(self.node_id)
        prefix = f"elastrain/{self.get_run_id()}/round{state.round}/"
        store: Store = PrefixStore(prefix, self._store)
        if self._auth.enabled:
            store = SignedStore(store, self._auth, prefix)  # torch's agent keys (ranks, barriers), sealed too
        bootstrap = RendezvousStoreInfo(master_addr=master.addr, master_port=master.master_port)
        return RendezvousInfo(store, rank, len(state.members), bootstrap)

    def _form_round(self, info: st.NodeInfo, deadline: float) -> st.RendezvousState:
        """Join and wait until this node is a member of a completed round; return that state."""
        s = self._settings
        min_nodes, max_nodes = self._params.min_nodes, self._params.max_nodes
        if self._left:
            raise NodeLeftError(f"node {self.node_id} left the job")
        self._ensure_keys()
        state = self._ask(info)
        self._start_heartbeat()
        target = state.round + 1
        lifecycle(
            "rendezvous_joined",
            node=self.node_id,
            target_round=target,
            joining=len(state.joining),
            via="key" if self._keyed is not None else "state",
        )
        ready_since: float | None = None
        standby_logged = False
        backoff = _Backoff(s.poll_min_s, s.poll_max_s)
        forming = _Backoff(s.poll_min_s, max(s.poll_min_s, s.poll_forming_s))
        seen: tuple[st.RendezvousState, int] = (state, -1)
        while True:
            if state.closed:
                raise RendezvousClosedError()
            if self._left:
                raise NodeLeftError(f"node {self.node_id} left the job")
            if state.superseded_by:
                raise _Superseded(state.superseded_by)
            if self.node_id in state.joining or self._waits_by_key(state):
                target = state.round + 1
            elif self.node_id in state.members and state.round >= target:
                return state
            else:
                # Evicted while waiting (we were frozen), dropped from the state, or our key was written on a
                # store that has since moved: ask again.
                state = self._ask(info)
                continue
            now = time.monotonic()
            live = st.live_members(state)
            if self.node_id in st.spares(state, max_nodes) and live:
                # A full round runs: wait as a hot spare, as long as the job runs (no join timeout).
                deadline = now + s.join_timeout_s
                if not standby_logged:
                    standby_logged = True
                    lifecycle("standby", node=self.node_id, round=state.round, members=len(live), max_nodes=max_nodes)
            ready_since = (now if ready_since is None else ready_since) if len(state.joining) >= min_nodes else None
            ready_for = 0.0 if ready_since is None else now - ready_since
            if st.can_complete(state, min_nodes, max_nodes, ready_for, s.last_call_s):

                def _complete(cur: st.RendezvousState, ready_for: float = ready_for) -> st.RendezvousState | None:
                    ok = st.can_complete(cur, min_nodes, max_nodes, ready_for, s.last_call_s)
                    return st.complete(cur, max_nodes) if ok else None

                state = self._update(_complete)
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
            (forming if st.round_over(state) and self.node_id in st.live_members(state) else backoff).sleep()
            state = self._read_cached()
            count = self._rejoin_count(state)
            if (state, count) != seen:
                seen = (state, count)
                backoff.reset()
                forming.reset()

    # -- re-joins through keys (see state.rejoins_by_key) -----------------------------------------
    # A live member of a round that is visibly over asks for the next one with two O(1) writes: its address
    # under ``rejoin/<round>/<node>`` and one ``add`` to ``rejoin/<round>/count``. The re-joiner whose add
    # reaches the number of members still to re-join, or else the round's judge (polling the count),
    # reads the keys and completes the round with ONE compare-and-set of the state (state.fold). Keys are
    # never deleted (a reader that saw them exist may still read them); they cost ~100 bytes per member and
    # round, as torch's own per-round rank-assignment keys do.
    def _ask(self, info: st.NodeInfo) -> st.RendezvousState:
        """Ask for the next round: through this node's key when the state allows it, else through the state."""
        for _ in range(10):
            state = self._read_cached()
            if not st.rejoins_by_key(state, self.node_id) or (self._hosts_store and state.store_host != self.node_id):
                self._keyed, self._fold_hint = None, False
                return self._update(self._joined(info))
            try:
                count = self._write_rejoin(state.round, info)
            except _StoreSwitched:
                continue
            # The last to re-join (by the count) folds at once instead of waiting for the judge's next poll.
            self._fold_hint = count >= len(st.unfolded(state))
            return state
        raise RendezvousStoreLostError("the rendezvous store kept moving (10 failovers in a row)")

    def _write_rejoin(self, round_: int, info: st.NodeInfo) -> int:
        """Our key for the end of ``round_``, then one add to the round's count; returns the count."""
        key = self._key(f"rejoin/{round_}/{self.node_id}")
        store, payload = self._store, self._auth.seal(key, st.encode_info(info))
        self._call(lambda: set_bytes(store, key, payload))
        count = self._count_rejoins(store, round_, 1)
        self._keyed = (store, round_)
        return count

    def _count_rejoins(self, store: Store, round_: int, add: int) -> int:
        """How many re-joins ``round_`` has seen. etcd counts the keys themselves in one request: its ``add`` is
        a compare-and-set loop, which 63 re-joiners at once turn into O(N^2) transactions (measured: up to 2 s
        per re-join at 64 agents); c10d adds ``add`` to a counter, atomically in the store."""
        if isinstance(store, PrefixCounter):
            counter = store
            return int(self._call(lambda: counter.count_prefix(self._key(f"rejoin/{round_}/"))))
        return int(self._call(lambda: store.add(self._key(f"rejoin/{round_}/count"), add)))

    def _waits_by_key(self, state: st.RendezvousState) -> bool:
        """Whether our key (on the current store) asks for the end of ``state``'s round, and still counts."""
        keyed = self._keyed
        return (
            keyed is not None
            and keyed == (self._store, state.round)
            and self.node_id in st.live_members(state)
            and self.node_id not in state.joining
        )

    def _rejoin_count(self, state: st.RendezvousState) -> int:
        """The judge's poll of the re-join count (one O(1) read); -1 for everyone else, or when not needed."""
        if not st.round_over(state) or st.judge(state) != self.node_id or not st.unfolded(state):
            return -1
        try:
            return self._count_rejoins(self._store, state.round, 0)
        except _StoreSwitched:
            return -1

    def _fold(
        self, state: st.RendezvousState, min_nodes: int, max_nodes: int, ready_for: float
    ) -> st.RendezvousState | None:
        """As the judge (or the last re-joiner), complete the round from the members' keys in one
        compare-and-set; the state now stored, or None if the keys do not complete it yet."""
        hint, self._fold_hint = self._fold_hint, False
        if not st.round_over(state) or not (hint or st.judge(state) == self.node_id):
            return None
        pending = st.unfolded(state)
        if not pending:
            return None
        round_, store = state.round, self._store
        if not hint and self._rejoin_count(state) < len(pending):
            return None  # the count is a hint only (a re-joiner evicted since counts too): the keys decide
        keys = [self._key(f"rejoin/{round_}/{m}") for m in pending]
        try:
            if not self._call(lambda: store.check(keys)):
                return None
            raw = self._call(lambda: store.multi_get(keys))
        except _StoreSwitched:
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

        after = self._update(_complete)
        if formed[0] and after.round == round_ + 1:
            lifecycle("round_folded", round=after.round, keys=len(rejoined), by="count" if hint else "judge")
        return after

    # -- fencing ---------------------------------------------------------------------------------
    def _settle_generation(self, state: st.RendezvousState, deadline: float) -> st.RendezvousState:
        """The round's leader claims its generation; every member waits (bounded) for it."""
        root = self._fence_root
        if root is None:
            return state
        round_ = state.round
        if state.members[0] == self.node_id and state.generation_round != round_:
            try:
                generation = self._claim(state, root)
            except OSError as exc:
                raise RendezvousError(
                    f"--checkpoint-dir {root}: cannot claim the job's fencing generation there ({exc}); "
                    "it must be a directory (or URL) that every node can write"
                ) from exc
            after = self._update(lambda cur: st.record_generation(cur, round_, generation))
            if after.round != round_:
                raise _RoundLost()
            lifecycle("generation_claimed", generation=generation, round=round_, store=self._store_address, root=root)
        backoff = _Backoff(self._settings.poll_min_s, self._settings.poll_max_s)
        while True:
            cur = self._read_cached()
            if cur.superseded_by:
                raise _Superseded(cur.superseded_by)
            if cur.round != round_ or self.node_id not in cur.members:
                raise _RoundLost()
            change = st.change_for(cur, self.node_id, round_, self._params.max_nodes)
            if change is not None and change.kind is not st.ChangeKind.SCALE_UP:
                raise _RoundLost()  # the leader died (or a member left) before the generation was settled
            if cur.generation_round == round_:
                self.generation = cur.generation
                return cur
            if time.monotonic() > deadline:
                raise RendezvousTimeoutError(f"round {round_}'s leader claimed no generation in time")
            backoff.sleep()

    def _claim(self, state: st.RendezvousState, root: str) -> int:
        """Claim this round's generation in ``root``, or tombstone the lineage and raise :class:`_Superseded`."""
        round_ = state.round
        if state.generation_round < 0:
            # A fresh store: a job is either starting, or running elsewhere (a store founded again at the
            # original endpoint, a restarted worker-0 pod): join that job rather than found a second one.
            top = fence.newest(root)
            if (
                top is not None
                and top.store
                and top.run_id == self.get_run_id()
                and top.store != self._store_address
                and self._answers(top.store)
                and self._claim_trusted(top)
            ):
                self._tombstone(top.store, f"generation {top.generation} runs at {top.store}")
            got = fence.claim_fresh(
                root, self.get_run_id(), round_, self._store_address, state.members,
                store_mac=self._auth.store_mac(self._store_address),
            )  # fmt: skip
            return got.generation
        if not state.majority:
            # Perhaps the minority side of a partition: let a majority side claim first.
            lifecycle("claim_delayed", round=round_, grace_s=self._settings.grace_s, why="no majority of voters")
            end = time.monotonic() + self._settings.grace_s
            while time.monotonic() < end:
                time.sleep(min(0.25, max(0.0, end - time.monotonic())))
                if self._read().round != round_:
                    raise _RoundLost()
        parent = state.generation
        for _ in range(100):
            won = fence.claim_after(
                root, self.get_run_id(), round_, self._store_address, state.members, parent,
                store_mac=self._auth.store_mac(self._store_address),
            )  # fmt: skip
            if won is not None:
                return won.generation
            winner = fence.read_claim(root, parent + 1)
            if winner is not None and winner.store == self._store_address and winner.run_id == self.get_run_id():
                parent += 1  # our own lineage's claim, by a leader that died before recording it
                continue
            if winner is not None and winner.run_id and winner.run_id != self.get_run_id():
                raise _other_job(root, winner, self.get_run_id())
            store = winner.store if winner is not None and self._claim_trusted(winner) else ""
            self._tombstone(store, f"generation {parent + 1} was claimed by another world")
        raise StaleGenerationError(f"could not claim a generation after {parent} in {root} (100 tries)")

    def _tombstone(self, store: str, why: str) -> None:
        lifecycle("world_superseded", level=logging.WARNING, node=self.node_id, winner_store=store, why=why)
        self._update(lambda cur: st.supersede(cur, store))
        raise _Superseded(store)

    def _answers(self, address: str) -> bool:
        if self._stores is None:
            return False
        try:
            return self._stores.answers(address, self._settings.store_lost_timeout_s)
        except STORE_ERRORS as exc:
            lifecycle("store_probe_failed", level=logging.INFO, address=address, error=repr(exc)[:120])
            return False

    def _redirect(self, address: str, deadline: float) -> None:
        """Leave this lineage's store for ``address`` (the winning world's), retrying until ``deadline``."""
        if self._stores is None or not address or address == "unknown":
            raise RendezvousError(
                f"another world of run {self.get_run_id()} holds a newer generation in {self._fence_root} "
                f"(its store: {address or 'unknown'}) and this backend cannot move there; start this node "
                "again to join it"
            )
        if not self._auth.enabled and not self._names_member(address):
            # Without a secret the state is anyone's to write: follow it only to a store of the job's own nodes.
            raise RendezvousError(
                f"the rendezvous state sends this node to {address}, which names no node of run "
                f"{self.get_run_id()}; refused (a forged state?). Give every node a shared secret "
                "(--rdzv-conf secret_file=PATH) so that only the job's nodes can write its rendezvous"
            )
        backoff = _Backoff(0.5, 5.0)
        while True:
            try:
                backend, store = self._stores.connect_to(address, self._settings.store_lost_timeout_s)
                break
            except STORE_ERRORS as exc:
                lifecycle("redirect_waiting", level=logging.WARNING, store=address, error=repr(exc)[:120])
                if time.monotonic() > deadline:
                    raise RendezvousTimeoutError(f"the winning world's store at {address} did not answer") from exc
                backoff.sleep()
        with self._lock:
            self._backend, self._store = backend, store
            self._hosts_store = False
            self._store_address = address
            self._cached = st.RendezvousState()
            self._obs = st.Observations()
            self._fenced_by = None
            self.generation = None
            self._cached_version = None
        lifecycle("redirected", node=self.node_id, store=address)

    def _fence_change(self) -> st.Change | None:
        """Every heartbeat timeout, whether a newer world claimed the checkpoint root (then: stop, join it)."""
        if not self._fence_root or self.generation is None:
            return None
        now = time.monotonic()
        if self._fenced_by is None and now >= self._next_fence_check:
            self._next_fence_check = now + self._settings.heartbeat_timeout_s / 2
            try:
                fence.check(self._fence_root, self.generation)
            except StaleGenerationError as exc:
                top = fence.newest(self._fence_root)
                if top is not None and top.run_id and top.run_id != self.get_run_id():
                    self._foreign = _other_job(self._fence_root, top, self.get_run_id())
                self._fenced_by = top.store if top is not None and self._claim_trusted(top) else "unknown"
                lifecycle("world_superseded", level=logging.WARNING, node=self.node_id, why=str(exc))
            except OSError as exc:
                self._quiet.log("fence_check_failed", exc, root=self._fence_root)
        if self._fenced_by is not None:
            return st.Change(st.ChangeKind.FENCED, f"a newer world runs at {self._fenced_by}")
        return None

    def is_closed(self) -> bool:
        return self._read().closed

    def set_closed(self) -> None:
        self._update(st.close)

    def num_nodes_waiting(self) -> int:
        """torch's monitor loop asks this right after the agent's own check; both see one decision."""
        if self._decision_fresh:
            self._decision_fresh = False
            change = self._decided
            return 0 if change is None else max(1, st.nodes_waiting(self._cached, self._params.max_nodes))
        change = self._change()
        return 0 if change is None else max(1, st.nodes_waiting(self._cached, self._params.max_nodes))

    def shutdown(self) -> bool:
        """The job is over for this node: close the rendezvous (as torch's handlers do) and stop beating."""
        self._stop_heartbeat()
        try:
            self._update(lambda cur: st.close(st.remove(cur, [self.node_id], st.Departure.FINISHED.value)))
        except (RendezvousError, *STORE_ERRORS) as exc:
            lifecycle("rendezvous_close_failed", level=logging.WARNING, error=repr(exc)[:200])
            return False
        if self._hosts_store:
            self._linger_until_seen()  # the late joiners learn that the job is over, not that the store died
        return True

    # -- elastrain's additions -------------------------------------------------------------------
    @property
    def kept_every_member(self) -> bool:
        """Whether the round just formed holds every member of this node's previous round (nodes joined,
        none left): the same answer on every node of both rounds. A live regroup then moves at a step the
        workers agree on, finishing the step in flight (see :class:`elastrain.control.RegroupNotice`)."""
        return self._kept_every_member

    @property
    def membership_grace_s(self) -> float:
        """How long after a worker failure a departed peer can take to show up in the state."""
        return self._settings.heartbeat_timeout_s + 2 * self._settings.heartbeat_interval_s

    @property
    def store_failing(self) -> bool:
        return self._store_failing_since is not None

    @property
    def verdict_pending(self) -> bool:
        """Whether a worker failure cannot be judged yet: the store fails, or (bounded by a heartbeat timeout
        past the grace) a member of this round has not beaten since the failure. A peer frozen with ours, or
        the job gone on without us while we were frozen, shows up as an eviction, not as our failure."""
        if self.store_failing:
            return True
        if time.monotonic() >= self._failure_watch_until:
            return False
        state = self._cached
        if state.round != self._round:
            return False  # the round is over: membership_change says so
        return any(m != self.node_id and m not in self._watch_moved for m in st.live_members(state))

    def probe_peers(self) -> None:
        """Probe every peer at the next heartbeat tick (the agent calls this when its workers fail)."""
        self._probe_all = True

    def report_worker_failure(self, echo: bool = False) -> None:
        """This node's workers failed: record it in the round (``echo``: they said a collective broke under
        them; see :func:`state.report_failure`) and probe every peer at the next heartbeat tick."""
        self._probe_all = True
        round_ = self._round
        if round_ < 0:
            return
        s = self._settings
        self._watch_first, self._watch_moved = {}, set()
        self._failure_watch_until = time.monotonic() + self.membership_grace_s + s.heartbeat_timeout_s
        try:
            after = self._update(lambda cur: st.report_failure(cur, self.node_id, round_, echo))
        except (RendezvousError, *STORE_ERRORS) as exc:
            self._quiet.log("failure_report_failed", exc, node=self.node_id)
            return
        if after.round == round_ and self.node_id in after.failed:
            lifecycle(
                "workers_failed",
                level=logging.WARNING,
                node=self.node_id,
                round=round_,
                order=after.failed.index(self.node_id) + 1,
                first=after.failed[0],
                echo=echo,
            )

    def membership_change(self) -> st.Change | None:
        """Why this node's current round is over; the next ``num_nodes_waiting`` answers the same."""
        change = self._change()
        self._decided, self._decision_fresh = change, True
        return change

    def _change(self) -> st.Change | None:
        if self._round < 0:
            return None
        fenced = self._fence_change()
        if fenced is not None:
            return fenced
        try:
            state = self._read_recent()
        except (RendezvousError, *STORE_ERRORS) as exc:
            self._quiet.log("membership_read_failed", exc)
            return None
        change = st.change_for(state, self.node_id, self._round, self._params.max_nodes)
        if change is None or change.kind is not st.ChangeKind.SCALE_UP:
            self._scale_up_seen = None
            return change
        # Newcomers that fit: wait a short window so that nodes arriving together join in one round.
        fit = st.newcomers(state)
        now = time.monotonic()
        if self._scale_up_seen is None:
            self._scale_up_seen = (fit, now)
        if now - self._scale_up_seen[1] < self._settings.scale_up_window_s:
            return None
        return change

    def leave(self, reason: str, kind: st.Departure = st.Departure.LEFT) -> None:
        """Announce that this node leaves (survivors re-form at once) and stop its heartbeat; bounded."""
        if self._left:
            return
        self._left = True
        self._stop_heartbeat()
        done = threading.Event()
        error: list[BaseException] = []

        def announce() -> None:
            try:
                self._update(lambda cur: st.remove(cur, [self.node_id], f"{kind.value}:{reason}"))
            except BaseException as exc:  # reported below, on the caller's thread
                error.append(exc)
            finally:
                done.set()

        threading.Thread(target=announce, name="elastrain-leave", daemon=True).start()
        if not done.wait(self._settings.leave_timeout_s):
            lifecycle(
                "node_leave_unannounced",
                level=logging.WARNING,
                node=self.node_id,
                error=f"the store did not answer within {self._settings.leave_timeout_s}s",
            )
        elif error:  # the others will evict us by heartbeat instead
            lifecycle("node_leave_unannounced", level=logging.WARNING, node=self.node_id, error=repr(error[0])[:200])
        else:
            lifecycle("node_left", node=self.node_id, reason=reason, kind=kind.value, round=self._round)
            if self._hosts_store:
                self._linger_until_seen()

    def _linger_until_seen(self) -> None:
        """The store dies with this process: keep it up (bounded) until every peer has read the state since our
        leave or the job's end, so that each learns why (a setting error, a notice, the job is over) instead of
        a silent store loss (which a joiner would answer by hosting a store of its own).
        A peer reads the state right after each beat, so one beat past our first look is enough."""
        s = self._settings
        deadline = time.monotonic() + 4 * s.heartbeat_interval_s + 0.5
        started = time.monotonic()
        try:
            peers = [n for n in self._read_cached().heartbeats if n != self.node_id]
            first = self._read_beats(peers)
            while peers and time.monotonic() < deadline:
                now = self._read_beats(peers)
                peers = [n for n in peers if now[n] <= first[n]]
                if peers:
                    time.sleep(s.heartbeat_interval_s / 4)
        except (RendezvousError, _StoreSwitched, *STORE_ERRORS) as exc:
            self._quiet.log("store_linger_failed", exc, node=self.node_id)
            return
        lifecycle("store_host_lingered", waited_s=round(time.monotonic() - started, 3), unseen=len(peers))

    def _joined(self, info: st.NodeInfo) -> Callable[[st.RendezvousState], st.RendezvousState]:
        def fn(cur: st.RendezvousState) -> st.RendezvousState:
            new = st.join(cur, self.node_id, info)
            if self._hosts_store and new.store_host != self.node_id:
                new = replace(new, store_host=self.node_id)
            return new

        return fn

    # -- state access ----------------------------------------------------------------------------
    # The state blob is read only when it changed: every write bumps a version counter next to it, and
    # readers (monitor ticks, waiting joiners and spares) compare that counter first, a few bytes whatever
    # the number of nodes. Heartbeats never touch the blob (see _heartbeat_once).
    def _key(self, what: str) -> str:
        return f"elastrain/{self.get_run_id()}/{what}"

    def _ensure_keys(self) -> None:
        """Create this node's heartbeat key and the version counter on the current store (once per store)."""
        for _ in range(10):
            store = self._store
            if self._keys_on is store:
                return
            key = self._key(f"beat/{self.node_id}")
            beat = self._auth.seal(key, str(self._beats))
            try:
                self._call(lambda s=store, k=key, b=beat: set_bytes(s, k, b))  # type: ignore[misc]
                self._call(lambda s=store: s.add(self._key("version"), 0))  # type: ignore[misc]
            except _StoreSwitched:
                continue
            self._keys_on = store
            return
        raise RendezvousStoreLostError("the rendezvous store kept moving (10 failovers in a row)")

    def _version(self) -> int:
        store = self._store
        raw = self._call(lambda: store.get(self._key("version")))
        try:
            return int(raw)
        except ValueError as exc:
            # Not a counter (written by something else): read the state again, and restart the counter at a value
            # no reader has cached (adds to a non-number fail, and readers compare versions for equality only).
            key = self._key("version")
            self._quiet.log("rendezvous_value_ignored", exc, key=key)
            fresh = str(time.time_ns())
            self._call(lambda: compare_set_bytes(store, key, bytes(raw), fresh.encode()))
            return -1

    def _bump_version(self) -> None:
        store = self._store
        try:
            self._call(lambda: store.add(self._key("version"), 1))
        except (_StoreSwitched, ValueError, *STORE_ERRORS) as exc:  # ValueError: the counter is not a number
            self._cached_version = None  # readers re-read the blob the next time anyway
            self._quiet.log("version_bump_failed", exc)

    def _read_recent(self) -> st.RendezvousState:
        """For monitor ticks: the state as of at most one heartbeat interval ago (the heartbeat thread reads
        the version every beat), so a tick every 0.1 s costs no store round trip."""
        fresh_for = time.monotonic() - self._version_at
        if self._cached_version is not None and fresh_for < self._settings.heartbeat_interval_s:
            return self._cached
        return self._read_cached()

    def _read_cached(self) -> st.RendezvousState:
        """The state, read again only when its version counter moved (or after a store switch)."""
        for _ in range(10):
            try:
                self._ensure_keys()  # again after a store switch: the new store starts without them
                version = self._version()
                self._version_at = time.monotonic()
                break
            except _StoreSwitched:
                continue
        else:
            raise RendezvousStoreLostError("the rendezvous store kept moving (10 failovers in a row)")
        if version != self._cached_version or self._cached_version is None:
            state = self._read()
            self._cached_version = version
            return state
        return self._cached

    def _read(self) -> st.RendezvousState:
        for _ in range(10):
            try:
                with self._lock:
                    got = self._call(lambda: trust.or_unreadable(self._backend.get_state))
                break
            except _StoreSwitched:
                continue
        else:
            raise RendezvousStoreLostError("the rendezvous store kept moving (10 failovers in a row)")
        state, _, ignored = self._decode(got)
        if ignored:
            state = self._update(lambda cur: None)  # write the stand-in back over what was ignored
        self._cached = state
        return state

    def _decode(
        self, got: tuple[bytes, Token] | trust.Unreadable | None
    ) -> tuple[st.RendezvousState, Token | None, bool]:
        """The state in ``got``, its token, and whether it was ignored: a forged or corrupt value, or a state that
        vanished from the store it was read from, is never acted on; the last good one stands in for it
        (:class:`trust.StandIn`, which raises while there is none)."""
        source = self._backend
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

    def _update(self, fn: Callable[[st.RendezvousState], st.RendezvousState | None]) -> st.RendezvousState:
        """Apply ``fn`` with compare-and-set until it sticks; return the state now stored."""
        for _ in range(10):
            try:
                return self._update_once(fn)
            except _StoreSwitched:
                continue
        raise RendezvousStoreLostError("the rendezvous store kept moving (10 failovers in a row)")

    def _update_once(self, fn: Callable[[st.RendezvousState], st.RendezvousState | None]) -> st.RendezvousState:
        backoff = _Backoff(0.001, 0.05)
        with self._lock:
            got = self._call(lambda: trust.or_unreadable(self._backend.get_state))
            for _ in range(1000):
                state, token, ignored = self._decode(got)
                new = fn(state)
                if new is None or new == state:
                    if not ignored:
                        self._cached = state
                        return state
                    new = state  # what stood in for an ignored value: written back over it
                payload = self._auth.seal_state(st.encode(new))
                result = self._call(
                    lambda p=payload, t=token: trust.or_unreadable(lambda: self._backend.set_state(p, t))  # type: ignore[misc]
                )
                if result is None:
                    got = self._call(lambda: trust.or_unreadable(self._backend.get_state))
                    continue
                if isinstance(result, trust.Unreadable):
                    got = result  # another unreadable value won the race
                    backoff.sleep()
                    continue
                data, new_token, ok = result
                if ok:
                    if ignored:
                        lifecycle(
                            "rendezvous_state_restored", level=logging.WARNING, node=self.node_id, round=new.round
                        )
                    self._cached = new
                    self._cached_version = None
                    self._standin.accepted(self._backend, new)  # what this node wrote is the newest good state
                    self._bump_version()
                    return new
                got = (data, new_token)
                backoff.sleep()  # lost a race: back off with jitter before the next try
        raise RendezvousStoreLostError("compare-and-set on the rendezvous state kept losing races (1000 tries)")

    def _bounded(self, op: Callable[[], _T]) -> _T:
        """Run one store call with a deadline (see ``store_op_timeout_s``).

        A call past its deadline is left blocked in its (daemon) thread and its client is marked wedged:
        later calls fail fast until a fresh connection to the same store answers (tried with a growing
        pause, 1 s up to 30 s), so a long network cut neither blocks the agent nor piles up threads.
        """
        if self._stores is None:
            return op()  # etcd: its client bounds every request and rides out outages (retry_timeout)
        if self._wedged is not None and self._wedged is self._store:
            self._reconnect()
        try:
            return _with_deadline(op, self._settings.store_op_timeout_s)
        except TimeoutError:
            self._wedged = self._store
            lifecycle("store_call_stuck", level=logging.WARNING, store=self._store_address,
                      waited_s=self._settings.store_op_timeout_s)  # fmt: skip
            raise

    def _reconnect(self) -> None:
        """Replace a wedged store client by a fresh connection, or fail fast (tries back off up to 30 s)."""
        now = time.monotonic()
        stores = self._stores
        if stores is None or now < self._next_reconnect:
            raise TimeoutError(f"the rendezvous store at {self._store_address} does not answer (client wedged)")
        self._reconnect_pause = min(30.0, max(1.0, 2 * self._reconnect_pause))
        self._next_reconnect = now + self._reconnect_pause
        wedged, address = self._store, self._store_address
        timeout, deadline = self._settings.store_lost_timeout_s, self._settings.store_op_timeout_s
        try:
            backend, store = _with_deadline(lambda: stores.connect_to(address, timeout), deadline)
        except STORE_ERRORS as exc:
            raise TimeoutError(f"the rendezvous store at {address} does not answer ({exc!r:.80})") from exc
        with self._lock:
            if self._store is wedged:
                self._backend, self._store, self._wedged = backend, store, None
                self._cached_version = None
                self._reconnect_pause = 0.0
        lifecycle("store_reconnected", store=address)

    def _call(self, op: Callable[[], _T]) -> _T:
        try:
            out = self._bounded(op)
        except STORE_ERRORS as exc:
            now = time.monotonic()
            # The main and heartbeat threads both get here: read the shared field once.
            since = self._store_failing_since
            if since is None:
                since = self._store_failing_since = now
            # A node that never joined a round has nothing at stake and knows no successor: it keeps looking
            # for the store the job's world publishes with its next fencing claim (a survivor that took the
            # store over claims when its round forms), as long as it would wait for a round; with none alive
            # for refound_after, every member is gone with it, and it starts the job over at the endpoint.
            newcomer = self._round < 0 and self.node_id not in self._cached.nodes
            refound = newcomer and now - since >= self._settings.refound_after_s
            if self._failover(exc) or (refound and self._refound(now - since)):
                self._store_failing_since = None
                raise _StoreSwitched() from exc
            limit = self._settings.join_timeout_s if newcomer else self._settings.store_lost_timeout_s
            if now - since >= limit:
                raise RendezvousStoreLostError(
                    f"the rendezvous store stopped answering for {now - since:.1f}s ({exc})"
                    + (f"; {self._on_store_lost}" if self._on_store_lost else "")
                ) from exc
            raise
        self._store_failing_since = None
        return out

    def _refound(self, silent_s: float) -> bool:
        """Start the job over at the endpoint's store (c10d; hosted here when this node may host it)."""
        if self._stores is None:
            return False
        try:
            self._backend, self._store, self._store_address, self._hosts_store = self._stores.refound()
        except RendezvousStoreLostError as exc:
            self._quiet.log("refound_failed", exc, node=self.node_id)
            return False
        address, hosts = self._store_address, self._hosts_store
        self._cached, self._cached_version = st.RendezvousState(), None
        lifecycle(
            "job_refounded",
            level=logging.WARNING,
            node=self.node_id,
            store=address,
            hosts=hosts,
            silent_s=round(silent_s, 1),
            why="no live store of this job: its published store is silent and this node never joined a round",
        )
        return True

    def _failover(self, exc: BaseException) -> bool:
        """Move the state store to the first reachable successor of its dead host (c10d only)."""
        cached = self._cached
        if self._stores is None or cached.store_host == self.node_id:
            return False
        if not cached.store_host and self.node_id in cached.nodes:
            return False  # a state without a host (never on c10d): no successor can be picked from it
        got = self._stores.failover(cached, self.node_id, exc, self._settings.store_lost_timeout_s)
        if got is None:
            return False
        self._backend, self._store, self._store_address, self._hosts_store = got
        self._cached_version = None
        lifecycle(
            "store_failover",
            level=logging.WARNING,
            old_host=cached.store_host,
            endpoint=self._store_address,
            cause=repr(exc)[:120],
        )
        return True

    # -- heartbeats ------------------------------------------------------------------------------
    def _start_heartbeat(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._heartbeat_loop, name="elastrain-heartbeat", daemon=True)
        self._thread.start()

    def _stop_heartbeat(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)

    def _heartbeat_loop(self) -> None:
        clock = self._clock
        clock.next_at = None
        while not self._stop.wait(clock.wait_s(time.monotonic())):
            now = time.monotonic()
            stalled = clock.woke(now)
            try:
                self._heartbeat_once(now, stalled)
            except RendezvousStoreLostError as exc:
                self.fatal_error = exc
                lifecycle("rendezvous_store_lost", level=logging.ERROR, error=str(exc))
                return
            except (RendezvousError, _StoreSwitched, OSError, *STORE_ERRORS) as exc:
                # Transient: _call tracks how long the store has been failing and gives up in time.
                self._quiet.log("heartbeat_failed", exc, node=self.node_id)
            except Exception as exc:  # a bug must not silently stop this node's heartbeat
                lifecycle("heartbeat_error", level=logging.ERROR, node=self.node_id, error=repr(exc)[:300])
            clock.done(time.monotonic())

    def _heartbeat_once(self, now: float, stalled: bool) -> None:
        """Beat (one small key of our own), then judge the peers this node watches.

        Liveness costs every node O(1) store work per beat whatever N is: it writes its own counter
        and reads one other (the judge's). One node, the *judge* (:func:`state.judge`: the first live
        member, else the first joiner), reads every counter in one ``multi_get`` and evicts the silent;
        everyone else watches only the judge and evicts it when it goes silent, after which the next
        node judges. Suspects are probed together; a refused probe evicts at once.
        """
        s = self._settings
        clock = self._clock
        self._beats += 1
        self._ensure_keys()
        key = self._key(f"beat/{self.node_id}")
        store, beat = self._store, self._auth.seal(key, str(self._beats))
        self._call(lambda: set_bytes(store, key, beat))
        state = self._read_cached()
        read_at = time.monotonic()
        stalled = clock.store_took(now, read_at) or stalled
        if self.node_id not in state.heartbeats:
            return  # not part of the job (evicted or not joined): never judge the others
        judge = st.judge(state)
        judging = judge == self.node_id
        watching_all = read_at < self._failure_watch_until
        if judging or watching_all:
            watched = [n for n in state.heartbeats if n != self.node_id]
        else:
            watched = [judge] if judge is not None else []
        counters = self._read_beats(watched)
        if watching_all:
            for n, c in counters.items():
                if self._watch_first.setdefault(n, c) != c:
                    self._watch_moved.add(n)
        if judging and self._judged_last != self.node_id:
            # Taking over as judge: start from the previous judge's evidence, so that many nodes vanishing
            # together (the judge among them) cost one heartbeat timeout, not one per node.
            self._obs = st.seeded(self._obs, counters, read_at, self._read_silence())
        self._judged_last = judge
        self._obs = st.observe(self._obs, counters, read_at, stalled)
        dead = st.dead_nodes(self._obs, read_at, s.heartbeat_timeout_s, exclude=self.node_id)
        # Probe only suspects (a counter that did not move for ``suspect_after`` intervals: 0.9 catches a killed
        # node at the judge's first read after its last beat, one interval sooner than 1.5 did, for a few more
        # probes of late but live nodes, which answer), all at once with one deadline: a refused
        # probe proves death at once. After a worker failure, probe every peer once.
        probe_all, self._probe_all = self._probe_all, False
        candidates = [n for n in state.heartbeats if n != self.node_id] if probe_all else watched
        suspects = {
            n: (state.nodes[n].addr, state.nodes[n].probe_port)
            for n in candidates
            if n in state.nodes
            and n not in dead
            and (
                probe_all
                or read_at - self._obs.seen.get(n, (0, read_at))[1] >= s.suspect_after * s.heartbeat_interval_s
            )
        }
        gone = liveness.refused(suspects, timeout_s=min(0.5, s.heartbeat_interval_s * 2)) if suspects else set()
        others = [m for m in st.live_members(state) if m != self.node_id]
        if (
            judging
            and others
            and all(m in dead for m in others)
            and not gone
            and clock.stalled_within(read_at, 3 * s.heartbeat_timeout_s)
            and not self._fence_root
        ):
            # We were frozen and now every peer looks silent: the job moved on without us (perhaps to a
            # new store). Without a fence, evicting them all would start a second world: leave instead.
            # With one, evicting is safe: our next round must win the next generation's claim, and if
            # the others claimed it first we follow them to their store and join there as a newcomer.
            raise RendezvousStoreLostError(
                f"node {self.node_id} was frozen and lost contact with every peer; it leaves the job "
                "(the others went on without it)"
            )
        if judging:
            self._publish_silence(st.silence(self._obs, read_at))
        silent = set(dead)
        if not (silent or gone):
            return

        evicted: list[tuple[str, st.Departure]] = []

        def _evict(cur: st.RendezvousState) -> st.RendezvousState:
            evicted[:] = [(d, st.Departure.DEAD) for d in sorted(gone) if d in cur.heartbeats]
            evicted.extend((d, st.Departure.SILENT) for d in sorted(silent - gone) if d in cur.heartbeats)
            out = cur
            for d, how in evicted:
                out = st.remove(out, [d], how.value)
            return out

        after = self._update(_evict)
        for d, how in evicted:
            if d not in after.heartbeats:
                lifecycle(
                    "node_dead",
                    level=logging.WARNING,
                    node=d,
                    how="probe_refused" if how is st.Departure.DEAD else "heartbeat_timeout",
                    silent_s=round(read_at - self._obs.seen[d][1], 3) if d in self._obs.seen else None,
                    round=after.round,
                    member=d in after.members,
                    by=self.node_id,
                )

    def _publish_silence(self, silent_for: dict[str, float]) -> None:
        key = self._key("silence")
        store, payload = self._store, self._auth.seal(key, json.dumps(silent_for, separators=(",", ":")))
        self._call(lambda: set_bytes(store, key, payload))

    def _read_silence(self) -> dict[str, float]:
        """The previous judge's last snapshot of how long each node had been silent ({} if none)."""
        store, key = self._store, self._key("silence")
        try:
            if not self._call(lambda: store.check([key])):
                return {}
            raw = json.loads(self._auth.open(key, self._call(lambda: store.get(key))))
            return {str(k): float(v) for k, v in raw.items()}
        except (ValueError, AttributeError, TypeError, RendezvousStateCorruptError) as exc:
            lifecycle("silence_snapshot_unreadable", level=logging.WARNING, error=repr(exc)[:120])
            return {}

    def _read_beats(self, nodes: list[str]) -> dict[str, int]:
        """The heartbeat counters of ``nodes`` in one request; a key that is missing reads as -1 (silent)."""
        if not nodes:
            return {}
        store = self._store
        keys = [self._key(f"beat/{n}") for n in nodes]
        if self._call(lambda: store.check(keys)):
            values = self._call(lambda: store.multi_get(keys))
            return {n: self._beat(n, k, v) for n, k, v in zip(nodes, keys, values, strict=True)}
        # Some node has not beaten on this store yet (just joined, or a store failover): read one by one.
        out: dict[str, int] = {}
        for n, k in zip(nodes, keys, strict=True):
            present = self._call(lambda k=k: store.check([k]))  # type: ignore[misc]
            out[n] = self._beat(n, k, self._call(lambda k=k: store.get(k))) if present else -1  # type: ignore[misc]
        return out

    def _beat(self, node: str, key: str, raw: bytes) -> int:
        """A heartbeat counter as read; a forged or corrupt one counts as no move (its last value seen)."""
        try:
            return int(self._auth.open(key, raw))
        except (ValueError, RendezvousStateCorruptError) as exc:
            self._quiet.log("rendezvous_value_ignored", exc, key=key)
            return self._obs.seen.get(node, (-1, 0.0))[0]

    def _opened_rejoins(self, nodes: list[str], keys: list[str], raw: list[bytes]) -> dict[str, st.NodeInfo]:
        """The re-join keys of ``nodes`` that this node accepts (a forged or corrupt one is ignored)."""
        out: dict[str, st.NodeInfo] = {}
        for n, k, v in zip(nodes, keys, raw, strict=True):
            try:
                out[n] = st.decode_info(self._auth.open(k, bytes(v)))
            except RendezvousStateCorruptError as exc:
                self._quiet.log("rendezvous_value_ignored", exc, key=k)
        return out

    # -- trust: what the store may make this node do (see elastrain.rendezvous.trust) ---------------------
    def _names_member(self, address: str) -> bool:
        """Whether ``address`` is on a host of the job: known to this node, or vouched for by the store there."""
        if self._job_hosts.names_member(address):
            return True
        if self._stores is None:
            return False
        hosts = self._stores.vouches(address, self._settings.store_lost_timeout_s)
        self._job_hosts.add(hosts)
        return bool(hosts)

    def _claim_trusted(self, claim: fence.Claim) -> bool:
        """A fencing claim's store is followed only if the job's secret signs it, or (without a secret) it names a
        member of the job."""
        ok = (
            self._auth.signed_store(claim.store, claim.store_mac)
            if self._auth.enabled
            else self._names_member(claim.store)
        )
        if not ok:
            why = "not signed with the job's secret" if self._auth.enabled else "it names no node of the job"
            lifecycle("fence_claim_untrusted", level=logging.WARNING, store=claim.store, generation=claim.generation,
                      why=why)  # fmt: skip
        return ok


def create_handler(
    backend: RendezvousBackend, store: Store, params: RendezvousParameters, on_store_lost: str = ""
) -> RendezvousHandler:
    """torch's handler-creator shape: elastrain's handler over ``backend`` (state) and ``store`` (per-round data)."""
    return ElastrainRendezvousHandler(backend, store, params, on_store_lost=on_store_lost)
