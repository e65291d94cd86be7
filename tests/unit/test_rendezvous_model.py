"""The rendezvous state machine under random interleavings (hypothesis stateful testing).

A model of N nodes drives the pure functions of :mod:`elastrain.rendezvous.state` the way the handler
does: nodes start, leave, die, freeze and thaw, and their workers fail (the node then restarts them
or leaves, as after its own failure, unless the round shows that another member failed first); live
nodes tick (re-join when their round is over, complete a round when they can) and evict dead or frozen
peers. A live member re-joins through its own key once the state shows the round is over
(:func:`state.rejoins_by_key`); only the round's judge, or the re-joiner whose count says it was the
last, folds the keys in and completes the round (:func:`state.fold`), as the handler does. After every
step the invariants hold:

* a full round (``max_nodes`` live members, nothing departed) never restarts for spares;
* every event leads to at most one new round (between two quiet points, no more rounds than events);
* no node evicts itself;
* a node leaves for a worker failure only if it reported the round's first one (the others' are echoes);
* a node re-joins through its key only when every other member running the round already sees a
  reason to stop (so no re-join is missed by a member that reads only the state);
* once the nodes settle, every live node is a member of the current round or a spare, and every
  member runs that round.
"""

from __future__ import annotations

from dataclasses import dataclass

import hypothesis.strategies as hs
from hypothesis import event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from elastrain.rendezvous import state as st

INFO = st.NodeInfo("10.0.0.1", 1, 2, 3)
MAX_NODES = 10
EXCUSES = {st.ChangeKind.DEPARTED, st.ChangeKind.EVICTED, st.ChangeKind.SUPERSEDED, st.ChangeKind.FENCED}


@dataclass
class Node:
    ident: str = ""  # a new identity per start, as the handler's node id (host, pid, random suffix)
    status: str = "down"  # down | joining | running
    my_round: int = -1
    target: int = 0
    dead: bool = False
    frozen: bool = False
    verdict: str = ""  # after its workers failed: "restart" or "leave", unless the round is over anyway
    keyed: int | None = None  # the round whose end it asked for through its key (None: through the state)


class RendezvousModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.s = st.RendezvousState()
        self.nodes: dict[str, Node] = {}
        self.max_nodes = 2
        self.events = 0
        self.rounds = 0
        self.starts = 0
        self.keys: dict[int, dict[str, st.NodeInfo]] = {}  # round -> node -> info: the re-join keys
        self.counts: dict[int, int] = {}  # round -> the re-join counter (every key write adds one)

    @initialize(n=hs.integers(2, MAX_NODES), max_nodes=hs.integers(1, 6))
    def setup(self, n: int, max_nodes: int) -> None:
        self.nodes = {f"n{i}": Node() for i in range(n)}
        self.max_nodes = max_nodes

    # -- helpers ------------------------------------------------------------------------------
    def _event(self) -> None:
        self.events += 1

    def _set(self, new: st.RendezvousState) -> None:
        self.rounds += new.round - self.s.round
        self.s = new

    def _acting(self) -> list[str]:
        """Slots whose node runs and acts (not down, dead or frozen)."""
        return [k for k, v in self.nodes.items() if v.status != "down" and not v.dead and not v.frozen]

    def _slot_of(self, ident: str) -> str | None:
        return next((k for k, v in self.nodes.items() if v.ident == ident and v.status != "down"), None)

    def _rejoin(self, slot: str, lagging: bool = False) -> None:
        """Ask for the next round as the handler does: through a key when allowed, else through the state.
        ``lagging``: the node stalls right after its key write, so its own fold attempt comes too late."""
        node = self.nodes[slot]
        me, s = node.ident, self.s
        node.status, node.target = "joining", s.round + 1
        if not st.rejoins_by_key(s, me):
            node.keyed = None
            self._set(st.join(s, me, INFO))
            node.target = self.s.round + 1
            return
        for other in self.nodes.values():
            if other.ident == me or other.status != "running" or other.my_round != s.round:
                continue
            if other.ident not in st.live_members(s):
                continue
            change = st.change_for(s, other.ident, other.my_round, self.max_nodes)
            own_failure = s.failed[:1] == (other.ident,) and bool(other.verdict)
            assert change is not None or own_failure, f"{me} re-joined by key unseen by {other.ident}: {s}"
        event("a member re-joined through its key")
        node.keyed = s.round
        self.keys.setdefault(s.round, {})[me] = INFO
        self.counts[s.round] = self.counts.get(s.round, 0) + 1
        last = self.counts[s.round] >= len(st.unfolded(s))
        if not lagging:
            self._complete(me, fold=last)

    def _complete(self, me: str, fold: bool) -> None:
        """Complete the round if the state allows it, or (the judge, or a re-joiner that counted itself
        last) if the state with the re-join keys folded in does."""
        s = self.s
        if st.can_complete(s, 1, self.max_nodes, ready_for_s=1e9, last_call_s=1.0):
            self._set(st.complete(s, self.max_nodes))
            return
        if not (fold or st.judge(s) == me) or not st.round_over(s):
            return
        folded = st.fold(s, s.round, self.keys.get(s.round, {}))
        if st.can_complete(folded, 1, self.max_nodes, ready_for_s=1e9, last_call_s=1.0):
            event("a round completed from folded keys" + (" by the last re-joiner" if fold else " by the judge"))
            self._set(st.complete(folded, self.max_nodes))

    def _tick(self, slot: str, lagging: bool = False) -> None:
        node = self.nodes[slot]
        me = node.ident
        s = self.s
        if node.status == "running":
            verdict, node.verdict = node.verdict, ""
            change = st.change_for(s, me, node.my_round, self.max_nodes)
            if verdict and s.failed[:1] == (me,) and change is not None:
                # The cause of a failure is excused only by a departure or a round it is no longer part of.
                assert change.kind in EXCUSES, f"{me}'s own failure was excused by {change}: {s}"
            if change is not None or verdict == "restart":
                self._rejoin(slot, lagging)
            elif verdict == "leave":  # its own failure, past --max-restarts
                # Only the cause leaves: a node whose failure echoed an earlier one re-forms instead.
                assert s.failed[:1] == (me,), f"{me} left for a failure that was not its own: {s}"
                self._set(st.remove(s, [me], f"{st.Departure.FAILED.value}:workers"))
                self.nodes[slot] = Node()
            return
        if node.status != "joining":
            return
        if me in s.members and s.round >= node.target:
            node.status, node.my_round, node.keyed = "running", s.round, None
            return
        keyed = node.keyed == s.round and me in st.live_members(s) and me not in s.joining
        if not keyed and me not in s.joining:
            self._rejoin(slot, lagging)  # evicted while waiting, or its key was for a round that ended without it
            return
        node.target = s.round + 1
        # The last call counts as over: the model checks rounds, not timing.
        self._complete(me, fold=False)

    # -- events ---------------------------------------------------------------------------------
    @rule(i=hs.integers(0, MAX_NODES - 1))
    def start(self, i: int) -> None:
        name = f"n{i}"
        node = self.nodes.get(name)
        if node is None or node.status != "down":
            return
        self._event()
        self.starts += 1
        self.nodes[name] = Node(ident=f"{name}.{self.starts}", status="joining", target=self.s.round + 1)
        self._set(st.join(self.s, self.nodes[name].ident, INFO))

    @rule(i=hs.integers(0, MAX_NODES - 1))
    def leave(self, i: int) -> None:
        name = f"n{i}"
        node = self.nodes.get(name)
        if node is None or node.status == "down" or node.dead or node.frozen:
            return
        self._event()
        self._set(st.remove(self.s, [node.ident], "left:SIGTERM"))
        self.nodes[name] = Node()

    @rule(i=hs.integers(0, MAX_NODES - 1), leaves=hs.booleans(), echoed=hs.booleans(), echo_first=hs.booleans())
    def fail(self, i: int, leaves: bool, echoed: bool, echo_first: bool) -> None:
        """A node's workers fail; ``echoed``: every running peer's workers fail with them (their collective
        broke) and report it as an echo, each ready to count it as its own unless the round says otherwise;
        ``echo_first``: the echoes' agents report before the cause's (a loaded machine)."""
        name = f"n{i}"
        node = self.nodes.get(name)
        if node is None or node.status != "running" or name not in self._acting() or node.verdict:
            return  # not running, or its workers failed already in this round (its own, or an echo)
        self._event()
        peers = [k for k in self._acting() if k != name and self.nodes[k].status == "running"] if echoed else []
        order = [*peers, name] if echo_first else [name, *peers]
        for slot in order:
            n = self.nodes[slot]
            reported = st.report_failure(self.s, n.ident, n.my_round, echo=slot != name)
            if reported is not None:
                self._set(reported)
            n.verdict = "leave" if leaves else "restart"
        if node.ident in self.s.failed:  # a cause goes before every echo, however late its agent reported
            own = [f for f in self.s.failed if f not in self.s.echoes]
            assert node.ident in own and self.s.failed[: len(own)] == tuple(own), (self.s.failed, self.s.echoes)

    @rule(i=hs.integers(0, MAX_NODES - 1))
    def die(self, i: int) -> None:
        node = self.nodes.get(f"n{i}")
        if node is None or node.status == "down" or node.dead:
            return
        self._event()
        node.dead = True

    @rule(i=hs.integers(0, MAX_NODES - 1))
    def freeze(self, i: int) -> None:
        node = self.nodes.get(f"n{i}")
        if node is None or node.status == "down" or node.dead or node.frozen:
            return
        self._event()
        node.frozen = True

    @rule(i=hs.integers(0, MAX_NODES - 1))
    def thaw(self, i: int) -> None:
        node = self.nodes.get(f"n{i}")
        if node is None or not node.frozen:
            return
        self._event()
        node.frozen = False

    @rule(observer=hs.integers(0, MAX_NODES - 1), victim=hs.integers(0, MAX_NODES - 1))
    def evict(self, observer: int, victim: int) -> None:
        o, v = f"n{observer}", f"n{victim}"
        if o not in self._acting() or v not in self.nodes:
            return
        on, vn = self.nodes[o], self.nodes[v]
        if on.ident not in self.s.heartbeats or vn.ident not in self.s.heartbeats:
            return
        if not (vn.dead or vn.frozen):
            return  # only the silent are evicted
        assert on.ident != vn.ident, "a node evicted itself"
        how = st.Departure.DEAD if vn.dead else st.Departure.SILENT
        self._set(st.remove(self.s, [vn.ident], how.value))
        if vn.dead:
            self.nodes[v] = Node()  # its process is gone; the slot may start a new node later

    @rule(i=hs.integers(0, MAX_NODES - 1), lagging=hs.booleans())
    def tick(self, i: int, lagging: bool) -> None:
        name = f"n{i}"
        if name in self._acting():
            self._tick(name, lagging)

    @precondition(lambda self: bool(self.nodes))
    @rule(lagging=hs.booleans())
    def settle(self, lagging: bool) -> None:
        """Let every live node act until nothing changes; check where everyone ended up. ``lagging``: in the
        first pass every re-joiner stalls after its key write (only the judge can then fold the keys)."""
        for attempt in range(20):
            before = (self.s, {k: (v.status, v.my_round) for k, v in self.nodes.items()})
            # Evict everything dead or frozen (its peers' heartbeat timeouts), then let the others act.
            observers = [o for o in self._acting() if self.nodes[o].ident in self.s.heartbeats]
            for v, node in list(self.nodes.items()):
                if (node.dead or node.frozen) and node.ident in self.s.heartbeats and observers:
                    self.evict(int(observers[0][1:]), int(v[1:]))
            for slot in self._acting():
                self._tick(slot, lagging and attempt == 0)
            if before == (self.s, {k: (v.status, v.my_round) for k, v in self.nodes.items()}):
                break
        else:
            raise AssertionError(f"the nodes never settled: {self.s}")
        assert self.rounds <= self.events, f"{self.rounds} rounds for {self.events} events: {self.s}"
        # A death or freeze nobody could act on yet (no live observer) is still to come: it carries over.
        self.rounds = 0
        self.events = sum(
            1
            for v in self.nodes.values()
            if (v.dead or v.frozen) and (v.ident in self.s.heartbeats or v.ident in self.s.joining)
        )
        members = set(st.live_members(self.s))
        for slot in self._acting():
            node = self.nodes[slot]
            if node.ident in members:
                assert node.status == "running" and node.my_round == self.s.round, (slot, node, self.s)
            else:
                assert node.ident in self.s.joining, (slot, node, self.s)
                assert len(members) >= self.max_nodes, f"{slot} waits although the round has room: {self.s}"

    # -- invariants -----------------------------------------------------------------------------
    @invariant()
    def full_round_never_restarts_for_spares(self) -> None:
        s = self.s
        live = st.live_members(s)
        if s.round < 0 or s.departed or s.failed or len(live) < self.max_nodes:
            return
        if any(m in s.joining for m in live):
            return  # a member re-joined: a new round is under way for another reason
        for m in live:
            slot = self._slot_of(m)
            node = self.nodes[slot] if slot else None
            if node is not None and node.status == "running" and node.my_round == s.round:
                assert st.change_for(s, m, s.round, self.max_nodes) is None, (m, s)
        assert st.nodes_waiting(s, self.max_nodes) == 0

    @invariant()
    def no_more_rounds_than_events(self) -> None:
        assert self.rounds <= self.events, f"{self.rounds} rounds for {self.events} events: {self.s}"

    @invariant()
    def members_are_known(self) -> None:
        s = self.s
        assert len(s.members) <= self.max_nodes
        assert len(set(s.members)) == len(s.members)
        assert not set(s.joining) & set(s.departed)
        # Every live member is a started node with a heartbeat: a key of a member evicted since never brings
        # it back into a round.
        started = {v.ident for v in self.nodes.values() if v.status != "down"}
        for m in st.live_members(s):
            assert m in s.heartbeats and m in started, f"{m} is a member but no running node: {s}"


TestRendezvousModel = RendezvousModel.TestCase
TestRendezvousModel.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
