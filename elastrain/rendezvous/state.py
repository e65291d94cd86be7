"""The rendezvous state and its decisions, as pure functions (no I/O, no torch).

One :class:`RendezvousState` per job lives in a compare-and-set backend. Every node reads it, applies
one of the functions below and writes it back with the token it read; a lost race is retried on the
fresh state. The rules:

* ``round`` is the job-wide number of the last completed round (``-1`` before the first); it is the
  restart count every worker sees, identical on all nodes.
* A node that wants a new round *joins*. The round completes as soon as every live member of the last
  round has re-joined (no fixed last call); for a job's first round (no live members) it completes when
  ``max_nodes`` joined, or after a last call once ``min_nodes`` joined, so that nodes starting together
  land in one round.
* A node that arrives while the round is full (``max_nodes`` live members) is a *spare*: it waits in
  ``joining``, heartbeating, and is no reason for a new round. When a member departs, the next round
  takes the survivors and then the spares, in arrival order (hot spare). So a full job never restarts
  for an arrival, and every event leads to at most one new round.
* Once the state shows every member that its round is over (:func:`round_over`: a member departed, or one
  re-joined through the state), the other live members re-join through keys of their own, one small write
  each and no compare-and-set of this state (:func:`rejoins_by_key`); one node folds those keys into the
  state and completes the round in a single compare-and-set (:func:`fold`). Nothing else reads the keys:
  every decision that looks at ``joining`` for a member's re-join has already seen the round end.
* ``generation`` is the fencing token this lineage's current world claimed in the checkpoint root
  (:mod:`elastrain.fence`); ``superseded_by`` is a tombstone: another world won the claim,
  and every node of this lineage must leave it for that world's store; when nothing listens there any more
  (that world died whole), the lineage starts over (:func:`revive`).
* A member that dies, freezes or leaves is recorded in ``departed``; the live members see it and
  re-join at once. Liveness comes from per-node heartbeat counters that *observers* judge with their
  own monotonic clock (:class:`Observations`), so clock skew between machines cannot evict anyone, and
  a node never judges itself, so it cannot evict itself.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from elastrain.errors import RendezvousStateCorruptError


@dataclass(frozen=True)
class NodeInfo:
    """How to reach a node: its address, the port its rank-0 worker store would listen on, and its probe port.

    The probe port is a socket the node's agent listens on; a refused connection means the agent's
    process is gone (a frozen or unreachable one is left to the heartbeat timeout).
    """

    addr: str
    master_port: int
    probe_port: int = 0
    standby_port: int = 0
    """Where this node would host the state store if the store's host died (c10d failover)."""
    nnodes: tuple[int, int] = (0, 0)
    """The node's ``--nnodes`` (min, max): every node of a job decides rounds by its own, so they must agree
    (:func:`nnodes_conflict`); (0, 0): not said."""


@dataclass(frozen=True)
class RendezvousState:
    round: int = -1
    """The last completed round (job-wide restart count); -1 before the first."""
    members: tuple[str, ...] = ()
    """Nodes of ``round`` in group-rank order."""
    joining: tuple[str, ...] = ()
    """Nodes waiting for ``round + 1``, in arrival order."""
    departed: Mapping[str, str] = field(default_factory=dict)
    """Members of ``round`` that died or left since it completed: node -> reason."""
    nodes: Mapping[str, NodeInfo] = field(default_factory=dict)
    """Every node in ``members`` or ``joining`` (departed ones are dropped)."""
    heartbeats: Mapping[str, int] = field(default_factory=dict)
    """Every node of the job (members, joiners, spares). The heartbeats themselves are per-node counters
    kept beside the state (the handler's ``beat/<node>`` keys), so a beat never rewrites this state."""
    closed: bool = False
    store_host: str = ""
    """The node whose process hosts the state store, when the store lives in a node (c10d)."""
    generation: int = -1
    """The fencing generation claimed for round ``generation_round`` (-1: none claimed yet)."""
    generation_round: int = -1
    majority: bool = True
    """Whether round ``round`` holds a majority of the previous round's voters (see :func:`complete`)."""
    superseded_by: str = ""
    """Set when another world won this lineage's generation claim: where that world's store is."""
    failed: tuple[str, ...] = ()
    """Members of ``round`` whose workers failed: those that failed on their own first, then the echoes
    (``echoes``), each part in the order they reported it (see :func:`report_failure`)."""
    echoes: tuple[str, ...] = ()
    """The members of ``failed`` whose workers said a collective broke under them (a peer failed)."""
    after_failure: tuple[str, ...] = ()
    """The previous round's ``failed`` when this round formed: members whose workers failed (a worker SIGKILLed, a
    crash) and re-joined. A worker's state was lost with it, so this round did not keep every member's."""


class Departure(str, enum.Enum):
    """Why a member left its round; ``proven`` ones do not count as absent voters (see :func:`complete`)."""

    DEAD = "dead"  # its agent's probe port refused a connection: the process is gone
    SILENT = "silent"  # heartbeat timeout: dead, frozen or cut off, we cannot tell
    LEFT = "left"  # announced (SIGTERM, preemption notice)
    FAILED = "failed"  # its own workers failed past --max-restarts; it left the job
    CONFIG = "config"  # its workers exited with EX_USAGE/EX_CONFIG (a setting to fix); it left the job
    FINISHED = "finished"

    @property
    def proven(self) -> bool:
        return self is not Departure.SILENT


def departure_of(reason: str) -> Departure:
    """The kind of a ``departed`` value (``"left:SIGTERM"`` -> LEFT); unknown kinds count as SILENT."""
    head = reason.split(":", 1)[0]
    try:
        return Departure(head)
    except ValueError:
        return Departure.SILENT


class ChangeKind(str, enum.Enum):
    """Why a node's current round is over."""

    SUPERSEDED = "superseded"  # a newer round formed without us
    EVICTED = "evicted"  # we are no longer a member (frozen past the timeout)
    DEPARTED = "departed"  # a member died, left or failed
    REGROUP = "regroup"  # a member re-joined (its workers failed): a new round is under way
    PEER_FAILED = "peer_failed"  # another member's workers failed first: ours broke with them
    SCALE_UP = "scale_up"  # nodes wait and the round has room for them
    FENCED = "fenced"  # another world of this job holds a newer generation


@dataclass(frozen=True)
class Change:
    kind: ChangeKind
    detail: str
    departures: tuple[Departure, ...] = ()  # DEPARTED: how each departed member left

    def __str__(self) -> str:
        return f"{self.kind.value}: {self.detail}"


# -- encoding ---------------------------------------------------------------------------------------


def encode(state: RendezvousState) -> bytes:
    return json.dumps(
        {
            "round": state.round,
            "members": list(state.members),
            "joining": list(state.joining),
            "departed": dict(state.departed),
            "nodes": {n: _info_fields(i) for n, i in state.nodes.items()},
            "heartbeats": dict(state.heartbeats),
            "closed": state.closed,
            "store_host": state.store_host,
            "generation": [state.generation, state.generation_round],
            "majority": state.majority,
            "superseded_by": state.superseded_by,
            "failed": list(state.failed),
            "echoes": list(state.echoes),
            "after_failure": list(state.after_failure),
        },
        separators=(",", ":"),
    ).encode()


def _info_fields(i: NodeInfo) -> list[object]:
    return [i.addr, i.master_port, i.probe_port, i.standby_port, *i.nnodes]


def encode_info(info: NodeInfo) -> bytes:
    return json.dumps(_info_fields(info)).encode()


# Decoding checks every field's type: JSON of another shape (another launcher's state, a forged one) is a
# RendezvousStateCorruptError, never an AttributeError or KeyError, and never a string made of a list.
_DECODE_ERRORS = (ValueError, KeyError, TypeError, IndexError, RecursionError)


def _int(v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"expected an integer, got {type(v).__name__}")
    return v


def _str(v: object) -> str:
    if not isinstance(v, str):
        raise TypeError(f"expected a string, got {type(v).__name__}")
    return v


def _bool(v: object) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"expected true or false, got {type(v).__name__}")
    return v


def _list(v: object) -> list[object]:
    if not isinstance(v, list):
        raise TypeError(f"expected a list, got {type(v).__name__}")
    return v


def _dict(v: object) -> dict[str, object]:
    if not isinstance(v, dict):
        raise TypeError(f"expected an object, got {type(v).__name__}")
    return v


def _info(v: object) -> NodeInfo:
    items = _list(v)
    if len(items) not in (4, 6):
        raise ValueError(f"a node's address has 4 or 6 fields, got {len(items)}")
    nnodes = (_int(items[4]), _int(items[5])) if len(items) == 6 else (0, 0)
    return NodeInfo(_str(items[0]), _int(items[1]), _int(items[2]), _int(items[3]), nnodes)


def decode_info(data: bytes) -> NodeInfo:
    try:
        return _info(json.loads(data))
    except _DECODE_ERRORS as exc:
        raise RendezvousStateCorruptError(
            f"a re-join key is not elastrain's ({exc}); is another launcher using the same --rdzv-id?"
        ) from exc


def decode(data: bytes) -> RendezvousState:
    try:
        raw = _dict(json.loads(data))
        generation = _list(raw.get("generation", [-1, -1]))
        if len(generation) != 2:
            raise ValueError(f"generation has 2 fields, got {len(generation)}")
        return RendezvousState(
            round=_int(raw["round"]),
            members=tuple(_str(m) for m in _list(raw["members"])),
            joining=tuple(_str(m) for m in _list(raw["joining"])),
            departed={_str(k): _str(v) for k, v in _dict(raw["departed"]).items()},
            nodes={_str(k): _info(v) for k, v in _dict(raw["nodes"]).items()},
            heartbeats={_str(k): _int(v) for k, v in _dict(raw["heartbeats"]).items()},
            closed=_bool(raw["closed"]),
            store_host=_str(raw.get("store_host", "")),
            generation=_int(generation[0]),
            generation_round=_int(generation[1]),
            majority=_bool(raw.get("majority", True)),
            superseded_by=_str(raw.get("superseded_by", "")),
            failed=tuple(_str(n) for n in _list(raw.get("failed", []))),
            echoes=tuple(_str(n) for n in _list(raw.get("echoes", []))),
            after_failure=tuple(_str(n) for n in _list(raw.get("after_failure", []))),
        )
    except _DECODE_ERRORS as exc:
        raise RendezvousStateCorruptError(
            f"the rendezvous state is not elastrain's ({type(exc).__name__}: {exc}); is another launcher using the "
            "same --rdzv-id?"
        ) from exc


# -- transitions ------------------------------------------------------------------------------------


def join(state: RendezvousState, node: str, info: NodeInfo) -> RendezvousState:
    """``node`` asks for the next round (idempotent; refreshes its address)."""
    joining = state.joining if node in state.joining else (*state.joining, node)
    heartbeats = dict(state.heartbeats)
    heartbeats.setdefault(node, 0)
    return replace(state, joining=joining, nodes={**state.nodes, node: info}, heartbeats=heartbeats)


def remove(state: RendezvousState, nodes: Iterable[str], reason: str) -> RendezvousState:
    """Nodes that died or left: out of ``joining``; members of the current round become ``departed``."""
    gone = [n for n in nodes if n in state.nodes or n in state.heartbeats or n in state.joining]
    if not gone:
        return state
    departed = dict(state.departed)
    for n in gone:
        if n in state.members:
            departed.setdefault(n, reason)  # the first account of a departure is the one that knows why
    return replace(
        state,
        joining=tuple(n for n in state.joining if n not in gone),
        departed=departed,
        nodes={k: v for k, v in state.nodes.items() if k not in gone},
        heartbeats={k: v for k, v in state.heartbeats.items() if k not in gone},
    )


def close(state: RendezvousState) -> RendezvousState:
    return replace(state, closed=True)


def live_members(state: RendezvousState) -> tuple[str, ...]:
    return tuple(m for m in state.members if m not in state.departed and m in state.nodes)


def vacated(state: RendezvousState) -> bool:
    """Whether nobody is left in this lineage: no live member and no joiner or spare (its last node left). A store
    hosted by that node leaves with it, and no node of the state would carry the lineage on by a failover."""
    return not state.closed and not live_members(state) and not state.joining


def nnodes_conflict(state: RendezvousState, node: str, nnodes: tuple[int, int]) -> tuple[str, NodeInfo] | None:
    """The first other node of the state (a live member, or a node waiting for a round) that said another
    ``--nnodes`` than ``nnodes``; None when every one that said agrees."""
    for other in (*live_members(state), *state.joining):
        info = state.nodes.get(other)
        if other != node and info is not None and info.nnodes != (0, 0) and info.nnodes != nnodes:
            return other, info
    return None


def newcomers(state: RendezvousState) -> tuple[str, ...]:
    """Joiners that are not members of the current round, in arrival order."""
    return tuple(n for n in state.joining if n not in state.members)


def room(state: RendezvousState, max_nodes: int) -> int:
    """How many newcomers the next round could take beside the live members."""
    return max(0, max_nodes - len(live_members(state)))


def spares(state: RendezvousState, max_nodes: int) -> tuple[str, ...]:
    """Newcomers that would not fit in the next round if it formed now: they wait as hot spares."""
    return newcomers(state)[room(state, max_nodes) :]


def can_complete(
    state: RendezvousState, min_nodes: int, max_nodes: int, ready_for_s: float, last_call_s: float
) -> bool:
    """Whether the joiners form the next round now.

    ``ready_for_s`` is how long this observer has seen at least ``min_nodes`` joined (0 if not).
    With live members (a running job), the round forms once every live member has re-joined, and
    only if that changes something (:func:`change_for`): spares alone never complete a round.
    Without live members (first round, or every member gone), it forms at ``max_nodes`` joiners or
    after the last call.
    """
    n = len(state.joining)
    if state.closed or state.superseded_by or min(n, max_nodes) < min_nodes:
        return False
    live = live_members(state)
    if live:
        return all(m in state.joining for m in live)
    if n >= max_nodes:
        return True
    return ready_for_s >= last_call_s


def last_call(state: RendezvousState, started_over: bool, last_call_s: float, window_s: float) -> float:
    """How long joiners with no live member to join wait for more nodes before they form a round.

    A job's first start (no round formed yet in this store) waits the last call for the nodes launched with it. A job
    that already trained and lost every member (the last ones died while a node was on its way in: that node took
    the store over), or that goes on on a store founded afresh for it (``started_over``: its nodes launched again
    after all of them died, a refound, a revived lineage), waits ``window_s``, as a running job does for nodes
    arriving together: a node that comes later joins it as it would have joined the running job.
    """
    return window_s if started_over or state.round >= 0 else last_call_s


def round_over(state: RendezvousState) -> bool:
    """Whether the state already shows every live member of the round that the round is over: a member
    departed (:attr:`ChangeKind.DEPARTED` for all), or a member re-joined through the state (REGROUP for the
    others). Both stay true until the next round completes (a re-joined member that is then removed departs)."""
    return bool(state.departed) or any(m in state.joining for m in state.members)


def rejoins_by_key(state: RendezvousState, node: str) -> bool:
    """Whether ``node`` may ask for the next round through its own key instead of a compare-and-set: it is a
    live member of the round, and the round is visibly over (:func:`round_over`), so no member needs to see
    its re-join in ``joining`` to stop. The first member to re-join a running round (its workers failed, a
    newcomer waits) writes the state, so that the others learn the round is over."""
    return round_over(state) and node in live_members(state) and node not in state.joining


def fold(state: RendezvousState, round_: int, rejoined: Mapping[str, NodeInfo]) -> RendezvousState:
    """The state as if the live members in ``rejoined`` (node -> its fresh address; read from their keys for
    round ``round_``) had joined through it; unchanged once that round is over or the keys mean nothing.

    Only live members of ``round_`` count: a key of a member evicted since, or written before a store moved,
    is ignored. The result decides :func:`can_complete` and feeds :func:`complete` in one compare-and-set.
    """
    if state.round != round_ or not round_over(state):
        return state
    add = [m for m in live_members(state) if m in rejoined and m not in state.joining]
    if not add:
        return state
    return replace(state, joining=(*state.joining, *add), nodes={**state.nodes, **{m: rejoined[m] for m in add}})


def unfolded(state: RendezvousState) -> tuple[str, ...]:
    """The live members whose re-join keys would complete the round: those not yet in ``joining``."""
    return tuple(m for m in live_members(state) if m not in state.joining)


def complete(state: RendezvousState, max_nodes: int) -> RendezvousState:
    """Form round ``round + 1``: surviving members keep their order, newcomers follow in arrival order.

    Newcomers beyond ``max_nodes`` stay in ``joining`` as spares. ``majority`` records whether the new
    round holds more than half of the previous round's voters: its members minus those that left, failed
    or were proven dead. A round without one may be the minority side of a partition; the handler then
    waits before it claims the next generation, so that a majority side claims first.
    """
    order = [m for m in state.members if m in state.joining] + list(newcomers(state))
    members = tuple(order[:max_nodes])
    rest = tuple(order[max_nodes:])
    keep = set(members) | set(rest)
    voters = [m for m in state.members if not (m in state.departed and departure_of(state.departed[m]).proven)]
    majority = not voters or 2 * sum(1 for v in voters if v in members) > len(voters)
    return replace(
        state,
        round=state.round + 1,
        members=members,
        joining=rest,
        departed={},
        nodes={k: v for k, v in state.nodes.items() if k in keep},
        heartbeats={k: v for k, v in state.heartbeats.items() if k in keep},
        majority=majority,
        failed=(),
        echoes=(),
        after_failure=tuple(m for m in state.failed if m in members),
    )


def report_failure(state: RendezvousState, node: str, round_: int, echo: bool = False) -> RendezvousState | None:
    """``node``'s workers failed while it ran ``round_``; ``None`` if that changes nothing.

    When one node's workers fail, its peers' workers usually fail a moment later (their collective broke),
    and every agent sees a failure. The first of ``failed`` is the cause: its failure is its own (it counts
    against its ``--max-restarts``); the others, and members whose workers are still healthy, re-form
    without counting one (:func:`change_for`). ``echo``: the node's workers said a collective broke under
    them; such a report goes after every other, so that an echo's agent that reports before the cause's
    (a loaded machine, a slower agent) is not taken for the cause. Among echoes alone, the first reporter
    is the cause (a collective that broke with no failed peer: a partition, a frozen peer).
    """
    if state.round != round_ or node not in state.members or node in state.failed or node in state.departed:
        return None
    if echo:
        return replace(state, failed=(*state.failed, node), echoes=(*state.echoes, node))
    own = tuple(n for n in state.failed if n not in state.echoes)
    return replace(state, failed=(*own, node, *state.echoes))


def record_generation(state: RendezvousState, round_: int, generation: int) -> RendezvousState | None:
    """The leader of ``round_`` claimed ``generation``; ``None`` if that round is already over."""
    if state.round != round_ or state.generation_round == round_:
        return None
    return replace(state, generation=generation, generation_round=round_)


def supersede(state: RendezvousState, store: str) -> RendezvousState:
    """Another world won the claim: tombstone this lineage and point its nodes at ``store``."""
    return replace(state, superseded_by=store or "unknown")


def revive(state: RendezvousState, store: str) -> RendezvousState | None:
    """The world this lineage's tombstone points at (``store``) is gone: lift the tombstone and start over.

    The state keeps its round number (the next round's keys in the store stay apart from every earlier round's)
    and its store's host; it forgets the lineage's members, joiners and generation, so that every node joins
    anew and the next round's leader claims the job's next free generation as a fresh world does. ``None``
    when the state is closed or its tombstone points elsewhere (or was lifted already).
    """
    if state.closed or not store or state.superseded_by != store:
        return None
    return RendezvousState(round=state.round, store_host=state.store_host)


@dataclass(frozen=True)
class Continuity:
    """How the round a node just joined relates to the last one it was in."""

    kept_every_member: bool
    """The new round directly follows the node's last one and holds every member of it (nodes joined, none
    left), and no member's workers failed in between: the same answer on every node of both rounds."""
    left_behind: bool
    """The new round does not directly follow the node's last one (rounds were formed without it, or it was
    redirected to a winning world's store), or the node was frozen for a heartbeat timeout and the new round did
    not keep every member: the job may have trained on without it, so the state its workers hold in memory
    belongs to a world the job moved on from."""


def continuity(
    node: str,
    last_round: int,
    last_members: Iterable[str],
    round_: int,
    members: Iterable[str],
    redirected: bool = False,
    silent: bool = False,
    after_failure: Iterable[str] = (),
) -> Continuity:
    """Pure: :class:`Continuity` for ``node``, last in ``last_round`` (``-1``: none) with ``last_members``, now
    in ``round_`` with ``members``. ``redirected``: it left its lineage's store for another world's since (its
    world lost the fencing claim); that world numbers its own rounds, so no number there continues this one's.
    ``silent``: its heartbeat stopped for a heartbeat timeout since (frozen): its peers may have judged it dead
    and trained on in a lineage of their own (its store died meanwhile, so it never saw their rounds); unless the
    new round kept every member, it was left behind. ``after_failure``: the new round's members whose workers failed
    in the last one (:attr:`RendezvousState.after_failure`): a worker's state went with it, so not every member was
    kept, though such a member does not leave a silent node behind (the job trained nothing without it)."""
    before, now = set(last_members), set(members)
    if last_round < 0:
        return Continuity(kept_every_member=False, left_behind=False)  # nothing held from an earlier round
    follows = round_ == last_round + 1 and not redirected
    kept = follows and node in before and before <= now
    lost = any(True for _ in after_failure)
    return Continuity(kept_every_member=kept and not lost, left_behind=not follows or (silent and not kept))


def change_for(state: RendezvousState, node: str, my_round: int, max_nodes: int) -> Change | None:
    """Why ``node``, running round ``my_round``, must stop its workers and re-join; ``None`` if it need not.

    A closed rendezvous is no reason: nodes whose workers still finish their last steps keep them.
    Spares (newcomers beyond the round's room) are no reason either.
    """
    if state.superseded_by:
        return Change(ChangeKind.FENCED, f"another world of this job won the claim (store {state.superseded_by})")
    if state.round != my_round:
        return Change(ChangeKind.SUPERSEDED, f"round {my_round} was superseded by {state.round}")
    if node not in state.members or node not in state.nodes:
        return Change(ChangeKind.EVICTED, "this node was evicted")
    departed = [m for m in state.members if m in state.departed]
    if departed:
        detail = ",".join(f"{m}({state.departed[m]})" for m in departed)
        return Change(ChangeKind.DEPARTED, detail, tuple(departure_of(state.departed[m]) for m in departed))
    if state.failed[:1] == (node,):
        # Our workers failed first: peers re-joining after theirs broke (echoes) or newcomers are no excuse;
        # the failure is ours and counts against our --max-restarts.
        return None
    rejoined = [m for m in state.members if m in state.joining and m != node]
    if rejoined:
        return Change(ChangeKind.REGROUP, "re-joined: " + ",".join(rejoined))
    if state.failed:  # not ours first (that returned above): ours, if any, broke with theirs
        return Change(ChangeKind.PEER_FAILED, f"the workers of {state.failed[0]} failed first")
    fit = newcomers(state)[: room(state, max_nodes)]
    if fit:
        return Change(ChangeKind.SCALE_UP, "waiting: " + ",".join(fit))
    return None


def judge(state: RendezvousState) -> str | None:
    """The node that reads every heartbeat counter and evicts the silent: the first live member, else the
    first joiner. Everyone else watches only the judge, so liveness costs O(1) per node per beat."""
    live = live_members(state)
    if live:
        return live[0]
    return next((n for n in state.joining if n in state.heartbeats), None)


def nodes_waiting(state: RendezvousState, max_nodes: int) -> int:
    """What ``num_nodes_waiting`` reports: newcomers that fit plus departed members (each needs a new round)."""
    return min(len(newcomers(state)), room(state, max_nodes)) + sum(1 for m in state.members if m in state.departed)


def store_successors(state: RendezvousState) -> list[str]:
    """Who takes over the state store if its host dies, in order: the last round's members, then joiners."""
    order = [*state.members, *(n for n in state.joining if n not in state.members)]
    return [n for n in order if n != state.store_host and n in state.nodes and state.nodes[n].standby_port]


def after_store_failover(state: RendezvousState, new_host: str, how: Departure = Departure.SILENT) -> RendezvousState:
    """The state the successor seeds its new store with: the old host is gone, ``new_host`` hosts."""
    return replace(remove(state, [state.store_host], how.value), store_host=new_host)


# -- liveness ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Observations:
    """One observer's view of heartbeats: when (by its own monotonic clock) each counter last moved."""

    seen: Mapping[str, tuple[int, float]] = field(default_factory=dict)


def observe(obs: Observations, heartbeats: Mapping[str, int], now: float, stalled: bool) -> Observations:
    """Record a read of ``heartbeats`` at ``now``.

    If this observer itself ``stalled`` since its last read (it was frozen or starved; see
    :class:`elastrain.rendezvous.liveness.TickClock`), every baseline restarts at ``now``: its own gap
    is no evidence that the others stopped.
    """
    seen: dict[str, tuple[int, float]] = {}
    for node, counter in heartbeats.items():
        prev = obs.seen.get(node)
        if prev is None or stalled or prev[0] != counter:
            seen[node] = (counter, now)
        else:
            seen[node] = prev
    return Observations(seen=seen)


def seeded(obs: Observations, counters: Mapping[str, int], now: float, silent_for: Mapping[str, float]) -> Observations:
    """Take over the evidence of a previous judge, before :func:`observe` records ``counters``.

    Nodes it saw silent for ``silent_for[n]`` seconds start with that much silence already counted,
    unless this observer saw their counter at another value before (then it moved: no evidence).
    """
    seen = dict(obs.seen)
    for node, counter in counters.items():
        silent = silent_for.get(node)
        prev = seen.get(node)
        if silent is None or (prev is not None and prev[0] != counter):
            continue
        seen[node] = (counter, min(prev[1] if prev else now, now - silent))
    return Observations(seen=seen)


def silence(obs: Observations, now: float) -> dict[str, float]:
    """How long each observed node has been silent, for the judge's published snapshot."""
    return {n: round(now - t, 3) for n, (_, t) in obs.seen.items()}


def dead_nodes(obs: Observations, now: float, timeout_s: float, exclude: str) -> list[str]:
    """Nodes whose heartbeat did not move for ``timeout_s`` as seen by this observer (never itself)."""
    return sorted(n for n, (_, t) in obs.seen.items() if n != exclude and now - t >= timeout_s)
