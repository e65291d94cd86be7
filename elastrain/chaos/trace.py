"""Preemption traces: when which node is killed, warned or brought back.

A trace is a file (YAML or JSON)::

    nodes: 3            # how many node slots the job has
    start: [0, 1, 2]    # nodes up at t=0 (default: all)
    events:
      - {at: 20, action: kill, node: 1}              # SIGKILL, no warning (AzureML low priority)
      - {at: 30, action: crash, node: 2}             # SIGKILL of one worker: its agent lives and starts it again
      - {at: 45, action: start, node: 1}             # the node comes back
      - {at: 60, action: term, node: 2, notice: 10}  # SIGTERM, then SIGKILL 10 s later (AWS/GCP notice)
      - {at: 65, action: term, node: 1, whole: true} # SIGTERM to every process of the node (a VM's or Slurm's shutdown)
      - {at: 70, action: stop, node: 0}              # SIGSTOP of the whole node (a frozen VM) ...
      - {at: 75, action: kill, node: 0}              # ... then SIGKILL (or `cont`: it wakes up)
      - {at: 90, action: kill_all}                   # the whole job dies ...
      - {at: 95, action: restart_all, nodes: [0, 1]} # ... and is started again with the same command

Times are seconds after the harness started the first node. ``gap: 5`` makes an event also wait
5 s after the one before it fired (follow-ups such as the kill after a ``stop``). With
``max_nodes: 3`` and ``nodes: 5`` the launcher's MAX is 3 and slots 3 and 4 are spares: they are
down at the start (``start`` defaults to the first ``max_nodes`` slots) and ``start`` events bring
them up beyond MAX. An event may also wait for training
progress: ``{at: 0, after_step: 150, action: kill, node: 1}`` fires once the job has logged step 150
(and ``at`` has passed), which makes a trace mean the same on fast and slow machines. Events fire
in order: one that waits holds back those after it. :func:`random_trace` draws a seeded
trace that mimics the AzureML low-priority experiment: nodes vanish and return at random, and
never fewer than ``min_alive`` are up.
"""

from __future__ import annotations

import enum
import json
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from elastrain.errors import TraceError


class Action(str, enum.Enum):
    KILL = "kill"
    TERM = "term"
    START = "start"
    STOP = "stop"
    """SIGSTOP of every process of the node: frozen until a ``cont`` or a ``kill``."""
    CONT = "cont"
    """SIGCONT of a stopped node: it wakes up where it was."""
    KILL_ALL = "kill_all"
    """SIGKILL of every node that is up or stopped: the whole job is gone."""
    RESTART_ALL = "restart_all"
    """Start the listed ``nodes`` (all down) at once, with the same command: the whole job again."""
    CRASH = "crash"
    """SIGKILL of one worker process of a node that is up (out of memory, a segfault): its agent lives, and starts
    its workers again (``--max-restarts``). The node stays up."""


GROUP_ACTIONS = frozenset({Action.KILL_ALL, Action.RESTART_ALL})
ALL_NODES = -1
"""``TraceEvent.node`` of the group actions, which name no single node."""


@dataclass(frozen=True)
class TraceEvent:
    at: float
    action: Action
    node: int
    notice_s: float = 0.0
    """For ``term``: seconds between SIGTERM and the SIGKILL of whatever is left."""
    whole: bool = False
    """For ``term``: SIGTERM every process of the node (a VM's or Slurm's shutdown), not only its agent."""
    after_step: int | None = None
    """Also wait until the job's progress (its highest logged step) reaches this step."""
    gap_s: float = 0.0
    """Also wait this long after the previous event fired."""
    nodes: tuple[int, ...] = ()
    """For ``restart_all``: the nodes to start."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"at": self.at, "action": self.action.value}
        if self.action not in GROUP_ACTIONS:
            out["node"] = self.node
        if self.action is Action.RESTART_ALL:
            out["nodes"] = list(self.nodes)
        if self.action is Action.TERM:
            out["notice"] = self.notice_s
        if self.whole:
            out["whole"] = True
        if self.after_step is not None:
            out["after_step"] = self.after_step
        if self.gap_s:
            out["gap"] = self.gap_s
        return out


@dataclass(frozen=True)
class Trace:
    nodes: int
    events: tuple[TraceEvent, ...] = ()
    start: tuple[int, ...] = field(default=())
    max_nodes: int | None = None
    """The launcher's MAX (``--nnodes MIN:MAX``); slots beyond it are spares. ``None``: ``nodes``."""

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise TraceError(f"nodes must be at least 1, got {self.nodes}")
        if self.max_nodes is not None and not 1 <= self.max_nodes <= self.nodes:
            raise TraceError(f"max_nodes must be between 1 and nodes={self.nodes}, got {self.max_nodes}")
        if not self.start:
            object.__setattr__(self, "start", tuple(range(self.launcher_max)))
        # A stable sort: events at the same time keep the file's order, and one timed only by a gap or
        # a step (no 'at') stays right after the event before it.
        keys, last = [], 0.0
        for e in self.events:
            last = last if e.at == 0 and (e.gap_s or e.after_step is not None) else e.at
            keys.append(last)
        order = sorted(range(len(self.events)), key=keys.__getitem__)
        object.__setattr__(self, "events", tuple(self.events[i] for i in order))
        validate(self)

    @property
    def launcher_max(self) -> int:
        """The MAX of every node's ``--nnodes 1:MAX``."""
        return self.max_nodes or self.nodes

    @property
    def duration_s(self) -> float:
        return self.events[-1].at if self.events else 0.0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"nodes": self.nodes}
        if self.max_nodes is not None:
            out["max_nodes"] = self.max_nodes
        out.update(start=list(self.start), events=[e.to_dict() for e in self.events])
        return out

    def min_alive(self) -> int:
        """The fewest nodes up at any moment of the trace (notice windows count as up, stopped nodes do not)."""
        up = set(self.start)
        lowest = len(up)
        for state in _states(self):
            lowest = min(lowest, sum(1 for s in state.values() if s == "up"))
        return lowest


def _states(trace: Trace) -> list[dict[int, str]]:
    """Each node's state (``up``, ``stopped`` or ``down``) after each event; raises TraceError on an impossible one."""
    state = {n: "up" if n in trace.start else "down" for n in range(trace.nodes)}
    out = []
    for i, e in enumerate(trace.events):
        where = f"events[{i}] (at {e.at}s)"
        _check_event(trace, e, where)
        if e.action is Action.KILL_ALL:
            if all(s == "down" for s in state.values()):
                raise TraceError(f"{where}: kill_all, but every node is down already")
            state = dict.fromkeys(state, "down")
        elif e.action is Action.RESTART_ALL:
            for n in e.nodes:
                if state[n] != "down":
                    raise TraceError(f"{where}: restart_all lists node {n}, which is {state[n]}")
                state[n] = "up"
        else:
            now = state[e.node]
            if now not in _ALLOWED_FROM[e.action]:
                allowed = " or ".join(sorted(_ALLOWED_FROM[e.action], reverse=True))
                raise TraceError(f"{where}: node {e.node} is {now}, not {allowed}: {_FIX[e.action]}")
            state[e.node] = _NEXT[e.action]
        out.append(dict(state))
    return out


_ALLOWED_FROM = {
    Action.START: {"down"},
    Action.KILL: {"up", "stopped"},
    Action.TERM: {"up"},
    Action.STOP: {"up"},
    Action.CONT: {"stopped"},
    Action.CRASH: {"up"},
}
_NEXT = {
    Action.START: "up",
    Action.KILL: "down",
    Action.TERM: "down",
    Action.STOP: "stopped",
    Action.CONT: "up",
    Action.CRASH: "up",
}
_FIX = {
    Action.START: "it is already up: kill or term it before starting it again",
    Action.KILL: "only a node that is up or stopped can be killed",
    Action.TERM: "only a node that is up can be termed (kill a stopped node, or cont it first)",
    Action.STOP: "only a node that is up can be stopped",
    Action.CONT: "only a stopped node can be continued",
    Action.CRASH: "only a node that is up has workers to crash",
}


def _check_event(trace: Trace, e: TraceEvent, where: str) -> None:
    if e.at < 0:
        raise TraceError(f"{where}: 'at' must be >= 0 seconds")
    if e.action in GROUP_ACTIONS:
        if e.action is Action.RESTART_ALL and not e.nodes:
            raise TraceError(f"{where}: restart_all needs 'nodes', the list of nodes to start")
        bad = [n for n in e.nodes if not 0 <= n < trace.nodes]
        if bad:
            raise TraceError(f"{where}: nodes {bad} are outside 0..{trace.nodes - 1}")
        if len(set(e.nodes)) != len(e.nodes):
            raise TraceError(f"{where}: 'nodes' lists a node twice")
    elif not 0 <= e.node < trace.nodes:
        raise TraceError(f"{where}: node {e.node} is outside 0..{trace.nodes - 1}; raise 'nodes' or fix 'node'")
    if e.notice_s < 0:
        raise TraceError(f"{where}: 'notice' must be >= 0 seconds")
    if e.whole and e.action is not Action.TERM:
        raise TraceError(f"{where}: 'whole' is for term events only")
    if e.gap_s < 0:
        raise TraceError(f"{where}: 'gap' must be >= 0 seconds")
    if e.after_step is not None and e.after_step < 0:
        raise TraceError(f"{where}: 'after_step' must be >= 0")


def validate(trace: Trace) -> None:
    """Every node index in range, and every event possible in the state the ones before left
    (no kill of a node that is down, no start of a node that is up, no cont of a running one)."""
    for n in trace.start:
        if not 0 <= n < trace.nodes:
            raise TraceError(f"start: node {n} is outside 0..{trace.nodes - 1}")
    _states(trace)


def _flag(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{key!r} must be true or false, got {value!r}")
    return value


def _event(raw: Mapping[str, Any], index: int) -> TraceEvent:
    try:
        action = Action(str(raw["action"]).lower())
        after = raw.get("after_step")
        gap = float(raw.get("gap", 0.0))
        timed_otherwise = after is not None or gap > 0
        return TraceEvent(
            at=float(raw.get("at", 0.0) if timed_otherwise else raw["at"]),
            action=action,
            node=ALL_NODES if action in GROUP_ACTIONS else int(raw["node"]),
            notice_s=float(raw.get("notice", 0.0)),
            whole=_flag(raw.get("whole", False), "whole"),
            after_step=None if after is None else int(after),
            gap_s=gap,
            nodes=tuple(int(n) for n in raw.get("nodes") or ()),
        )
    except KeyError as exc:
        raise TraceError(
            f"events[{index}]: missing key {exc.args[0]!r} (each event needs action, node, and at, gap or after_step)"
        ) from None
    except (ValueError, TypeError) as exc:
        choices = ", ".join(a.value for a in Action)
        raise TraceError(f"events[{index}]: {exc} (action is one of {choices})") from None


def trace_from_dict(data: Mapping[str, Any]) -> Trace:
    if "nodes" not in data:
        raise TraceError("a trace needs 'nodes' (the number of node slots)")
    events = data.get("events") or []
    if not isinstance(events, list):
        raise TraceError("'events' must be a list of {at, action, node} mappings")
    max_nodes = data.get("max_nodes")
    return Trace(
        nodes=int(data["nodes"]),
        events=tuple(_event(e, i) for i, e in enumerate(events)),
        start=tuple(int(n) for n in data.get("start") or ()),
        max_nodes=None if max_nodes is None else int(max_nodes),
    )


def load_trace(path: str | Path) -> Trace:
    """Read a trace file; ``.json`` as JSON, anything else as YAML (a superset of JSON)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise TraceError(f"cannot read trace file {p}: {exc.strerror}") from None
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise TraceError(f"{p} is not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {exc}") from None
    if not isinstance(data, dict):
        raise TraceError(f"{p}: a trace is a mapping with 'nodes' and 'events'")
    return trace_from_dict(data)


def random_trace(
    seed: int,
    nodes: int = 3,
    duration_s: float = 180.0,
    mean_up_s: float = 60.0,
    mean_down_s: float = 20.0,
    min_alive: int = 1,
    protect: Iterable[int] = (),
    notice_s: float | None = None,
) -> Trace:
    """A seeded trace like the AzureML low-priority run: each node is up for an exponential time
    (mean ``mean_up_s``, at least a quarter of it), then preempted and back after another (mean
    ``mean_down_s``, at least a quarter of it).

    A preemption that would leave fewer than ``min_alive`` nodes up is postponed until another node
    returns. Nodes in ``protect`` are never preempted (for example the node hosting a c10d store).
    With ``notice_s`` preemptions are SIGTERMs with that notice; without, SIGKILLs.
    """
    if not 1 <= min_alive <= nodes:
        raise TraceError(f"min_alive must be between 1 and nodes={nodes}, got {min_alive}")
    rng = random.Random(seed)
    protected = set(protect)
    # Next planned change per node: (time, node); a node is up at t=0.
    next_change = {n: rng.expovariate(1.0 / mean_up_s) for n in range(nodes) if n not in protected}
    up = set(range(nodes))
    events: list[TraceEvent] = []
    while next_change:
        node, at = min(next_change.items(), key=lambda kv: (kv[1], kv[0]))
        if at > duration_s:
            break
        at = round(at, 1)
        if node in up:
            if len(up) - 1 < min_alive:
                # Postpone until just after the next return of another node.
                later = [t for n, t in next_change.items() if n not in up]
                next_change[node] = (min(later) if later else at + mean_up_s) + 0.5
                continue
            action = Action.KILL if notice_s is None else Action.TERM
            events.append(TraceEvent(at, action, node, notice_s or 0.0))
            up.discard(node)
            next_change[node] = at + max(0.25 * mean_down_s, rng.expovariate(1.0 / mean_down_s))
        else:
            events.append(TraceEvent(at, Action.START, node))
            up.add(node)
            next_change[node] = at + max(0.25 * mean_up_s, rng.expovariate(1.0 / mean_up_s))
    return Trace(nodes=nodes, events=tuple(events))
