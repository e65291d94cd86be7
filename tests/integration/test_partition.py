"""Network partitions on real addresses (issue 12, item 4): nodes in their own network namespaces.

Each node is one ``elastrain-run`` agent with one gloo worker (tests/workers/partition_worker.py), run
inside its own namespace (tests/support/netns.py) with its own address (10.213.0.x, never 127.0.0.1), the c10d
rendezvous hosted by node 0 and a checkpoint root shared through the filesystem (so the fencing
generation applies). A cut moves nodes onto another bridge: packets between the sides are silently
lost, as in a real split; nothing is refused, so no node can prove another dead.

The tests check behaviour from the workers' step lines (time, world, world size, round, generation):
the majority side trains on, the cut-off side stops its workers and forms no world, the nodes rejoin one
world after the heal, and never do two worlds train at overlapping times. Bounds are generous and only
stop hangs; when an assertion fails, the message holds the whole timeline and each node's events.

They need root with CAP_SYS_ADMIN and CAP_NET_ADMIN (``ip netns add``) and iproute2; where the kernel
refuses, they skip with the reason (and so fail in CI, which must run them). Run them alone with
``python -m pytest tests/integration/test_partition.py``; about a minute per scenario.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import netns
from support.netns import Network
from support.processes import alive, elastrain_cmd, printed_fields, reaped, spawn, wait_for

from elastrain.log import format_event, parse_event_line

SCRIPTS = Path(__file__).resolve().parents[1] / "workers"
SCRIPT = str(SCRIPTS / "partition_worker.py")
SESSION_SCRIPT = str(SCRIPTS / "partition_session_worker.py")
"""Under ``--live true``: a Session job whose workers regroup in place (same lines, read from the current round)."""
PORT = 29400  # every node namespace has its own ports: a fixed one never collides
HEARTBEAT_TIMEOUT_S = 4.0
BOUND = 90.0  # only stops hangs: three cold starts of torch on a loaded 2-core machine take ~20 s
STOP_BOUND = HEARTBEAT_TIMEOUT_S + 20.0
"""A cut-off node must have stopped its workers by then: far sooner than their gloo timeout (PW_TIMEOUT),
so only the agent (told by its rendezvous) can have stopped them, not a collective that timed out."""
WORKER_TIMEOUT_S = 120.0
LIVE_COLLECTIVE_TIMEOUT_S = 60.0
"""Live mode: the majority's workers must leave the collective the cut-off peer never joins long before this (the
watchdog gives it up on the agent's notice); gloo then ends it at this timeout, which a worker waits for at exit."""
SETTLE_S = 3 * HEARTBEAT_TIMEOUT_S + 12.0
"""How long a split with no majority is watched before the heal: long enough for either side to detect the
split (heartbeat timeout), fail the store over (read and store-lost timeouts) and claim a generation."""

MAX_EVENT_LINES = 60
"""Per node in a failure report; repeats of one event in a row are folded into one line with a count."""

SEGMENT_ENDS = {
    "workers_restarting", "rendezvous_joined", "rendezvous_done", "world_superseded", "agent_left",
    "job_succeeded", "job_failed", "rendezvous_store_lost", "node_left", "agent_signalled",
}  # fmt: skip
"""Events after which a node's workers of the last round no longer run."""


class SplitBrain(AssertionError):
    """Two worlds of the job trained side by side, or a cut-off minority formed its own world."""


@dataclass(frozen=True)
class Step:
    node: int
    t: float
    step: int
    rank: int
    ws: int
    round: str
    gen: str
    world: str
    """The process group: its master address and port and the round (unique per world)."""


class NodeLog:
    """What one node's log says: its workers' steps and its agent's events (also for logs of past runs)."""

    def __init__(self, index: int, addr: str, log: Path) -> None:
        self.index = index
        self.addr = addr
        self.log = log

    def exit_code(self) -> int | None:
        """The agent's exit status; ``None`` while it runs (a replayed log counts as exited, status 0)."""
        return 0

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def steps(self) -> list[Step]:
        out = []
        for line in self.text().splitlines():
            if line.startswith("PW_STEP"):
                f = printed_fields(line)
                out.append(
                    Step(
                        node=self.index,
                        t=float(f["t"]),
                        step=int(f["step"]),
                        rank=int(f["rank"]),
                        ws=int(f["ws"]),
                        round=f["round"],
                        gen=f["gen"],
                        world=f"{f['world']}/r{f['round']}",
                    )
                )
        return out

    def events(self, name: str | None = None) -> list[dict[str, str]]:
        out = [parse_event_line(line) for line in self.text().splitlines()]
        return [e for e in out if e is not None and (name is None or e.get("event") == name)]

    def worker_pids(self, start: float = 0.0, end: float = float("inf")) -> list[int]:
        """The workers this agent started between ``start`` and ``end`` (its ``workers_started`` events)."""
        return [
            int(p)
            for e in self.events("workers_started")
            if start <= float(e["t"]) < end
            for p in e.get("pids", "").split(",")
            if p
        ]

    def segments(self) -> list[tuple[str, float, float]]:
        """(world, workers started, workers stopped) from this agent's events; the world named as in Step.

        A segment ends at the agent's next step in the rendezvous (or its exit); workers blocked in a
        collective still count as running, so this over-approximates how long a world lived on a node.
        """
        out: list[tuple[str, float, float]] = []
        world, start = "", 0.0
        last = 0.0
        for e in self.events():
            t = float(e.get("t", 0.0))
            last = max(last, t)
            if start and e["event"] in SEGMENT_ENDS:
                out.append((world, start, t))
                start = 0.0
            if e["event"] == "rendezvous_done":
                world = f"{e.get('master')}/r{e.get('round')}"
            elif e["event"] in ("workers_started", "regroup_announced") and world:
                start = t  # regroup_announced: live workers moved into the round in place
        if start:
            out.append((world, start, time.time() if self.exit_code() is None else last))
        return out


class Node(NodeLog):
    """One elastrain-run agent inside node ``index``'s namespace (the pattern of tests/e2e/test_membership.py)."""

    def __init__(self, net: Network, index: int, tmp: Path, stop_file: Path, live: bool = False) -> None:
        super().__init__(index, net.nodes[index].addr, tmp / f"node{index}.log")
        n = len(net.nodes)
        conf = f"is_host={'1' if index == 0 else '0'},heartbeat_timeout={HEARTBEAT_TIMEOUT_S}"
        cmd = elastrain_cmd(
            "--nnodes", f"1:{n}",
            "--nproc-per-node", "1",
            "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{net.nodes[0].addr}:{PORT}",
            "--rdzv-id", "partition-test",
            "--rdzv-conf", conf,
            "--local-addr", self.addr,
            "--max-restarts", "3",
            "--checkpoint-dir", str(tmp / "ckpt"),
            *(("--live", "true", "--collective-timeout", str(LIVE_COLLECTIVE_TIMEOUT_S)) if live else ()),
            SESSION_SCRIPT if live else SCRIPT,
        )  # fmt: skip
        env = {
            "PW_STOP_FILE": str(stop_file),
            "PW_TIMEOUT": str(WORKER_TIMEOUT_S),
            "GLOO_SOCKET_IFNAME": netns.NODE_IF,  # the hostname resolves to the host's address, not ours
        }
        self.proc = spawn(net.cmd(index, cmd), self.log, env=env)

    def exit_code(self) -> int | None:
        return self.proc.poll()


class History:
    """The nodes' logs, the times of cuts and heals, and the checks over what the nodes did (Jepsen-style)."""

    def __init__(self, nodes: Sequence[NodeLog], t0: float) -> None:
        self.nodes = nodes
        self.t0 = t0
        self.marks: list[tuple[float, str]] = []
        self.cut_off: dict[int, float] = {}
        """Nodes cut off from the majority, and since when: they must complete no round meanwhile."""

    def mark(self, what: str, t: float | None = None) -> float:
        t = time.time() if t is None else t
        self.marks.append((t, what))
        return t

    def steps(self) -> list[Step]:
        return sorted((s for n in self.nodes for s in n.steps()), key=lambda s: s.t)

    def worlds(self) -> dict[str, tuple[float, float, set[int], set[int], set[str]]]:
        """world -> (first step, last step, nodes that stepped in it, world sizes, generations)."""
        out: dict[str, tuple[float, float, set[int], set[int], set[str]]] = {}
        for s in self.steps():
            first, last, nodes, sizes, gens = out.get(s.world, (s.t, s.t, set(), set(), set()))
            out[s.world] = (min(first, s.t), max(last, s.t), nodes | {s.node}, sizes | {s.ws}, gens | {s.gen})
        return out

    def report(self) -> str:
        """The timeline (times relative to the start), every world, and each node's key events."""
        rel = self.t0
        lines = ["marks: " + ", ".join(f"{t - rel:.1f}s {what}" for t, what in self.marks), "worlds:"]
        for world, (first, last, nodes, sizes, gens) in sorted(self.worlds().items(), key=lambda kv: kv[1][0]):
            lines.append(
                f"  {world}: nodes={sorted(nodes)} ws={sorted(sizes)} gen={sorted(gens)} "
                f"steps {first - rel:.1f}s..{last - rel:.1f}s"
            )
        for n in self.nodes:
            rc = n.exit_code()
            lines.append(f"--- node{n.index} ({n.addr}) exit={rc} ---")
            shown: list[list[str]] = []  # [event name, line, repeats]
            for e in n.events():
                t = float(e.get("t", rel))
                rest = " ".join(f"{k}={v}" for k, v in e.items() if k not in ("event", "t", "pid"))
                if shown and shown[-1][0] == e["event"]:
                    shown[-1][2] = str(int(shown[-1][2]) + 1)
                    continue
                shown.append([e["event"], f"  {t - rel:7.1f}s {e['event']} {rest}"[:300], "1"])
            for _, line, repeats in shown[-MAX_EVENT_LINES:]:
                lines.append(line + (f"  (x{repeats} in a row)" if repeats != "1" else ""))
            tail = [ln for ln in n.text().splitlines() if not ln.startswith("PW_STEP")][-12:]
            lines.extend("  | " + ln[:300] for ln in tail)
        return "\n".join(lines)

    def fail(self, what: str, kind: type[AssertionError] = AssertionError) -> AssertionError:
        return kind(f"{what}\n{self.report()}")

    def wait(self, predicate: Callable[[], bool], what: str, timeout: float = BOUND) -> None:
        """Until ``predicate``; fails at once (not at the timeout) if two worlds train side by side."""

        def check_then(predicate: Callable[[], bool] = predicate) -> bool:
            self.check_one_world_at_a_time()
            for i, since in self.cut_off.items():
                self.check_no_round_alone(i, since, time.time())
            return predicate()

        try:
            wait_for(check_then, timeout, 0.2, what)
        except SplitBrain:
            raise
        except AssertionError:
            raise self.fail(f"timed out after {timeout:.0f}s waiting for: {what}") from None

    def wait_world(self, members: list[int], after: float, what: str, steps: int = 3) -> None:
        """Until ``members`` took ``steps`` steps together in one world of exactly their size after ``after``."""

        def together() -> bool:
            count: dict[str, dict[int, int]] = {}
            for s in self.steps():
                if s.t > after and s.ws == len(members):
                    per_node = count.setdefault(s.world, {})
                    per_node[s.node] = per_node.get(s.node, 0) + 1
            return any(set(c) == set(members) and min(c.values()) >= steps for c in count.values())

        self.wait(together, what)

    def event_worlds(self) -> dict[str, tuple[float, float, set[int]]]:
        """world -> (first workers started, last workers stopped, nodes), from the agents' events."""
        out: dict[str, tuple[float, float, set[int]]] = {}
        for n in self.nodes:
            for world, start, end in n.segments():
                a, b, nodes = out.get(world, (start, end, set()))
                out[world] = (min(a, start), max(b, end), nodes | {n.index})
        return out

    def check_one_world_at_a_time(self) -> None:
        """No two worlds trained at overlapping times: from the steps, and from the agents' events.

        Steps: two worlds' step intervals never overlap (worlds sharing a node cannot, disjoint ones must
        not). Events: two worlds with disjoint nodes never had workers running at the same time.
        """
        spans_ev = sorted(self.event_worlds().items(), key=lambda kv: kv[1][0])
        for i, (wa, (a0, a1, na)) in enumerate(spans_ev):
            for wb, (b0, b1, nb) in spans_ev[i + 1 :]:
                if not na & nb and b0 < a1 and a0 < b1:
                    raise self.fail(
                        f"split brain (agents' events): world {wa} (nodes {sorted(na)}) and world {wb} "
                        f"(nodes {sorted(nb)}) ran workers at the same time, "
                        f"{max(a0, b0) - self.t0:.1f}s..{min(a1, b1) - self.t0:.1f}s",
                        SplitBrain,
                    )
        spans = sorted(self.worlds().items(), key=lambda kv: kv[1][0])
        for i, (wa, (a0, a1, na, _, _)) in enumerate(spans):
            for wb, (b0, b1, nb, _, _) in spans[i + 1 :]:
                if b0 < a1 and a0 < b1:
                    raise self.fail(
                        f"split brain (workers' steps): world {wa} (nodes {sorted(na)}) and world {wb} "
                        f"(nodes {sorted(nb)}) trained at the same time, "
                        f"{max(a0, b0) - self.t0:.1f}s..{min(a1, b1) - self.t0:.1f}s",
                        SplitBrain,
                    )

    def check_no_world_without(self, required: set[int], start: float, end: float, what: str) -> None:
        """Between ``start`` and ``end`` every step ran in a world that holds all of ``required``."""
        worlds = self.worlds()
        for s in self.steps():
            if start < s.t < end and not required <= worlds[s.world][2]:
                raise self.fail(
                    f"{what}: node{s.node} stepped at {s.t - self.t0:.1f}s in world {s.world} "
                    f"(nodes {sorted(worlds[s.world][2])}, ws {s.ws}) that lacks nodes {sorted(required)}"
                )

    def check_no_step_lost(self) -> None:
        """Live mode: every regroup continued from the newest step trained before it, or the one before (a step
        whose all-reduce a departed peer broke); never from a left-behind node's older state."""
        for n in self.nodes:
            for e in n.events("regrouped"):
                t, agreed = float(e["t"]), int(e["step"])
                newest = max((s.step for s in self.steps() if s.t < t), default=0)
                if agreed < newest - 1:
                    raise self.fail(
                        f"node{n.index}'s regroup into round {e.get('round')} at {t - self.t0:.1f}s continued from "
                        f"step {agreed}, but step {newest} had been trained: {newest - agreed} steps lost"
                    )

    def check_no_round_alone(self, i: int, start: float, end: float) -> None:
        """Node ``i``, cut off from the majority, completed no rendezvous round between ``start`` and ``end``."""
        rounds = [e for e in self.nodes[i].events("rendezvous_done") if start < float(e["t"]) < end]
        if rounds:
            e = rounds[0]
            raise self.fail(
                f"node{i} was cut off but completed round {e.get('round')} with nodes={e.get('nodes')} "
                f"(world size {e.get('world_size')}, master {e.get('master')}) at {float(e['t']) - self.t0:.1f}s: "
                "a world of its own",
                SplitBrain,
            )


class Scenario(History):
    """One test's nodes, started in the namespaces of ``net``, and the cuts and heals done to them."""

    def __init__(self, net: Network, tmp: Path, live: bool = False) -> None:
        self.net = net
        self.live = live
        self.stop_file = tmp / "stop"
        t0 = time.time()
        self.agents: list[Node] = []
        for i in range(len(net.nodes)):
            self.agents.append(Node(net, i, tmp, self.stop_file, live))
            if i == 0:
                time.sleep(0.5)  # the store host first, as a launcher would
        super().__init__(self.agents, t0)

    def isolate(self, i: int) -> float:
        """Cut node ``i`` off from the others; returns the time of the cut."""
        self.net.isolate(i)
        t = self.mark(f"node{i} cut off")
        self.cut_off[i] = t
        return t

    def heal(self) -> float:
        """Heal every cut; returns the time of the heal (after checking the cut-off nodes formed no round)."""
        t = self.mark("healed")
        for i, since in self.cut_off.items():
            self.check_no_round_alone(i, since, t)
        self.cut_off.clear()
        self.net.heal()
        return t

    def wait_workers_stopped(self, i: int, cut: float) -> None:
        """Node ``i``'s workers of before the ``cut`` are gone within STOP_BOUND of it, none started since."""
        node = self.nodes[i]
        before = node.worker_pids(end=cut)
        if not before:
            raise self.fail(f"node{i} never logged workers_started before the cut")
        try:
            wait_for(lambda: not alive(before), max(cut + STOP_BOUND - time.time(), 0.5), 0.2, "workers to stop")
        except AssertionError:
            raise self.fail(
                f"node{i} was cut off but its workers {alive(before)} still ran {time.time() - cut:.0f}s after the cut "
                f"(heartbeat timeout {HEARTBEAT_TIMEOUT_S}s): its agent did not stop them"
            ) from None
        self.check_no_round_alone(i, cut, time.time())

    def finish(self) -> None:
        """Stop the job through the stop file; every agent must exit 0."""
        if self.live:  # a Session job stops at one step on every rank: a few steps ahead of the newest
            self.stop_file.write_text(str(max((s.step for s in self.steps()), default=0) + 10))
        else:
            self.stop_file.touch()
        for n in self.agents:
            try:
                rc = n.proc.wait(timeout=BOUND)
            except subprocess.TimeoutExpired:
                raise self.fail(f"node{n.index} did not exit within {BOUND:.0f}s of the stop file") from None
            if rc != 0:
                raise self.fail(f"node{n.index} exited {rc}")


@pytest.fixture
def make_network(request: pytest.FixtureRequest) -> Callable[[int], Network]:
    """Networks of N node namespaces, all deleted at teardown (finalizers run on failure too)."""
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    netns.remove_stale()

    def make(n: int) -> Network:
        net = Network(n)
        request.addfinalizer(net.close)
        return net

    return make


@pytest.fixture
def scenario(make_network: Callable[[int], Network], tmp_path: Path) -> Iterator[Callable[..., Scenario]]:
    """Start a Scenario of N nodes; every process it started is killed at teardown, by pid."""
    started: list[Scenario] = []

    def start(n: int, live: bool = False) -> Scenario:
        sc = Scenario(make_network(n), tmp_path, live)
        started.append(sc)
        return sc

    try:
        yield start
    finally:
        for sc in started:
            with reaped(*(n.proc for n in sc.agents)):
                pass


# -- the helper itself --------------------------------------------------------------------------------
def _reaches(net: Network, src: int, dst: int) -> bool:
    code = f"import socket; socket.create_connection(({net.nodes[dst].addr!r}, {PORT}), timeout=1).close()"
    return subprocess.run(net.cmd(src, [sys.executable, "-c", code]), capture_output=True, timeout=30).returncode == 0


def test_netns_cut_and_heal(make_network: Callable[[int], Network]) -> None:
    net = make_network(3)
    names = {net.hub, *(node.ns for node in net.nodes)}
    assert names <= set(netns.namespaces())
    server = subprocess.Popen(
        net.cmd(0, [sys.executable, "-c", _ECHO_SERVER.format(port=PORT)]), stdout=subprocess.PIPE
    )
    with reaped(server):
        assert server.stdout is not None and server.stdout.readline().strip() == b"listening"
        assert _reaches(net, 1, 0) and _reaches(net, 2, 0)
        net.isolate(2)
        assert _reaches(net, 1, 0) and not _reaches(net, 2, 0)
        net.heal()
        assert _reaches(net, 2, 0)
        net.partition([0, 2], [1])
        assert _reaches(net, 2, 0) and not _reaches(net, 1, 0)
        net.heal()
        net.link_down(1)
        assert not _reaches(net, 1, 0) and _reaches(net, 2, 0)
        net.link_up(1)
        wait_for(lambda: _reaches(net, 1, 0), 10, 0.2, "node 1 to reach node 0 after link up")
        # The host's own namespace got no interface or address of the private range.
        host = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, timeout=20).stdout
        assert netns.SUBNET not in host, host
    net.close()
    assert not names & set(netns.namespaces())
    net.close()  # idempotent


_ECHO_SERVER = """
import socket
s = socket.socket(); s.bind(("0.0.0.0", {port})); s.listen(16); print("listening", flush=True)
while True:
    c, _ = s.accept(); c.close()
"""


def test_stale_namespaces_are_removed() -> None:
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    old = f"{netns.PREFIX}-{int(time.time()) - 7200}-1-0-hub"
    subprocess.run(["ip", "netns", "add", old], check=True, timeout=20)
    try:
        fresh = Network(1)
        try:
            removed = netns.remove_stale()
            assert old in removed and old not in netns.namespaces()
            assert fresh.hub in netns.namespaces()  # young ones (other runs' too) stay
        finally:
            fresh.close()
    finally:
        subprocess.run(["ip", "netns", "delete", old], capture_output=True, timeout=20)


# -- the history checks, on made-up logs ---------------------------------------------------------------
def _history(tmp: Path, logs: dict[int, list[str]]) -> History:
    nodes = []
    for i, lines in logs.items():
        path = tmp / f"node{i}.log"
        path.write_text("\n".join(lines) + "\n")
        nodes.append(NodeLog(i, f"{netns.SUBNET}.{i + 1}", path))
    return History(nodes, 1000.0)


def _step(t: float, ws: int, rnd: int, world: str) -> str:
    return f"PW_STEP t={t:.3f} step=1 rank=0 ws={ws} round={rnd} gen={rnd} world={world} pid=1"


def _world(t: float, rnd: int, master: str, nodes: int) -> list[str]:
    return [
        format_event("rendezvous_done", round=rnd, nodes=nodes, master=master, t=t),
        format_event("workers_started", round=rnd, pids="1", t=t + 0.01),
    ]


def test_history_one_world_after_another_passes(tmp_path: Path) -> None:
    a, b = "10.213.0.1:1000", "10.213.0.1:2000"
    old = [_step(1001 + k * 0.1, 3, 0, a) for k in range(5)]
    new = [_step(1010 + k * 0.1, 2, 1, b) for k in range(5)]
    restart = [format_event("workers_restarting", t=1009.0)]
    h = _history(
        tmp_path,
        {
            0: [*_world(1000, 0, a, 3), *old, *restart, *_world(1009.5, 1, b, 2), *new],
            1: [*_world(1000, 0, a, 3), *old, *restart, *_world(1009.5, 1, b, 2), *new],
            2: [*_world(1000, 0, a, 3), *old],  # cut off: its workers hang in the old world
        },
    )
    h.check_one_world_at_a_time()
    h.check_no_world_without({0, 1}, 1005, 1020, "minority world")
    h.check_no_round_alone(2, 1005, 1020)


def test_history_finds_two_worlds_at_once(tmp_path: Path) -> None:
    a, b = "10.213.0.1:1000", "10.213.0.3:3000"
    h = _history(
        tmp_path,
        {
            0: [*_world(1000, 1, a, 2), *(_step(1001 + k, 2, 1, a) for k in range(10))],
            1: [*_world(1000, 1, a, 2), *(_step(1001 + k, 2, 1, a) for k in range(10))],
            2: [*_world(1005, 1, b, 1), *(_step(1006 + k, 1, 1, b) for k in range(10))],
        },
    )
    with pytest.raises(SplitBrain, match=r"world 10.213.0.3:3000/r1 \(nodes \[2\]\)"):
        h.check_one_world_at_a_time()
    with pytest.raises(AssertionError, match="node2 stepped"):
        h.check_no_world_without({0, 1}, 1000, 1020, "minority world")
    with pytest.raises(SplitBrain, match="node2 was cut off but completed round 1"):
        h.check_no_round_alone(2, 1000, 1020)


def test_history_finds_two_worlds_from_events_alone(tmp_path: Path) -> None:
    # The second world's workers never stepped (say, they hung in init): the agents' events still tell.
    a, b = "10.213.0.1:1000", "10.213.0.3:3000"
    end = format_event("job_succeeded", t=1010.0)
    h = _history(tmp_path, {0: [*_world(1000, 1, a, 1), end], 1: [*_world(1001, 1, b, 1), end]})
    with pytest.raises(SplitBrain, match="agents' events"):
        h.check_one_world_at_a_time()


# -- partitions --------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("live", [False, True], ids=["restart", "live"])
def test_minority_node_cut_off_stops_and_rejoins(scenario: Callable[..., Scenario], live: bool) -> None:
    sc = scenario(3, live)
    sc.wait_world([0, 1, 2], sc.t0, "all three nodes train in one world")

    cut = sc.isolate(2)
    sc.wait_world([0, 1], cut, "the majority {0,1} trains on at world size 2")
    if not live:
        sc.wait_workers_stopped(2, cut)
    # Live mode keeps the cut-off node's workers alive while its agent looks for a round (they would regroup
    # in place into one); blocked in a collective of the old round, they train nothing: no step of theirs
    # lands in a world without the majority (below), and the node completes no round alone (checked by wait).
    healed_at = sc.heal()
    sc.check_no_world_without({0, 1}, cut, healed_at, "the cut-off node 2 trained in a world of its own")

    sc.wait_world([0, 1, 2], healed_at, "node 2 rejoins: all three train in one world again")
    sc.check_one_world_at_a_time()
    sc.finish()
    sc.check_one_world_at_a_time()
    if live:
        sc.check_no_step_lost()


@pytest.mark.slow
@pytest.mark.parametrize("live", [False, True], ids=["restart", "live"])
def test_store_host_cut_off_fails_over_and_rejoins(scenario: Callable[..., Scenario], live: bool) -> None:
    sc = scenario(3, live)
    sc.wait_world([0, 1, 2], sc.t0, "all three nodes train in one world")

    cut = sc.isolate(0)  # the store host
    sc.wait_world([1, 2], cut, "{1,2} fail over and train on at world size 2")
    if not live:  # live: the cut-off node's workers live on, blocked (see the minority test)
        sc.wait_workers_stopped(0, cut)
    healed_at = sc.heal()
    sc.check_no_world_without({1, 2}, cut, healed_at, "the cut-off store host trained in a world of its own")

    sc.wait_world([0, 1, 2], healed_at, "node 0 rejoins the running job: all three train in one world")
    sc.check_one_world_at_a_time()
    sc.finish()
    sc.check_one_world_at_a_time()
    if live:
        sc.check_no_step_lost()


@pytest.mark.slow
@pytest.mark.parametrize("live", [False, True], ids=["restart", "live"])
def test_even_split_trains_on_at_most_one_side(scenario: Callable[..., Scenario], live: bool) -> None:
    sc = scenario(4, live)
    sc.wait_world([0, 1, 2, 3], sc.t0, "all four nodes train in one world")

    cut = sc.mark("split {0,1} | {2,3}")
    sc.net.partition([0, 1], [2, 3])
    time.sleep(SETTLE_S)  # watch: either side may train on, or neither; never both
    healed_at = sc.mark("healed")
    sc.net.heal()
    sc.check_one_world_at_a_time()
    worlds = sc.worlds()  # worlds formed after the cut (a step of the old world may land just after it)
    during = [s for s in sc.steps() if cut < s.t < healed_at and worlds[s.world][0] > cut]
    trained = [side for side in ({0, 1}, {2, 3}) if any(s.node in side for s in during)]
    if len(trained) > 1:
        raise sc.fail("split brain: both sides of the 2|2 split trained while it lasted")
    if trained:
        sc.check_no_world_without(trained[0], cut, healed_at, "a mixed world across the split")

    sc.wait_world([0, 1, 2, 3], healed_at, "after the heal all four train in one world")
    sc.check_one_world_at_a_time()
    sc.finish()
    sc.check_one_world_at_a_time()
    if live:
        sc.check_no_step_lost()
