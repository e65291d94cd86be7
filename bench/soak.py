"""Soak: a job on up to 3 local nodes plus spares under a seeded churn trace, then Jepsen-style checks.

    python bench/soak.py --seed 1 --events 50                  # the T5 example (tiny preset)
    python bench/soak.py --seed 311 --events 10 --job ledger   # the short CI version (tests/e2e/test_soak.py)
    python bench/soak.py --seed 3 --events 50 --job trainer    # examples/hf/run_clm.py, unchanged
    python bench/soak.py --seed 4 --events 30 --rdzv-backend etcd-v3   # the rendezvous on an etcd of its own

Every node runs the same command (``elastrain-run --nnodes 1:MAX`` on 127.0.0.1:PORT, one worker), so a node that comes
back, a spare beyond MAX and a whole-job restart all use the original endpoint, run id and checkpoint directory. The
trace (elastrain/chaos/churn.py) SIGKILLs any node (node 0, the first store host, too) or one worker of a node (its
agent starts it again), SIGTERMs with a notice, SIGSTOPs and then kills or continues, kills the whole job and starts it
again, and starts spares while the job is full; each event waits for the job's next step milestone. At the end it checks
what the run left behind (elastrain/chaos/checks.py) and prints a PASS/FAIL table with every violation, then the
figures; it exits 1 on any violation. Everything stays in ``--output-dir`` (``soak.json``: checks and figures);
``--check DIR`` checks a finished soak's directory again.

The jobs: the T5 example with ``--ledger`` (each rank records the sample ids of every step), or
tests/workers/ledger_job.py, a tiny linear regression that records the same and starts in ~2 s, or ``trainer``: the
Hugging Face Trainer causal-LM script examples/hf/run_clm.py, unchanged, on a tiny local GPT-2 (built once by
examples/hf/make_assets.py into ``--data-dir``), in the default mode with ``--checkpoint-dir``. Its ranks write the
sample ledger of bench/support/hf/ledger.py (the script imports it when ``LEDGER_DIR`` is set) and each step sleeps 0.3
s (its pace file), like the T5 job's ``--step-sleep``: an idle machine would end the job before the trace. Its judge
checks what applies to a script that is not written against ``Session`` (no ``finish`` or ``start`` records): the trace
ran and the job finished, the last step is ``max_steps`` (ledger and the Trainer's ``trainer_state.json``), every sample
once per epoch (the committed steps' ledger rows make the stream), every evaluation once (the script evaluates every 20
steps and after training: the log history holds the uninterrupted run's evaluation steps, each once), steps computed
twice at most one per SIGKILL, of a node or of one worker (and ``--save-every`` + 1 per world lost whole: a whole-job
kill, or every member of a world killed, after which the job resumes from its newest committed ``checkpoint-N``), no
orphan processes, bounded rendezvous rounds.

``--rdzv-backend etcd-v3`` runs the same trace with the rendezvous on an etcd server the soak starts on a free
loopback port (bench/support/etcd_server.py) and stops at the end: no node hosts the store, so the nodes start
together, and a kill of node 0 is a kill like any other.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import sys
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.support.etcd_server import EtcdServer  # noqa: E402
from bench.support.t5_example import prepare_data  # noqa: E402
from bench.support.trainer_ledger import Ledger, LedgerProgress, check_every_sample_once  # noqa: E402
from bench.support.trainer_workload import (  # noqa: E402
    clm_script,
    evaluation_steps,
    make_assets,
    train_samples,
    trainer_env,
    trainer_state,
)
from elastrain import binding  # noqa: E402
from elastrain.chaos import ChaosHarness, MetricsProgress, elastrain_node_command  # noqa: E402
from elastrain.chaos.analysis import (  # noqa: E402
    fired_events,
    kept_rows,
    max_stall,
    read_ledger,
    round_times,
    segment_order,
    segments,
    workers_started,
)
from elastrain.chaos.checks import (  # noqa: E402
    Check,
    Expectation,
    check_bounded_rounds,
    check_checkpoints,
    check_exactly_once,
    check_final_state,
    check_one_world,
    check_processes,
    check_trace_ran,
    format_table,
    refounded,
)
from elastrain.chaos.churn import ChurnConfig, churn_trace, coverage  # noqa: E402
from elastrain.chaos.trace import Trace, trace_from_dict  # noqa: E402

SETTINGS = "soak-settings.json"


@dataclass(frozen=True)
class Job:
    """Where one kind of job keeps its files, and its command line."""

    name: str
    samples: int
    global_batch: int
    steps_per_event: int
    save_every: int

    def script(self, out: Path, max_steps: int, data_dir: Path) -> list[str]:
        if self.name == "ledger":
            return [str(REPO / "tests" / "workers" / "ledger_job.py"), "--out", str(out / "job"),
                    "--samples", str(self.samples), "--global-batch", str(self.global_batch), "--micro-batch", "2",
                    "--max-steps", str(max_steps), "--save-every", str(self.save_every), "--sleep", "0.3"]  # fmt: skip
        if self.name == "trainer":
            return clm_script(data_dir, out / "job", max_steps, save_steps=self.save_every, eval_steps=EVAL_EVERY)
        # Paced (like the ledger job's --sleep): an idle machine trains faster than the trace's gaps fire its
        # events, and the job would end before the trace does.
        return [str(REPO / "examples" / "t5" / "train.py"), "--preset", "tiny", "--max-steps", str(max_steps),
                "--global-batch-size", str(self.global_batch), "--seed", "0", "--train-limit", str(self.samples),
                "--eval-size", "64", "--eval-every", "0", "--rouge-samples", "4", "--save-every",
                str(self.save_every), "--ledger", "--data-dir", str(data_dir), "--step-sleep", "0.3",
                "--output-dir", str(out / "job")]  # fmt: skip

    def checkpoint_dir(self, out: Path) -> Path:
        return out / "checkpoints"

    def metrics_dir(self, out: Path) -> Path:
        """Where the session writes metrics.jsonl and events.jsonl."""
        return out / "job" if self.name == "t5" else self.checkpoint_dir(out)

    def ledgers(self, out: Path) -> list[Path]:
        if self.name == "ledger":
            return [out / "job" / "ledger.jsonl"]
        return sorted((out / "job").glob("ledger-rank*.jsonl"))


# Epoch tails are 0 or at least MAX samples, so the session never skips one (see Expectation.step_sizes).
JOBS = {
    "ledger": Job("ledger", samples=100, global_batch=8, steps_per_event=6, save_every=5),
    "t5": Job("t5", samples=480, global_batch=16, steps_per_event=8, save_every=10),
    # The dataset's size and the global batch (4 per rank at the first world's size) are read from the run.
    "trainer": Job("trainer", samples=0, global_batch=0, steps_per_event=8, save_every=10),
}
TRAINER_STEP_SLEEP = 0.3
EVAL_EVERY = 20
"""The trainer job evaluates every that many steps (and once after training, as run_clm.py does)."""
KILLS = ("kill", "notice_expired", "drain_timeout", "crash")
"""The harness's records of a SIGKILL: of a node (elastrain/chaos/checks.py's ``_SIGKILLS``) or of one worker."""


def free_port() -> int:
    return binding.free_port("127.0.0.1")


def run_soak(args: argparse.Namespace) -> int:
    job = JOBS[args.job]
    out = Path(args.output_dir or f"runs/soak-{args.job}-seed{args.seed}-{uuid.uuid4().hex[:6]}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    first_step = 5
    last_step = first_step + job.steps_per_event * (args.events - 1)
    max_steps = args.max_steps or last_step + 4 * job.steps_per_event
    if max_steps <= last_step:
        print(f"soak: --max-steps must be above the last milestone, step {last_step}", file=sys.stderr)
        return 2
    cfg = ChurnConfig(
        events=args.events, max_nodes=args.max_nodes, spares=args.spares, first_step=first_step, last_step=last_step
    )
    trace = churn_trace(args.seed, cfg)
    data_dir = Path(args.data_dir or REPO / "runs" / f"soak-{job.name}-data").resolve()
    if job.name == "t5":
        prepare_data(data_dir, eval_size=64)
    elif job.name == "trainer":
        make_assets(data_dir)
    script = job.script(out, max_steps, data_dir)
    port = args.port or free_port()
    run_id = f"soak-{args.seed}-{uuid.uuid4().hex[:6]}"
    launcher = ["--checkpoint-dir", str(job.checkpoint_dir(out)), *args.launcher_args.split()]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    if job.name == "trainer":
        env = {**env, **trainer_env(out / "ledger", out / "hf-cache", TRAINER_STEP_SLEEP)}
    timeout = args.timeout or 120.0 + 45.0 * args.events
    print(
        f"soak: job {job.name}, seed {args.seed}, {args.events} events, nodes 1:{trace.launcher_max} + "
        f"{args.spares} spares, max steps {max_steps}, timeout {timeout:.0f}s, output {out}",
        flush=True,
    )
    settings = {"job": job.name, "seed": args.seed, "max_steps": max_steps, "trace": trace.to_dict()}
    (out / SETTINGS).write_text(json.dumps(settings, indent=1))
    metrics_dir = job.metrics_dir(out)
    readers = [MetricsProgress(metrics_dir / "metrics.jsonl"), MetricsProgress(metrics_dir / "events.jsonl")]
    if job.name == "trainer":
        readers = [LedgerProgress(out / "ledger")]
    with rendezvous(args.rdzv_backend, out) as rdzv:

        def node_command(_: int) -> list[str]:
            return elastrain_node_command(script, trace.launcher_max, port, run_id, [*rdzv, *launcher])

        # With etcd no node hosts the store: the nodes start together.
        host_port = port if args.rdzv_backend == "c10d" else None
        harness = ChaosHarness(
            trace, node_command, out / "chaos", env=env, progress=lambda: max(r() for r in readers), host_port=host_port
        )
        harness.run(timeout_s=timeout, stall_s=args.stall)
    return judge(out)


@contextlib.contextmanager
def rendezvous(backend: str, out: Path) -> Iterator[list[str]]:
    """The nodes' rendezvous options for ``backend`` while the block runs: none for c10d (the harness's port, on node
    0), an etcd server of the soak's own for etcd-v3, stopped at the end."""
    if backend != "etcd-v3":
        yield []
        return
    with EtcdServer(out / "etcd") as etcd:
        yield ["--rdzv-backend=etcd-v3", f"--rdzv-endpoint={etcd.endpoint}"]


def judge(out: Path) -> int:
    """Check a soak's output directory, print the table and the figures, write ``soak.json``; 1 on any violation."""
    settings = json.loads((out / SETTINGS).read_text())
    job, max_steps = JOBS[settings["job"]], int(settings["max_steps"])
    trace = trace_from_dict(settings["trace"])
    if job.name == "trainer":
        return judge_trainer(out, settings, job, trace)
    expect = Expectation(max_steps=max_steps, samples=job.samples, global_batch=job.global_batch)
    timeline = json.loads((out / "chaos" / "timeline.json").read_text())
    metrics_file, events_file = job.metrics_dir(out) / "metrics.jsonl", job.metrics_dir(out) / "events.jsonl"
    order, restored = segment_order(metrics_file)
    rows = read_ledger(job.ledgers(out))
    logs = sorted((out / "chaos").glob("node-*.log"))
    spans = segments(events_file, metrics_file, rows, workers_started(logs))
    rounds = round_times(logs)
    checks: list[Check] = [
        check_trace_ran(timeline, len(trace.events)),
        check_final_state(events_file, expect),
        check_exactly_once(rows, order, restored, expect),
        check_one_world(spans, t0=timeline["started_at"]),
        check_checkpoints(str(job.checkpoint_dir(out)), expect),
        check_processes(timeline),
        check_bounded_rounds(timeline, rounds),
    ]
    kept = kept_rows(rows, order, restored)
    events = timeline["events"]
    elapsed = float((timeline.get("result") or {}).get("elapsed_s") or events[-1]["t"])
    finished = any(e["action"] == "exit" and e["returncode"] == 0 and not e["expected"] for e in events)
    # Ledger rows count as step records too: a step saved on request right before a restart can lack a metrics point.
    stall, stall_step = max_stall(
        metrics_file,
        until=None if finished else timeline["started_at"] + elapsed,
        more=[(r.time, r.step) for r in rows if r.time is not None],
    )
    trained = {(r.segment, r.step) for r in rows}
    figures = {
        "job": job.name,
        "seed": settings["seed"],
        "events_planned": len(trace.events),
        "events_fired": fired_events(timeline),
        "trace": dict(sorted(coverage(trace).items())),
        "rendezvous_rounds": len(rounds),
        "worlds": len(spans),
        "max_steps": max_steps,
        "steps_trained": len(trained),
        "steps_rerun": len(trained) - len({(r.segment, r.step) for r in kept}),
        "wall_s": round(elapsed, 1),
        "max_stall_s": round(stall, 1),
        "max_stall_before_step": stall_step,
        "refounded": refounded(spans, timeline),
    }
    return verdict(out, checks, figures)


def verdict(out: Path, checks: list[Check], figures: dict[str, Any]) -> int:
    """Print the table and the figures, write ``soak.json``; 1 on any violation."""
    stall_step = figures["max_stall_before_step"]
    ok = all(c.ok for c in checks)
    print()
    print(format_table(checks))
    print()
    print(
        f"events {figures['events_fired']}/{figures['events_planned']} fired "
        f"({', '.join(f'{k} {v}' for k, v in figures['trace'].items())}); "
        f"{figures['rendezvous_rounds']} rendezvous rounds, {figures['worlds']} worlds; "
        f"{figures['steps_trained']} steps trained for {figures['max_steps']} ({figures['steps_rerun']} re-run); "
        f"wall {figures['wall_s']}s, max stall {figures['max_stall_s']}s "
        f"({f'before step {stall_step}' if stall_step is not None else 'until the end'})"
    )
    for note in figures["refounded"]:
        print(f"note: {note}")
    print(f"soak: {'PASS' if ok else 'FAIL'}; details in {out}/soak.json", flush=True)
    result = {"ok": ok, "figures": figures, "checks": [{**asdict(c), "ok": c.ok} for c in checks]}
    (out / "soak.json").write_text(json.dumps(result, indent=1))
    return 0 if ok else 1


def judge_trainer(out: Path, settings: dict[str, Any], job: Job, trace: Trace) -> int:
    """The trainer job's checks (see the module's docstring) and figures."""
    max_steps = int(settings["max_steps"])
    timeline = json.loads((out / "chaos" / "timeline.json").read_text())
    ledger = Ledger.read(out / "ledger")
    logs = sorted((out / "chaos").glob("node-*.log"))
    rounds = round_times(logs)
    steps = ledger.steps()
    global_batch = len(steps.get(1, []))
    final = Check("final step")
    state_step = trainer_state(out / "job").get("global_step")
    if ledger.last_step() != max_steps or state_step != max_steps:
        final.violations.append(
            f"the ledger ends at step {ledger.last_step()}, trainer_state.json at {state_step}; want {max_steps}"
        )
    final.detail = f"step {ledger.last_step()}/{max_steps}, global batch {global_batch}"
    records = [e["action"] for e in timeline["events"]]
    kills, lost = sum(records.count(a) for a in KILLS), ledger.worlds_lost()
    allowed = kills + lost * (job.save_every + 1)
    redone = ledger.redone()
    twice = Check("steps computed twice")
    if len(redone) > allowed:
        twice.violations.append(
            f"{len(redone)} steps computed twice ({redone[:20]}) for {kills} SIGKILLs and {lost} worlds lost whole "
            f"(allowed {allowed}: 1 per SIGKILL, {job.save_every + 1} per world lost whole)"
        )
    twice.detail = f"{len(redone)} for {kills} SIGKILLs, {lost} worlds lost whole"
    evaluations = Check("every evaluation once")
    want = [*range(EVAL_EVERY, max_steps + 1, EVAL_EVERY), max_steps]
    got = evaluation_steps(trainer_state(out / "job"))
    if got != want:
        evaluations.violations.append(f"evaluations at steps {got}; an uninterrupted run evaluates at {want}")
    evaluations.detail = f"{len(got)} evaluations"
    checks: list[Check] = [
        check_trace_ran(timeline, len(trace.events)),
        final,
        check_every_sample_once(ledger, max_steps, global_batch, train_samples(out / "job")),
        evaluations,
        twice,
        check_processes(timeline),
        check_bounded_rounds(timeline, rounds),
    ]
    events = timeline["events"]
    gaps = [(b[0] - a[0], b[1]) for a, b in itertools.pairwise(ledger.step_ends())]
    stall, at = max(gaps, default=(0.0, None))
    figures = {
        "job": job.name,
        "seed": settings["seed"],
        "events_planned": len(trace.events),
        "events_fired": fired_events(timeline),
        "trace": dict(sorted(coverage(trace).items())),
        "rendezvous_rounds": len(rounds),
        "worlds": len(ledger.world_change_steps()) + 1 if steps else 0,
        "max_steps": max_steps,
        "steps_trained": len(steps),
        "steps_rerun": len(redone),
        "wall_s": round(float((timeline.get("result") or {}).get("elapsed_s") or events[-1]["t"]), 1),
        "max_stall_s": round(stall, 1),
        "max_stall_before_step": at,
        "refounded": [],
    }
    return verdict(out, checks, figures)


def main(argv: list[str] | None = None) -> int:
    # SIGTERM ends the run like Ctrl-C: the harness kills every node, and the checks still run.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=1, help="trace seed (1)")
    p.add_argument("--events", type=int, default=50, help="trace events (50)")
    p.add_argument("--job", choices=sorted(JOBS), default="t5", help="t5 (the T5 example), ledger or trainer (t5)")
    p.add_argument("--max-nodes", type=int, default=3, help="the launcher's MAX: --nnodes 1:MAX (3)")
    p.add_argument("--spares", type=int, default=2, help="node slots beyond MAX (2)")
    p.add_argument("--max-steps", type=int, default=None, help="job steps (default: past the trace's last milestone)")
    p.add_argument("--timeout", type=float, default=None, help="seconds before everything is killed (120 + 45/event)")
    p.add_argument("--stall", type=float, default=180.0, help="end the run when no step is made for this long (180)")
    p.add_argument("--port", type=int, default=None, help="rendezvous port on 127.0.0.1 (a free one)")
    p.add_argument(
        "--rdzv-backend", choices=["c10d", "etcd-v3"], default="c10d", help="etcd-v3: on an etcd the soak starts (c10d)"
    )
    p.add_argument("--launcher-args", default="", help="extra elastrain-run options, one quoted string")
    p.add_argument("--output-dir", default=None, help="default: runs/soak-JOB-seedN-XXXXXX")
    p.add_argument("--data-dir", default=None, help="the job's data, built once (runs/soak-JOB-data)")
    p.add_argument("--check", metavar="DIR", default=None, help="only check a finished soak's output directory")
    args = p.parse_args(argv)
    return judge(Path(args.check).resolve()) if args.check else run_soak(args)


if __name__ == "__main__":
    sys.exit(main())
