"""Liveness: this node's beat, the judge that evicts the silent, and the watch after a worker failure.

Heartbeats run in a thread from the first join until shutdown (independent of rounds, so a node never evicts
itself). Liveness costs every node O(1) store work per beat whatever N is: it writes its own counter and reads
one other (the judge's). One node, the *judge* (:func:`state.judge`: the first live member, else the first
joiner), reads every counter in one ``multi_get`` and evicts the silent; everyone else watches only the judge
and evicts it when it goes silent, after which the next node judges. Suspects are probed together
(:mod:`elastrain.rendezvous.liveness`); a refused probe evicts at once.
"""

from __future__ import annotations

import json
import logging
import threading
import time

from torch.distributed.elastic.rendezvous import RendezvousClosedError

from elastrain.errors import RendezvousError, RendezvousStateCorruptError, RendezvousStoreLostError
from elastrain.log import lifecycle
from elastrain.rendezvous import liveness
from elastrain.rendezvous import state as st
from elastrain.rendezvous.auth import RendezvousAuth, set_bytes
from elastrain.rendezvous.connection import STORE_ERRORS, StoreSwitched
from elastrain.rendezvous.death_watch import DeathWatch
from elastrain.rendezvous.pacing import Throttled
from elastrain.rendezvous.settings import HandlerSettings
from elastrain.rendezvous.store import StateStore


class FailureWatch:
    """After this node's workers fail: until when it watches every member's heartbeat, the counters it first read
    in that window, and the members whose counter moved since (alive, so no excuse)."""

    def __init__(self, node_id: str) -> None:
        self._node_id = node_id
        self._until = 0.0
        self._first: dict[str, int] = {}
        self._moved: set[str] = set()

    def start(self, until: float) -> None:
        self._first, self._moved = {}, set()
        self._until = until

    def active(self, now: float) -> bool:
        return now < self._until

    def saw(self, counters: dict[str, int]) -> None:
        for n, c in counters.items():
            if self._first.setdefault(n, c) != c:
                self._moved.add(n)

    def unseen(self, state: st.RendezvousState, round_: int) -> bool:
        """Whether, within the watch, a live member of ``round_`` has not beaten since it began."""
        if time.monotonic() >= self._until:
            return False
        if state.round != round_:
            return False  # the round is over: membership_change says so
        return any(m != self._node_id and m not in self._moved for m in st.live_members(state))


class Heartbeat:
    """This node's heartbeat thread, its judgement of the others, and its watch after a worker failure."""

    def __init__(
        self,
        node_id: str,
        settings: HandlerSettings,
        state: StateStore,
        auth: RendezvousAuth,
        quiet: Throttled,
        fenced: bool,
    ) -> None:
        self.fatal_error: Exception | None = None
        """Set by the heartbeat thread when the state store is gone; the agent raises it."""
        self._node_id = node_id
        self._settings = settings
        self._state = state
        self._auth = auth
        self._quiet = quiet
        self._fenced = fenced
        self._clock = liveness.TickClock(settings.heartbeat_interval_s, settings.stall_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._life = threading.Lock()
        """Held while the thread is started or stopped (the agent's and the rendezvous's threads both do)."""
        self._obs = st.Observations()
        self._probe_all = False
        self._judged_last: str | None = None
        self._watch = FailureWatch(node_id)
        self._pulse = liveness.Pulse(settings.heartbeat_interval_s, settings.heartbeat_timeout_s)
        self._wake = threading.Event()
        """Beat now: a watched peer's connection closed (:mod:`~elastrain.rendezvous.death_watch`), a worker
        failed, or the thread stops."""
        self._deaths = DeathWatch(self._wake, rearm_s=settings.heartbeat_interval_s)

    def silent_since(self, since: float) -> bool:
        """Whether this node was frozen (or starved) for a heartbeat timeout after ``since`` (monotonic), while it
        beat: its peers may have judged it dead and gone on without it."""
        return self._pulse.silent_since(since, time.monotonic())

    def start(self) -> None:
        self._pulse.start()
        with self._life:  # a stop on another thread sees no thread that is not started yet
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop.clear()
            self._wake.clear()
            thread = threading.Thread(target=self._loop, name="elastrain-heartbeat", daemon=True)
            thread.start()
            self._thread = thread

    def stop(self) -> None:
        with self._life:
            self._stop.set()
            self._wake.set()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2)
            if thread.is_alive():  # inside a store call that has not answered: it ends with that call
                lifecycle("heartbeat_stop_pending", level=logging.WARNING, node=self._node_id, waited_s=2)
        self._pulse.stop()
        self._deaths.close()

    def forget(self) -> None:
        """This node moved to another world's store: what it observed of this one's nodes no longer counts."""
        self._obs = st.Observations()

    def probe_peers(self) -> None:
        """Probe every peer now."""
        self._probe_all = True
        self._wake.set()

    def report_failure(self, round_: int, echo: bool, watch_s: float) -> None:
        """This node's workers failed in ``round_``: record it in the round (``echo``: they said a collective broke
        under them; see :func:`state.report_failure`), probe every peer at the next tick, and watch every
        member's heartbeat for ``watch_s``."""
        self._probe_all = True
        if round_ < 0:
            return
        self._watch.start(time.monotonic() + watch_s)
        try:
            after = self._state.update(lambda cur: st.report_failure(cur, self._node_id, round_, echo))
        except (RendezvousError, *STORE_ERRORS) as exc:
            self._quiet.log("failure_report_failed", exc, node=self._node_id)
            return
        if after.round == round_ and self._node_id in after.failed:
            lifecycle(
                "workers_failed",
                level=logging.WARNING,
                node=self._node_id,
                round=round_,
                order=after.failed.index(self._node_id) + 1,
                first=after.failed[0],
                echo=echo,
            )

    def peers_unseen(self, state: st.RendezvousState, round_: int) -> bool:
        """Whether, within the watch after a worker failure, a live member of ``round_`` has not beaten since."""
        return self._watch.unseen(state, round_)

    def _loop(self) -> None:
        clock = self._clock
        clock.next_at = None
        while True:
            self._wake.wait(clock.wait_s(time.monotonic()))
            self._wake.clear()
            if self._stop.is_set():
                return
            now = time.monotonic()
            stalled = clock.woke(now)
            try:
                self._once(now, stalled)
            except RendezvousStoreLostError as exc:
                self.fatal_error = exc
                lifecycle("rendezvous_store_lost", level=logging.ERROR, error=str(exc))
                return
            except RendezvousClosedError as exc:  # the job finished before this node joined a round
                lifecycle("heartbeat_stopped", node=self._node_id, why=str(exc))
                return
            except (RendezvousError, StoreSwitched, OSError, *STORE_ERRORS) as exc:
                # Transient: the connection tracks how long the store has been failing and gives up in time.
                self._quiet.log("heartbeat_failed", exc, node=self._node_id)
            except Exception as exc:  # a bug must not silently stop this node's heartbeat
                lifecycle("heartbeat_error", level=logging.ERROR, node=self._node_id, error=repr(exc)[:300])
            clock.done(time.monotonic())

    def _once(self, now: float, stalled: bool) -> None:
        """Beat (one small key of our own), then judge the peers this node watches (see the module doc)."""
        s = self._settings
        clock = self._clock
        me = self._node_id
        self._state.beats += 1
        self._state.ensure_keys()
        key = self._state.key(f"beat/{me}")
        store, beat = self._state.store, self._auth.seal(key, str(self._state.beats))
        self._state.call(lambda: set_bytes(store, key, beat), store)
        state = self._state.read_cached()
        read_at = time.monotonic()
        stalled = clock.store_took(now, read_at) or stalled
        if me not in state.heartbeats:
            return  # not part of the job (evicted or not joined): never judge the others
        judge = st.judge(state)
        judging = judge == me
        watching_all = self._watch.active(read_at)
        if judging or watching_all:
            watched = [n for n in state.heartbeats if n != me]
        else:
            watched = [judge] if judge is not None else []
        counters = self.read_beats(watched)
        if watching_all:
            self._watch.saw(counters)
        if judging and self._judged_last != me:
            # Taking over as judge: start from the previous judge's evidence, so that many nodes vanishing
            # together (the judge among them) cost one heartbeat timeout, not one per node.
            self._obs = st.seeded(self._obs, counters, read_at, self._read_silence())
        self._judged_last = judge
        self._obs = st.observe(self._obs, counters, read_at, stalled)
        dead = st.dead_nodes(self._obs, read_at, s.heartbeat_timeout_s, exclude=me)
        # Probe only suspects (a counter that did not move for ``suspect_after`` intervals: 0.9 catches a killed
        # node at the judge's first read after its last beat, one interval sooner than 1.5 did, for a few more
        # probes of late but live nodes, which answer), all at once with one deadline: a refused
        # probe proves death at once. After a worker failure, probe every peer once.
        probe_all, self._probe_all = self._probe_all, False
        closed = self._deaths.closed()  # a peer whose connection closed is probed now
        candidates = [n for n in state.heartbeats if n != me] if probe_all else watched
        suspects = {
            n: (state.nodes[n].addr, state.nodes[n].probe_port)
            for n in candidates
            if n in state.nodes
            and n not in dead
            and (
                probe_all
                or n in closed
                or read_at - self._obs.seen.get(n, (0, read_at))[1] >= s.suspect_after * s.heartbeat_interval_s
            )
        }
        self._deaths.follow(_death_targets(state, me, watched))
        gone = liveness.refused(suspects, timeout_s=min(0.5, s.heartbeat_interval_s * 2)) if suspects else set()
        others = [m for m in st.live_members(state) if m != me]
        if (
            judging
            and others
            and all(m in dead for m in others)
            and not gone
            and clock.stalled_within(read_at, 3 * s.heartbeat_timeout_s)
            and not self._fenced
        ):
            # We were frozen and now every peer looks silent: the job moved on without us (perhaps to a
            # new store). Without a fence, evicting them all would start a second world: leave instead.
            # With one, evicting is safe: our next round must win the next generation's claim, and if
            # the others claimed it first we follow them to their store and join there as a newcomer.
            raise RendezvousStoreLostError(
                f"node {me} was frozen and lost contact with every peer; it leaves the job "
                "(the others went on without it)"
            )
        if judging:
            self._publish_silence(st.silence(self._obs, read_at))
        silent = set(dead)
        if silent or gone:
            _evict(self._state, self._obs, me, silent, gone, read_at)

    def _publish_silence(self, silent_for: dict[str, float]) -> None:
        key = self._state.key("silence")
        store, payload = self._state.store, self._auth.seal(key, json.dumps(silent_for, separators=(",", ":")))
        self._state.call(lambda: set_bytes(store, key, payload), store)

    def _read_silence(self) -> dict[str, float]:
        """The previous judge's last snapshot of how long each node had been silent ({} if none)."""
        store, key = self._state.store, self._state.key("silence")
        try:
            if not self._state.call(lambda: store.check([key]), store):
                return {}
            raw = json.loads(self._auth.open(key, self._state.call(lambda: store.get(key), store)))
            return {str(k): float(v) for k, v in raw.items()}
        except (ValueError, AttributeError, TypeError, RendezvousStateCorruptError) as exc:
            lifecycle("silence_snapshot_unreadable", level=logging.WARNING, error=repr(exc)[:120])
            return {}

    def read_beats(self, nodes: list[str]) -> dict[str, int]:
        """The heartbeat counters of ``nodes`` in one request; a key that is missing reads as -1 (silent)."""
        if not nodes:
            return {}
        store = self._state.store
        keys = [self._state.key(f"beat/{n}") for n in nodes]
        if self._state.call(lambda: store.check(keys), store):
            values = self._state.call(lambda: store.multi_get(keys), store)
            return {n: self._beat(n, k, v) for n, k, v in zip(nodes, keys, values, strict=True)}
        # Some node has not beaten on this store yet (just joined, or a store failover): read one by one.
        out: dict[str, int] = {}
        for n, k in zip(nodes, keys, strict=True):
            present = self._state.call(lambda k=k: store.check([k]), store)  # type: ignore[misc]
            out[n] = self._beat(n, k, self._state.call(lambda k=k: store.get(k), store)) if present else -1  # type: ignore[misc]
        return out

    def _beat(self, node: str, key: str, raw: bytes) -> int:
        """A heartbeat counter as read; a forged or corrupt one counts as no move (its last value seen)."""
        try:
            return int(self._auth.open(key, raw))
        except (ValueError, RendezvousStateCorruptError) as exc:
            self._quiet.log("rendezvous_value_ignored", exc, key=key)
            return self._obs.seen.get(node, (-1, 0.0))[0]


def _evict(state: StateStore, obs: st.Observations, me: str, silent: set[str], gone: set[str], read_at: float) -> None:
    """Remove the dead (``gone``: their probe refused) and the silent from the state, each logged."""
    evicted: list[tuple[str, st.Departure]] = []

    def _remove(cur: st.RendezvousState) -> st.RendezvousState:
        evicted[:] = [(d, st.Departure.DEAD) for d in sorted(gone) if d in cur.heartbeats]
        evicted.extend((d, st.Departure.SILENT) for d in sorted(silent - gone) if d in cur.heartbeats)
        out = cur
        for d, how in evicted:
            out = st.remove(out, [d], how.value)
        return out

    after = state.update(_remove)
    for d, how in evicted:
        if d not in after.heartbeats:
            lifecycle(
                "node_dead",
                level=logging.WARNING,
                node=d,
                how="probe_refused" if how is st.Departure.DEAD else "heartbeat_timeout",
                silent_s=round(read_at - obs.seen[d][1], 3) if d in obs.seen else None,
                round=after.round,
                member=d in after.members,
                by=me,
            )


def _death_targets(state: st.RendezvousState, me: str, watched: list[str]) -> dict[str, tuple[str, int]]:
    """The peers whose death this node learns at once: those it watches, and its store's host."""
    names = {*watched, state.store_host} - {me, ""}
    return {n: (state.nodes[n].addr, state.nodes[n].probe_port) for n in names if n in state.nodes}


def linger_until_seen(
    heartbeat: Heartbeat, state: StateStore, node_id: str, settings: HandlerSettings, quiet: Throttled
) -> None:
    """The store dies with this process: keep it up (bounded) until every peer has read the state since our
    leave or the job's end, so that each learns why (a setting error, a notice, the job is over) instead of
    a silent store loss (which a joiner would answer by hosting a store of its own).
    A peer reads the state right after each beat, so one beat past our first look is enough."""
    s = settings
    deadline = time.monotonic() + 4 * s.heartbeat_interval_s + 0.5
    started = time.monotonic()
    try:
        peers = [n for n in state.read_cached().heartbeats if n != node_id]
        first = heartbeat.read_beats(peers)
        while peers and time.monotonic() < deadline:
            now = heartbeat.read_beats(peers)
            peers = [n for n in peers if now[n] <= first[n]]
            if peers:
                time.sleep(s.heartbeat_interval_s / 4)
    except (RendezvousError, StoreSwitched, *STORE_ERRORS) as exc:
        quiet.log("store_linger_failed", exc, node=node_id)
        return
    lifecycle("store_host_lingered", waited_s=round(time.monotonic() - started, 3), unseen=len(peers))
