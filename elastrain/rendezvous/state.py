"""The rendezvous state and its decisions, as pure functions (no I/O, no torch).

One :class:`RendezvousState` per job lives in a compare-and-set backend. Every node reads it, applies
one of the functions below and writes it back with the token it read; a lost race is retried on the
fresh state. The rules:

* ``round`` is the job-wide number of the last completed round (``-1`` before the first); it is the
  restart count every worker sees, identical on all nodes.
* A node that wants a new round *joins*. The round completes as soon as every live member of the last
  round has re-joined (no fixed last call), or ``max_nodes`` joined; for a job's first round (no live
  members) it waits a short last call after ``min_nodes`` joined so that nodes starting together land
  in one round.
* A member that dies, freezes or leaves is recorded in ``departed``; the live members see it and
  re-join at once. Liveness comes from per-node heartbeat counters that *observers* judge with their
  own monotonic clock (:class:`Observations`), so clock skew between machines cannot evict anyone, and
  a node never judges itself, so it cannot evict itself.
"""

from __future__ import annotations

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
    """Per-node counters, bumped by the node's heartbeat thread."""
    closed: bool = False
    store_host: str = ""
    """The node whose process hosts the state store, when the store lives in a node (c10d)."""


# -- encoding ---------------------------------------------------------------------------------------


def encode(state: RendezvousState) -> bytes:
    return json.dumps(
        {
            "round": state.round,
            "members": list(state.members),
            "joining": list(state.joining),
            "departed": dict(state.departed),
            "nodes": {n: [i.addr, i.master_port, i.probe_port, i.standby_port] for n, i in state.nodes.items()},
            "heartbeats": dict(state.heartbeats),
            "closed": state.closed,
            "store_host": state.store_host,
        },
        separators=(",", ":"),
    ).encode()


def decode(data: bytes) -> RendezvousState:
    try:
        raw = json.loads(data)
        return RendezvousState(
            round=int(raw["round"]),
            members=tuple(str(m) for m in raw["members"]),
            joining=tuple(str(m) for m in raw["joining"]),
            departed={str(k): str(v) for k, v in raw["departed"].items()},
            nodes={str(k): NodeInfo(str(v[0]), int(v[1]), int(v[2]), int(v[3])) for k, v in raw["nodes"].items()},
            heartbeats={str(k): int(v) for k, v in raw["heartbeats"].items()},
            closed=bool(raw["closed"]),
            store_host=str(raw.get("store_host", "")),
        )
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise RendezvousStateCorruptError(
            f"the rendezvous state is not elastrain's ({exc}); is another launcher using the same --rdzv-id?"
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
            departed[n] = reason
    return replace(
        state,
        joining=tuple(n for n in state.joining if n not in gone),
        departed=departed,
        nodes={k: v for k, v in state.nodes.items() if k not in gone},
        heartbeats={k: v for k, v in state.heartbeats.items() if k not in gone},
    )


def beat(state: RendezvousState, node: str) -> RendezvousState | None:
    """Bump ``node``'s heartbeat; ``None`` if the node is not (any more) part of the job."""
    if node not in state.heartbeats:
        return None
    return replace(state, heartbeats={**state.heartbeats, node: state.heartbeats[node] + 1})


def close(state: RendezvousState) -> RendezvousState:
    return replace(state, closed=True)


def live_members(state: RendezvousState) -> tuple[str, ...]:
    return tuple(m for m in state.members if m not in state.departed and m in state.nodes)


def can_complete(
    state: RendezvousState, min_nodes: int, max_nodes: int, ready_for_s: float, last_call_s: float
) -> bool:
    """Whether the joiners form the next round now.

    ``ready_for_s`` is how long this observer has seen at least ``min_nodes`` joined (0 if not).
    """
    n = len(state.joining)
    if state.closed or n < min_nodes:
        return False
    if n >= max_nodes:
        return True
    live = live_members(state)
    if live:
        return all(m in state.joining for m in live)
    return ready_for_s >= last_call_s


def complete(state: RendezvousState, max_nodes: int) -> RendezvousState:
    """Form round ``round + 1``: surviving members keep their order, newcomers follow in arrival order."""
    order = [m for m in state.members if m in state.joining] + [n for n in state.joining if n not in state.members]
    members = tuple(order[:max_nodes])
    rest = tuple(order[max_nodes:])
    keep = set(members) | set(rest)
    return replace(
        state,
        round=state.round + 1,
        members=members,
        joining=rest,
        departed={},
        nodes={k: v for k, v in state.nodes.items() if k in keep},
        heartbeats={k: v for k, v in state.heartbeats.items() if k in keep},
    )


def change_for(state: RendezvousState, node: str, my_round: int) -> str | None:
    """Why ``node``, running round ``my_round``, must stop its workers and re-join; ``None`` if it need not.

    A closed rendezvous is no reason: nodes whose workers still finish their last steps keep them.
    """
    if state.round != my_round:
        return f"round {my_round} was superseded by {state.round}"
    if node not in state.members or node not in state.nodes:
        return "this node was evicted"
    departed = [m for m in state.members if m in state.departed]
    if departed:
        return "departed: " + ",".join(f"{m}({state.departed[m]})" for m in departed)
    if state.joining:
        return "waiting: " + ",".join(state.joining)
    return None


def nodes_waiting(state: RendezvousState) -> int:
    """What ``num_nodes_waiting`` reports: joiners plus departed members (each needs a new round)."""
    return len(state.joining) + sum(1 for m in state.members if m in state.departed)


def store_successors(state: RendezvousState) -> list[str]:
    """Who takes over the state store if its host dies, in order: the last round's members, then joiners."""
    order = [*state.members, *(n for n in state.joining if n not in state.members)]
    return [n for n in order if n != state.store_host and n in state.nodes and state.nodes[n].standby_port]


def after_store_failover(state: RendezvousState, new_host: str) -> RendezvousState:
    """The state the successor seeds its new store with: the old host is gone, ``new_host`` hosts."""
    return replace(remove(state, [state.store_host], "dead"), store_host=new_host)


# -- liveness ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Observations:
    """One observer's view of heartbeats: when (by its own monotonic clock) each counter last moved."""

    seen: Mapping[str, tuple[int, float]] = field(default_factory=dict)
    last_read: float | None = None


def observe(obs: Observations, heartbeats: Mapping[str, int], now: float, stall_s: float) -> Observations:
    """Record a read of ``heartbeats`` at ``now``.

    If this observer itself did not read for ``stall_s`` (it was frozen or starved), every baseline
    restarts at ``now``: its own gap is no evidence that the others stopped.
    """
    reset = obs.last_read is not None and now - obs.last_read > stall_s
    seen: dict[str, tuple[int, float]] = {}
    for node, counter in heartbeats.items():
        prev = obs.seen.get(node)
        if prev is None or reset or prev[0] != counter:
            seen[node] = (counter, now)
        else:
            seen[node] = prev
    return Observations(seen=seen, last_read=now)


def dead_nodes(obs: Observations, now: float, timeout_s: float, exclude: str) -> list[str]:
    """Nodes whose heartbeat did not move for ``timeout_s`` as seen by this observer (never itself)."""
    return sorted(n for n, (_, t) in obs.seen.items() if n != exclude and now - t >= timeout_s)
