"""Seeded churn traces for the soak: every kind of membership event, each one gated on training progress.

:func:`churn_trace` draws ``events`` events over ``max_nodes`` slots plus ``spares`` slots beyond
the launcher's MAX: SIGKILL of any node (node 0, the first store host, included), SIGKILL of one
worker of a node (its agent starts it again), SIGTERM with a
notice (to the agent, or to every process of the node), SIGSTOP followed by a SIGKILL or a SIGCONT,
whole-job kill followed by a restart of the same nodes with the same command, nodes returning at the
original endpoint, and spare nodes started while the job is full. Each event that is not a follow-up
waits for the job's next step milestone (``after_step``, spread evenly between ``first_step`` and
``last_step``) and a random gap, so every event lands on a training world, however fast or slow the
machine is. Follow-ups (the kill after a ``stop``, the restart after a ``kill_all``) wait only their
gap: nothing trains meanwhile.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from dataclasses import dataclass

from elastrain.chaos.trace import Action, Trace, TraceEvent
from elastrain.errors import TraceError


@dataclass(frozen=True)
class ChurnConfig:
    events: int = 50
    max_nodes: int = 3
    """The launcher's MAX; the first ``max_nodes`` slots are up at the start."""
    spares: int = 2
    """Slots beyond MAX, down at the start: starting one while the job is full makes a spare."""
    first_step: int = 5
    last_step: int = 100
    """The first and last progress milestones; keep ``last_step`` below the job's max steps."""
    mean_gap_s: float = 3.0
    freeze_s: tuple[float, float] = (2.0, 8.0)
    """How long a stopped node stays frozen before its kill or cont."""
    down_s: tuple[float, float] = (1.0, 5.0)
    """How long the whole job stays down after a kill_all."""
    notice_s: tuple[float, float] = (0.0, 5.0)
    """SIGTERM notice before the SIGKILL of whatever is left."""
    wake_chance: float = 0.3
    """Chance that a stopped node is continued instead of killed."""

    def __post_init__(self) -> None:
        if self.events < 1:
            raise TraceError(f"events must be at least 1, got {self.events}")
        if self.max_nodes < 1 or self.spares < 0 or self.max_nodes + self.spares < 2:
            raise TraceError("churn needs at least 2 node slots (max_nodes >= 1, spares >= 0)")
        if not 0 <= self.first_step <= self.last_step:
            raise TraceError(f"need 0 <= first_step <= last_step, got {self.first_step}..{self.last_step}")


def churn_trace(seed: int, config: ChurnConfig | None = None) -> Trace:
    """A seeded trace of exactly ``config.events`` events; at least one node is up after each one
    but a ``kill_all`` (whose ``restart_all`` follows), and no node is left stopped at the end."""
    cfg = config or ChurnConfig()
    rng = random.Random(seed)
    # SIGTERMs alternate between the agent alone and every process of the node, from a side draw (a seed's trace is
    # otherwise what it was before there were two kinds).
    whole = random.Random(f"{seed}-whole").random() < 0.5
    slots = cfg.max_nodes + cfg.spares
    up = set(range(cfg.max_nodes))
    events: list[TraceEvent] = []

    def milestone() -> int:
        i = len(events)
        return cfg.first_step + round((cfg.last_step - cfg.first_step) * i / max(1, cfg.events - 1))

    def gated(action: Action, node: int, notice_s: float = 0.0) -> TraceEvent:
        gap = round(rng.uniform(0.5, 2 * cfg.mean_gap_s), 1)
        return TraceEvent(0.0, action, node, notice_s=notice_s, after_step=milestone(), gap_s=gap)

    def span(bounds: tuple[float, float]) -> float:
        return round(rng.uniform(*bounds), 1)

    while len(events) < cfg.events:
        left = cfg.events - len(events)
        down = sorted(set(range(slots)) - up)
        choices: list[tuple[str, float]] = []
        if len(up) >= 2:
            choices += [("kill", 3.0), ("term", 2.0)]
            if left >= 2:
                choices.append(("stop", 1.5))
        if up:
            choices.append(("crash", 1.2))  # the node stays up: the last one may crash too
        if down:
            bonus = 3.0 if len(up) < 2 else (1.5 if len(up) >= cfg.max_nodes else 0.0)  # rescue; or a spare
            choices.append(("start", 2.0 + 2.0 * len(down) / slots + bonus))
        if left >= 2 and len(events) >= 1 and all(e.action is not Action.KILL_ALL for e in events[-4:]):
            choices.append(("kill_all", 0.7))
        kind = rng.choices([c for c, _ in choices], weights=[w for _, w in choices])[0]
        if kind == "start":
            node = rng.choice(down)
            events.append(gated(Action.START, node))
            up.add(node)
        elif kind == "kill_all":
            was_up = tuple(sorted(up))
            events.append(gated(Action.KILL_ALL, -1))
            events.append(TraceEvent(0.0, Action.RESTART_ALL, -1, gap_s=span(cfg.down_s), nodes=was_up))
        elif kind == "crash":
            events.append(gated(Action.CRASH, rng.choice(sorted(up))))
        else:
            node = rng.choice(sorted(up))
            if kind == "kill":
                events.append(gated(Action.KILL, node))
                up.discard(node)
            elif kind == "term":
                term = gated(Action.TERM, node, notice_s=span(cfg.notice_s))
                events.append(dataclasses.replace(term, whole=whole))
                whole = not whole
                up.discard(node)
            else:
                events.append(gated(Action.STOP, node))
                wake = rng.random() < cfg.wake_chance
                events.append(TraceEvent(0.0, Action.CONT if wake else Action.KILL, node, gap_s=span(cfg.freeze_s)))
                if not wake:
                    up.discard(node)
    return Trace(nodes=slots, events=tuple(events), max_nodes=cfg.max_nodes)


def coverage(trace: Trace) -> Counter[str]:
    """What a trace exercises: each action, plus ``term_whole`` (a SIGTERM to every process of a node),
    ``store_host_down`` (node 0 killed, termed or frozen),
    ``return`` (a node started again after it was up before) and ``spare`` (a node started while
    ``max_nodes`` or more were up already)."""
    out: Counter[str] = Counter()
    up = set(trace.start)
    seen = set(trace.start)
    for e in trace.events:
        out[e.action.value] += 1
        out["term_whole"] += e.whole
        if e.action is Action.START:
            if len(up) >= trace.launcher_max:
                out["spare"] += 1
            if e.node in seen:
                out["return"] += 1
            up.add(e.node)
            seen.add(e.node)
        elif e.action is Action.RESTART_ALL:
            up |= set(e.nodes)
            out["return"] += len(e.nodes)
        elif e.action is Action.KILL_ALL:
            out["store_host_down"] += 0 in up
            up.clear()
        elif e.action in (Action.KILL, Action.TERM, Action.STOP):
            if e.node == 0 and e.node in up:
                out["store_host_down"] += 1
            up.discard(e.node)
        elif e.action is Action.CONT:
            up.add(e.node)
    return out
