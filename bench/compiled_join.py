"""What a live join costs when the script compiles its model: examples/hf/run_clm.py, unchanged, with and without
``--torch_compile true``, side by side in one run.

    python bench/compiled_join.py                               # --collective-timeout 5, 300 steps, both modes
    python bench/compiled_join.py --collective-timeout 30 --modes compiled
    python bench/compiled_join.py --second-joiner     # a third node joins while the second compiles

Per mode, one node trains alone (``--nnodes 1:2``, live mode, the defaults); once it has trained ``--steps-alone``
steps, a second node starts, warms up and joins. A warm joiner has built its model, but torch compiles lazily: its
first forward pass in the new world compiles the model (from nothing: each node has its own inductor cache, as on
another machine), and the running worker waits for it in that step's gradient all-reduce; it compiles again too,
once, for the micro-batch's new shape. A new world's first step therefore waits up to 10 minutes, not
``--collective-timeout`` (``FIRST_STEP_TIMEOUT_S`` in elastrain/live/group.py): with a short timeout (the default
here: 5 s) the compile would otherwise break the world, and the node that trained the job would leave it.

With ``--second-joiner``, a third node starts as soon as the second is in a round: its round is announced while the
second compiles in its first step, and that worker answers its agent's notice only at the step's end (its agent waits
for it: ``regroup_ack_extended``; before, it restarted it: ``regroup_fallback``).

Per mode it prints, from the sample ledger every rank writes (bench/support/hf/ledger.py): the running worker's
longest gap between two completed steps from the joiner's start on (its start-up shares this box's two cores with
the running worker; each step sleeps 0.4 s until the joiner's agent is in a round, none after), the median step
before the join, whether the job ended with every step computed once in worlds of 1 then 2 ranks, and any
``node_failed`` or ``regroup_notice_missing`` line; then the compiled join's gap against the eager one's.
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.support.trainer_ledger import PACE_FILE, Ledger  # noqa: E402
from bench.support.trainer_workload import clm_script, make_assets, trainer_env  # noqa: E402
from elastrain import binding  # noqa: E402
from elastrain.chaos import elastrain_node_command  # noqa: E402
from elastrain.log import parse_event_line  # noqa: E402

WARMING_PACE_S = 0.4
FAILURES = ("node_failed", "regroup_notice_missing", "workers_restarting", "regroup_fallback")


@dataclass
class Result:
    mode: str
    longest_gap_s: float | None
    median_step_s: float | None
    exactly_once: bool
    worlds: list[int]
    failures: list[str]
    codes: list[int | None]
    nodes: int


def _event_names(log: Path) -> set[str]:
    """The names of the lifecycle events in a node's log (agent's and worker's)."""
    parsed = (parse_event_line(line) for line in log.read_text(errors="replace").splitlines())
    return {e["event"] for e in parsed if e is not None and "event" in e}


def _wait(what: str, ok: Callable[[], bool], procs: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ok():
            return
        if all(p.poll() is not None for p in procs):
            break
        time.sleep(0.2)
    raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")


def run_mode(mode: str, out: Path, assets: Path, args: argparse.Namespace) -> Result:
    out.mkdir(parents=True)
    script = clm_script(assets, out / "model", args.steps)
    if mode == "compiled":
        script += ["--torch_compile", "true"]
    env = trainer_env(out / "ledger", out.parent / "hf-cache", WARMING_PACE_S)
    port = binding.free_port("127.0.0.1")
    launcher = [f"--collective-timeout={args.collective_timeout:g}", f"--checkpoint-dir={out / 'ckpt'}"]
    nodes = 3 if args.second_joiner else 2
    cmd = elastrain_node_command(script, nodes, port, f"compiled-join-{mode}-{port}", launcher, min_nodes=1)
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []

    def start(name: str) -> None:
        node_env = {**env, "TORCHINDUCTOR_CACHE_DIR": str(out / f"inductor-{name}")}  # cold, as on another machine
        logs.append(out / f"{name}.log")
        with open(logs[-1], "wb") as f:
            procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=node_env, cwd=out,
                                          start_new_session=True))  # fmt: skip

    ledger = out / "ledger"
    print(f"[compiled_join] {mode}: logs in {out}", flush=True)
    started = time.time()
    try:
        start("a")
        _wait("a training alone", lambda: Ledger.read(ledger).last_step() >= args.steps_alone, procs, args.timeout)
        started = time.time()
        start("b")
        _wait("b in a round", lambda: "rendezvous_done" in _event_names(logs[1]), procs, args.timeout)
        if args.second_joiner:  # c's round is announced while b compiles in its first step
            start("c")
            _wait("c in a round", lambda: "rendezvous_done" in _event_names(logs[2]), procs, args.timeout)
        (ledger / PACE_FILE).unlink(missing_ok=True)  # unpaced from the join on
        _wait("the full world", lambda: Ledger.read(ledger).world_now() == nodes, procs, args.timeout)
        for p in procs:
            p.wait(timeout=args.timeout)
    except (TimeoutError, subprocess.TimeoutExpired) as exc:
        print(f"[compiled_join] {mode}: {exc}", flush=True)
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
    read = Ledger.read(ledger)
    ends = read.step_ends()
    before = [t for t, _ in ends if t < started]
    after = [t for t, _ in ends if t >= started]
    gaps = [b - a for a, b in itertools.pairwise(before[-1:] + after)]
    steps_before = [b - a for a, b in itertools.pairwise(before)]
    steps = read.steps()
    failures = [f"{log.stem}: {name}" for log in logs for name in sorted(set(FAILURES) & _event_names(log))]
    return Result(
        mode=mode,
        longest_gap_s=round(max(gaps), 2) if gaps else None,
        median_step_s=round(statistics.median(steps_before), 3) if steps_before else None,
        exactly_once=sorted(steps) == list(range(1, args.steps + 1)) and not read.redone(),
        worlds=sorted(set(read.world_sizes())),
        failures=failures,
        codes=[p.returncode for p in procs],
        nodes=nodes,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--modes", default="eager,compiled", help="comma-separated: eager, compiled")
    p.add_argument("--collective-timeout", type=float, default=5.0, help="elastrain-run's --collective-timeout")
    p.add_argument("--steps", type=int, default=300, help="run_clm's --max_steps")
    p.add_argument("--steps-alone", type=int, default=20, help="steps the first node trains before the joiner starts")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds each wait of a mode may take")
    p.add_argument(
        "--second-joiner",
        action="store_true",
        help="a third node starts once the second is in a round: its round is announced while the second compiles",
    )
    p.add_argument("--output-dir", default="", help="where the runs' logs go (default: a new temporary folder)")
    args = p.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not set(modes) <= {"eager", "compiled"}:
        sys.exit(f"--modes: eager and compiled only, got {args.modes!r}")
    out = Path(args.output_dir or tempfile.mkdtemp(prefix="compiled-join-"))
    out.mkdir(parents=True, exist_ok=True)
    assets = make_assets(out / "assets")
    results = [run_mode(m, out / m, assets, args) for m in modes]
    print(f"\n--collective-timeout {args.collective_timeout:g}, {args.steps} steps, run_clm.py (tiny GPT-2, CPU)")
    print(f"{'mode':<9} {'longest gap':>12} {'median step':>12} {'once':>5} {'worlds':>7}  exit codes, failures")
    for r in results:
        gap = f"{r.longest_gap_s:.2f} s" if r.longest_gap_s is not None else "-"
        med = f"{r.median_step_s:.3f} s" if r.median_step_s is not None else "-"
        worlds = ",".join(map(str, r.worlds))
        once = "yes" if r.exactly_once else "NO"
        print(f"{r.mode:<9} {gap:>12} {med:>12} {once:>5} {worlds:>7}  {r.codes} {r.failures}")
    by = {r.mode: r for r in results}
    eager, compiled = by.get("eager"), by.get("compiled")
    if eager and compiled and eager.longest_gap_s and compiled.longest_gap_s:
        print(f"compiled join's gap / eager join's gap: {compiled.longest_gap_s / eager.longest_gap_s:.1f}x")
    ok = all(r.exactly_once and not r.failures and r.codes == [0] * r.nodes for r in results)
    print("every mode ended with each step once, no node failed" if ok else "A MODE FAILED: see its logs")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
