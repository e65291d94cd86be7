"""The preemption demo: the T5 example uninterrupted, then under a preemption trace, then a report.

    python examples/t5/demo.py                       # ≈ 5-8 minutes on 2 CPU cores
    python examples/t5/demo.py --max-steps 300 --out runs/demo-short

1. baseline: ``--nodes`` local nodes, never interrupted (priced as dedicated nodes).
2. elastic: the same command as ``--nodes`` local nodes under ``elastrain-chaos``, following a trace:
   by default node 1 is SIGKILLed (no warning, as on AzureML low-priority), comes back, then gets a
   SIGTERM with a short notice (as on AWS/GCP spot) and comes back again. The events wait for training
   progress (``after_step``), so the trace means the same on a fast or a slow machine.
3. report: ``OUT/report/index.html`` (and ``report.md``) with the world size over time, the loss
   against samples of both runs with the events marked, the longest stall and the steps lost of each
   event, final eval losses and a cost estimate (node-hours × price per node-hour).

Both runs use ``elastrain-run --live true``: a membership change regroups the running workers in place.

Node 0 is never preempted: with ``--rdzv-backend c10d`` it hosts the rendezvous store (use an etcd
backend where every node must be preemptible).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from data import prepare  # noqa: E402
from report import DEDICATED_PER_NODE_HOUR, LOW_PRIORITY_PER_NODE_HOUR, write_report  # noqa: E402

from elastrain.chaos import (  # noqa: E402
    ChaosHarness,
    MetricsProgress,
    Trace,
    elastrain_node_command,
    load_trace,
    trace_from_dict,
)
from elastrain.chaos.harness import new_run_id  # noqa: E402


def default_trace(nodes: int, max_steps: int, notice_s: float) -> Trace:
    """Kill the last node at 25% of the steps, bring it back at 40%; SIGTERM it at 60%, back at 75%."""
    victim = nodes - 1

    def at(fraction: float) -> int:
        return int(max_steps * fraction)

    return trace_from_dict(
        {
            "nodes": nodes,
            "events": [
                {"after_step": at(0.25), "action": "kill", "node": victim},
                {"after_step": at(0.40), "action": "start", "node": victim},
                {"after_step": at(0.60), "action": "term", "node": victim, "notice": notice_s},
                {"after_step": at(0.75), "action": "start", "node": victim},
            ],
        }
    )


def run_job(name: str, out: Path, trace: Trace, train_args: list[str], port: int, timeout_s: float) -> bool:
    """Run train.py as ``trace.nodes`` local nodes under ``trace``; node logs and timeline in ``out/chaos``."""
    script = [str(HERE / "train.py"), *train_args, "--output-dir", str(out)]
    run_id = new_run_id()
    # Kills are seen at once (the dead node's port refuses); a generous heartbeat timeout keeps a node
    # that is merely starved of CPU on a busy machine from being declared dead.
    # --checkpoint-dir lets the agents ask for a checkpoint before an announced change (SIGTERM, a node
    # joining), so that those cost no steps. --live: the workers regroup in place instead of restarting (a
    # SIGKILL costs only the step in flight), and a returning node's workers start warm, before it joins.
    launcher = ["--checkpoint-dir", str(out / "checkpoints"), "--live", "true"]

    def node_command(_: int) -> list[str]:
        return elastrain_node_command(script, trace.nodes, port, run_id, launcher)

    print(
        f"[demo] {name}: {trace.nodes} node(s), {len(trace.events)} trace events; logs in {out / 'chaos'}", flush=True
    )
    progress = MetricsProgress(out / "metrics.jsonl")
    harness = ChaosHarness(trace, node_command, out / "chaos", progress=progress, host_port=port)
    t0 = time.monotonic()
    result = harness.run(timeout_s=timeout_s)
    summary = out / "summary.json"
    ok = result.succeeded and summary.exists()
    if ok:
        s = json.loads(summary.read_text())
        print(
            f"[demo] {name}: done in {time.monotonic() - t0:.0f}s, final eval loss {s['final_eval_loss']:.4f}, "
            f"world sizes {s['world_sizes']}",
            flush=True,
        )
    else:
        print(f"[demo] {name}: FAILED (see {out / 'chaos'}/node-*.log)", flush=True)
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/demo"), help="everything goes here (default runs/demo)")
    p.add_argument("--preset", default="tiny", help="model preset (tiny, small)")
    p.add_argument("--max-steps", type=int, default=600, help="optimizer steps of each run (600)")
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nodes", type=int, default=2, help="local nodes of the elastic run (2; 3 needs 3+ cores)")
    p.add_argument("--trace", type=Path, default=None, help="preemption trace file (default: kill, return, term)")
    p.add_argument("--notice", type=float, default=15.0, help="seconds of notice of the default trace's SIGTERM")
    p.add_argument("--port", type=int, default=29470, help="rendezvous port on 127.0.0.1")
    p.add_argument("--dedicated-price", type=float, default=DEDICATED_PER_NODE_HOUR, help="USD per node-hour")
    p.add_argument("--low-priority-price", type=float, default=LOW_PRIORITY_PER_NODE_HOUR, help="USD per node-hour")
    p.add_argument("--timeout", type=float, default=900.0, help="give up on a run after this many seconds")
    a = p.parse_args()

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # On SIGTERM, unwind so that the harness kills every node it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = a.out.resolve()
    if (out / "baseline").exists() or (out / "elastic").exists():
        print(f"[demo] {out} holds an earlier demo: remove it or pick another --out", file=sys.stderr)
        return 2
    trace = load_trace(a.trace) if a.trace else default_trace(a.nodes, a.max_steps, a.notice)
    out.mkdir(parents=True, exist_ok=True)
    (out / "trace.yaml").write_text(yaml.safe_dump(trace.to_dict(), sort_keys=False))
    train_args = [
        "--preset", a.preset, "--max-steps", str(a.max_steps), "--global-batch-size", str(a.global_batch_size),
        "--seed", str(a.seed), "--data-dir", str(out / "data"), "--eval-every", str(max(a.max_steps // 6, 1)),
    ]  # fmt: skip
    t0 = time.monotonic()
    print("[demo] building the code→docstring pairs and the tokenizer (once, for both runs)", flush=True)
    prepare(out / "data")
    if not run_job("baseline", out / "baseline", Trace(nodes=a.nodes), train_args, a.port, a.timeout):
        return 1
    if not run_job("elastic", out / "elastic", trace, train_args, a.port + 1, a.timeout):
        return 1
    index = write_report(out / "baseline", out / "elastic", out / "report", a.dedicated_price, a.low_priority_price)
    print(f"[demo] finished in {time.monotonic() - t0:.0f}s")
    print((out / "report" / "report.md").read_text().split("![")[0].strip())
    print(f"[demo] report: {index}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
