"""What a membership change costs the running workers as the model grows: join, SIGKILL, spare promotion.

    python bench/state_transfer.py                          # 25M, 100M and 250M parameters, every scenario
    python bench/state_transfer.py --sizes 100 --scenarios join

Per model size (a Session script, bench/workers/transfer_worker.py: 2048x2048 linear layers with AdamW, about
12 bytes of state per parameter) and per scenario, local "nodes" (elastrain-run agents with one gloo worker each,
``--live true``, the default) train until rank 0 has a steady step time, then:

- ``join``: two nodes train (``--nnodes 2:3``); a third node starts, warms up, and receives the state;
- ``kill``: three nodes train; one SIGKILLs its agent and worker at the end of a step's first backward pass; the
  survivors regroup (a survivor that completed one step more than another rolls back: it receives the agreed state);
- ``spare``: two nodes train (``--nnodes 2:2``) and a third waits as a spare; one training node is SIGKILLed and
  the spare is promoted: it receives the state;
- ``crash``: one node of two workers (``--nproc-per-node 2``, alone in its job); rank 1's worker SIGKILLs itself at
  the end of a step's first backward pass; its agent replaces it alone and rank 0, kept running, sends it the state
  (torch's agent would restart both and read the checkpoint);
- ``none``: three nodes train and nothing happens: the same statistics over as many steps, the box's own noise
  (on two cores shared by three processes a step varies by a second at 250M with nothing happening; the longest
  of several gaps less their median is that noise, not a cost of the change).

After the table it prints the issue's criteria, each with the figures it reads and whether this run met it; for a
kill, also how much of the stall was the step in flight when the kill came (from its last step's end to the kill)
and how much came after the kill. Under the Trainer the survivors keep the micro-batches of that step they finished
(``event=trainer_lost_step_kept``: the samples kept of the step's global batch), and the new world's first step
computes only the rest; with nothing kept, the work in flight is lost on every rank. The kill's line also gives the
gap of the step the kill came in, apart from the longest gap after it (on this box a step of the new world varies by
a second or more with nothing happening).

The Session's runs go twice with ``--transfer overlap,blocking`` (the default): the optimizer's state streamed
while the first step of the new world runs (the default), and the whole state moved before it
(``overlap_state_transfer=False``: the transfer's own rate, nothing sharing the CPU or the wire with it). The
Trainer's transfer is always whole before the step.

It prints, per run: the running workers' longest gap between two completed steps around the change (rank 0's step
times; from the moment the joining node is started, or the node killed), the same from the regroup on (a joiner's
start-up, a Python process importing torch and building the model beside the running workers, takes CPU from them on
this box that on a machine of its own it would not), each less the median step after the change ("stall"), the
median step time before it, how many steps the transfer was spread over ("phases"), the bytes the state transfer
moved and its rate (the source's ``event=state_sent`` line: the phases' own time on the wire; "held up": the part of
it before training went on), and, measured in the same run between two processes on this box, the rate of a warm 1
GiB gloo broadcast (one piece, and 16 MiB pieces) and of a raw loopback socket, with the transfer's ratio to the
best gloo rate. In the same two processes, before the jobs, it measures ``send_state`` alone for the Session model
of each size (``--no-idle-rates`` skips it): into the receiver's own tensors, into memory made ready by a receive
pool, and into new memory, so the transfer's own rate is read apart from what a job's other processes take from this
machine's two cores.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastrain import binding

REPO = Path(__file__).resolve().parents[1]
WORKERS = {
    "session": str(REPO / "bench" / "workers" / "transfer_worker.py"),
    "trainer": str(REPO / "bench" / "workers" / "trainer_size_worker.py"),
}
WIRE = str(REPO / "bench" / "workers" / "wire_rate.py")
PARAMS_PER_LAYER = {"session": 2048 * 2048 + 2048, "trainer": 12 * 1024 * 1024 + 13 * 1024}
FIXED_PARAMS = {"session": 0, "trainer": 1024 * 1024 + 64 * 1024 + 2 * 1024}  # GPT-2's embeddings, final norm
STEPS_BEFORE = 6
STEPS_AFTER = 5
EVENT = re.compile(r"elastrain event=(\w+)(.*)")
FIELD = re.compile(r"(\w+)=(\S+)")


def free_port() -> int:
    return binding.free_port("127.0.0.1")


@dataclass
class Node:
    index: int
    log: Path
    proc: subprocess.Popen[bytes]

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def events(self, name: str) -> list[dict[str, str]]:
        found = []
        for m in EVENT.finditer(self.text()):
            if m.group(1) == name:
                found.append(dict(FIELD.findall(m.group(2))))
        return found

    def steps(self) -> list[tuple[int, int, float]]:
        """rank 0's completed steps: (step, world size, time)."""
        rows = re.findall(r"XW_STEP rank=0 ws=(\d+) step=(\d+) t=([\d.]+)", self.text())
        return [(int(s), int(w), float(t)) for w, s, t in rows]


@dataclass
class Job:
    script: list[str]
    out: Path
    nnodes: str
    env: dict[str, str]
    nproc: int = 1
    max_restarts: int = 0
    port: int = field(default_factory=free_port)
    nodes: list[Node] = field(default_factory=list)

    def start(self) -> Node:
        i = len(self.nodes)
        cmd = [
            sys.executable, "-m", "elastrain", "--nnodes", self.nnodes, "--nproc-per-node", str(self.nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", "xfer-bench",
            "--rdzv-conf", "last_call_timeout=1", "--max-restarts", str(self.max_restarts), "--live", "true",
            *self.script,
        ]  # fmt: skip
        log = self.out / f"node{i}.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        node = Node(i, log, proc)
        self.nodes.append(node)
        return node

    def rank0_steps(self) -> list[tuple[int, int, float]]:
        """Rank 0's completed steps in every world, by time: rank 0 may be another node's worker after a change."""
        return sorted({s for n in self.nodes for s in n.steps()}, key=lambda s: s[2])

    def wait(self, what: str, ok: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ok():
                return
            if all(n.proc.poll() is not None for n in self.nodes):
                break
            time.sleep(0.2)
        raise TimeoutError(f"{what}: not within {timeout_s:.0f} s; logs in {self.out}")

    def stop(self) -> None:
        steps = self.rank0_steps()
        (self.out / "stop").write_text(str((steps[-1][0] if steps else 0) + 2))
        deadline = time.monotonic() + 120
        for n in self.nodes:
            try:
                n.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(n.proc.pid, signal.SIGKILL)
                n.proc.wait(timeout=30)


def run(workload: str, scenario: str, size_m: int, timeout_s: float, mode: str) -> dict[str, Any]:
    layers = max(1, round((size_m * 1e6 - FIXED_PARAMS[workload]) / PARAMS_PER_LAYER[workload]))
    out = Path(tempfile.mkdtemp(prefix=f"elastrain-xfer-{workload}-{scenario}-{size_m}m-"))
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "XW_LAYERS": str(layers),
        "XT_LAYERS": str(layers),
        "XW_STOP_FILE": str(out / "stop"),
        "XW_OVERLAP": "1" if mode == "overlap" else "0",
    }
    if scenario == "kill":  # node 2 kills itself, agent and worker, in a backward pass (bench/support/node_kill.py)
        env |= {"XW_DIE_FILE": str(out / "die"), "XW_DIE_NODE": "2", "XW_DIE_LAYER": "0"}
    if scenario == "crash":  # rank 1's worker alone, in a backward pass: its node lives on
        env |= {"XW_DIE_FILE": str(out / "die"), "XW_DIE_RANK": "1", "XW_DIE_LAYER": "0"}
    script = [WORKERS[workload]] + ([str(out / "trainer")] if workload == "trainer" else [])
    nnodes = {"spare": "2:2", "crash": "1"}.get(scenario, "2:3")
    crash = scenario == "crash"  # a worker failure: it uses one of --max-restarts
    job = Job(script, out, nnodes, env, nproc=2 if crash else 1, max_restarts=3 if crash else 0)
    first = {"kill": 3, "none": 3, "crash": 1}.get(scenario, 2)  # nodes
    first_ws = first * job.nproc
    try:
        for _ in range(first):
            job.start()
            time.sleep(0.3)
        # Every first node in one world (the third may join the first two's round a moment later).
        job.wait("training", lambda: sum(1 for s in job.rank0_steps() if s[1] == first_ws) >= STEPS_BEFORE, timeout_s)
        if scenario == "spare":
            spare = job.start()
            job.wait("the spare to wait", lambda: bool(spare.events("standby")), timeout_s)
            time.sleep(2.0)
        changed_at = time.time()
        if scenario in ("kill", "crash"):  # once every first node trains in one world (not at a fixed step)
            (out / "die").write_text("")
        if scenario == "join":
            job.start()
        elif scenario == "spare":
            os.killpg(job.nodes[1].proc.pid, signal.SIGKILL)
        seen = len(job.rank0_steps())
        target_ws = 3 if scenario in ("join", "none") else 2  # crash: the same 2 workers
        job.wait(
            "training after the change",
            lambda: sum(1 for s in job.rank0_steps()[seen:] if s[1] == target_ws) >= STEPS_AFTER,
            timeout_s,
        )
    finally:
        job.stop()
    steps = job.rank0_steps()
    gaps = [(b - a, b) for (_, _, a), (_, _, b) in itertools.pairwise(steps)]
    settled = [g for g, end in gaps if end < changed_at]
    before = settled[2:] or settled  # the first steps warm up
    across = [g for g, end in gaps if end >= changed_at]
    longest = max(across) if across else float("nan")
    after = sorted(across)[:-1] or across  # the new world's steps, the one across the change left out
    median_after = statistics.median(after) if after else float("nan")
    # The same from the regroup on: what the membership change itself costs, apart from the joiner's start-up (a
    # Python process importing torch and building the model beside the running workers on this box's two cores;
    # on another machine it takes none of their CPU).
    moved = [float(e["t"]) for n in job.nodes for e in n.events("regroup_started") if float(e["t"]) >= changed_at]
    regroup_at = min(moved) if moved else changed_at
    at_regroup = [g for g, end in gaps if end >= regroup_at]
    longest_at_regroup = max(at_regroup) if at_regroup else float("nan")

    # A kill destroys the work of the step in flight on every rank (its gradients are never all-reduced): from the
    # last step's end to the kill, a loss no regroup can win back, part of the stall (the worker's XW_KILL line).
    killed_at = min((float(t) for n in job.nodes for t in re.findall(r"XW_KILL t=([\d.]+)", n.text())), default=None)
    ends = [end for _, _, end in steps if killed_at is not None and end <= killed_at]
    in_flight = killed_at - max(ends) if killed_at is not None and ends else 0.0
    after_kill = [g for g, end in gaps if end > (killed_at if killed_at is not None else changed_at)]

    def since_change(name: str) -> list[dict[str, str]]:
        return [e for n in job.nodes for e in n.events(name) if float(e.get("t", "0")) >= changed_at]

    regrouped = since_change("regrouped")
    agreed = [e for e in since_change("trainer_state_agreed") if e.get("rank") == "0"]
    sent = since_change("state_sent")
    return {
        "workload": workload,
        "scenario": scenario,
        "transfer": mode,
        "size_m": size_m,
        "params_m": round((layers * PARAMS_PER_LAYER[workload] + FIXED_PARAMS[workload]) / 1e6, 1),
        "median_step_before_s": round(statistics.median(before), 3) if before else float("nan"),
        "median_step_after_s": round(median_after, 3),
        "longest_gap_s": round(longest, 3),
        "first_gap_s": round(after_kill[0], 3) if after_kill else float("nan"),
        "stall_s": round(longest - median_after, 3),
        "regroup_gap_s": round(longest_at_regroup, 3),
        "regroup_stall_s": round(longest_at_regroup - median_after, 3),
        "in_flight_s": round(in_flight, 3),
        "phases": int(sent[-1].get("phases", 1)) if sent else 0,
        "bytes": int(sent[-1]["bytes"]) if sent else 0,
        "transfer_s": float(sent[-1]["took_s"]) if sent else 0.0,
        "blocked_s": float(sent[-1].get("blocked_s", sent[-1]["took_s"])) if sent else 0.0,
        "gb_per_s": float(sent[-1]["gb_per_s"]) if sent else 0.0,
        "rolled_back": ",".join(
            [e.get("ranks_ahead", "-") for e in regrouped] + [e.get("rolled_back", "-") for e in agreed]
        )
        or "-",
        "regroups": len(regrouped) + len(agreed),
        "kept": ",".join(e.get("samples", "?") for e in since_change("trainer_lost_step_kept")) or "-",
        "logs": str(out),
    }


def wire_rates(state_sizes: str) -> dict[str, Any]:
    """The box's gloo and socket rates, and send_state's own rate for the Session model of each of ``state_sizes``
    (millions of parameters, comma-separated), between two processes with nothing else running."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    extra = ["--state-sizes", state_sizes] if state_sizes else []
    peer = subprocess.Popen([sys.executable, WIRE, "--rank", "1", "--port", str(port), *extra], env=env)
    try:
        out = subprocess.run(
            [sys.executable, WIRE, "--rank", "0", "--port", str(port), *extra],
            env=env, capture_output=True, text=True, timeout=900, check=True,
        )  # fmt: skip
    finally:
        peer.wait(timeout=60)
    rates: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return rates


def criteria(results: list[dict[str, Any]], best_gbs: float) -> list[str]:
    """The issue's criteria, each with the figures of ``results`` it reads and whether they meet it."""
    lines = []

    def find(workload: str, scenario: str, mode: str, size: int) -> dict[str, Any] | None:
        return next(
            (r for r in results if (r["workload"], r["scenario"], r["transfer"], r["size_m"]) ==
             (workload, scenario, mode, size)),
            None,
        )  # fmt: skip

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    whole = [r for r in results if r["transfer"] == "blocking" and int(r["bytes"]) > 0]
    if whole:
        shares = [float(r["gb_per_s"]) / best_gbs for r in whole]
        figures = ", ".join(
            f"{r['workload']} {r['scenario']} {r['size_m']}M {x:.0%}" for r, x in zip(whole, shares, strict=True)
        )
        lines.append(f"rate >= 60% of gloo (the whole state before the step): {figures}: {verdict(min(shares) >= 0.6)}")
    for workload, mode in sorted({(r["workload"], r["transfer"]) for r in results}):
        tag = f"{workload} {mode}"
        join = find(workload, "join", mode, 100)
        if join is not None:
            ok = float(join["regroup_stall_s"]) <= 1.0
            lines.append(
                f"{tag}: join stall <= 1 s at 100M: {join['regroup_stall_s']:.2f} s from the regroup "
                f"({join['stall_s']:.2f} s from the joiner's start): {verdict(ok)}"
            )
        small, large = find(workload, "join", mode, 25), find(workload, "join", mode, 250)
        if small is not None and large is not None:
            a, b = float(small["regroup_stall_s"]), float(large["regroup_stall_s"])
            noise = [find(workload, "none", mode, size) for size in (25, 250)]
            floor = (
                f"; with nothing happening the same statistic reads {noise[0]['regroup_stall_s']:.2f} s and "
                f"{noise[1]['regroup_stall_s']:.2f} s"
                if noise[0] is not None and noise[1] is not None
                else ""
            )
            ok = b < 2 * max(a, 0.01)
            quiet = noise[1] is not None and b <= float(noise[1]["regroup_stall_s"])
            said = verdict(ok) if ok or not quiet else "NOT met as read; at 250M no larger than with nothing happening"
            lines.append(
                f"{tag}: join stall grows < 2x from 25M to 250M: {a:.2f} s -> {b:.2f} s "
                f"({b / max(a, 0.01):.1f}x){floor}: {said}"
            )
        kill = find(workload, "kill", mode, 100)
        if kill is not None:
            lost = float(kill.get("in_flight_s", 0.0))
            kept = kill.get("kept", "-")
            what = f"the survivors kept {kept} of its samples" if kept != "-" else "lost on every rank"
            lines.append(
                f"{tag}: SIGKILL stall <= 2 s at 100M: {kill['stall_s']:.2f} s (the longest gap "
                f"{kill['longest_gap_s']:.2f} s less the new world's median step {kill['median_step_after_s']:.2f} s; "
                f"the kill came {lost:.2f} s into the step in flight ({what}), whose gap was "
                f"{kill['first_gap_s']:.2f} s): {verdict(kill['stall_s'] <= 2.0)}"
            )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="25,100,250", help="model sizes in millions of parameters")
    p.add_argument(
        "--scenarios", default="join,kill,spare,none", help="join, kill, spare, none, and crash (the Session's only)"
    )
    p.add_argument("--workloads", default="session,trainer", help="the Session script, the Trainer script, or both")
    p.add_argument(
        "--transfer", default="overlap,blocking", help="the Session's transfer: overlapping the next step, or before it"
    )
    p.add_argument("--timeout-s", type=float, default=600.0, help="bound on each phase of each run")
    p.add_argument("--no-idle-rates", action="store_true", help="skip send_state's own rate between two idle processes")
    a = p.parse_args()
    rates = wire_rates(a.sizes if "session" in a.workloads.split(",") and not a.no_idle_rates else "")
    best = max(rates["gloo_one_piece"], rates["gloo_16mib_pieces"])
    print(
        f"box: gloo broadcast 1 GiB {rates['gloo_one_piece']:.2f} GB/s in one piece, "
        f"{rates['gloo_16mib_pieces']:.2f} GB/s in 16 MiB pieces; raw loopback socket {rates['raw_socket']:.2f} GB/s",
        flush=True,
    )
    for params, by_dest in rates.get("send_state", {}).items():
        into = ", ".join(
            f"into {dest} {gbs:.2f} GB/s ({gbs / best:.0%})" for dest, gbs in by_dest.items() if dest != "bytes"
        )
        print(f"send_state alone, {params}M ({by_dest['bytes'] / 1e9:.2f} GB), % of gloo: {into}", flush=True)
    header = (
        "workload  scenario  transfer  params  step before  step after  longest gap  stall  at regroup  stall  "
        "state moved  phases  transfer   rate  vs gloo  held up  rolled back"
    )
    print(header, flush=True)
    results = []
    modes = a.transfer.split(",")
    runs = [
        (w, int(s), c, m)
        for w in a.workloads.split(",")
        for s in a.sizes.split(",")
        for c in a.scenarios.split(",")
        for m in (modes if w == "session" else ["blocking"])
        if c != "crash" or w == "session"  # bench/workers/trainer_size_worker.py has no crash of its own
    ]
    for workload, size, scenario, mode in runs:
        r = run(workload, scenario, size, a.timeout_s, mode)
        results.append(r)
        print(
            f"{workload:8}  {scenario:8}  {mode:8}  {r['params_m']:>5}M  {r['median_step_before_s']:>10.2f}s  "
            f"{r['median_step_after_s']:>9.2f}s  "
            f"{r['longest_gap_s']:>10.2f}s  {r['stall_s']:>4.2f}s  {r['regroup_gap_s']:>9.2f}s  "
            f"{r['regroup_stall_s']:>4.2f}s  {int(r['bytes']) / 1e9:>8.2f} GB  {r['phases']:>6}  "
            f"{r['transfer_s']:>7.2f}s  {r['gb_per_s']:>5.2f}  {float(r['gb_per_s']) / best:>6.0%}  "
            f"{r['blocked_s']:>6.2f}s  {r['rolled_back']}",
            flush=True,
        )
    for line in criteria(results, best):
        print(line, flush=True)
    print(json.dumps({"box": rates, "runs": results}), flush=True)


if __name__ == "__main__":
    main()
