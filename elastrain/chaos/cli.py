"""``elastrain-chaos`` (and ``python -m elastrain.chaos``): run any training script as N local nodes under a
preemption trace.

    elastrain-chaos --nodes 3 --trace trace.yaml --output-dir chaos-out -- train.py --max-steps 500
    elastrain-chaos --nodes 3 --random-trace 7 --duration 300 --output-dir chaos-out -- train.py
    elastrain-chaos --nodes 3 --random-trace 7 --print-trace > trace.yaml

Everything after ``--`` is the training script and its arguments, as given to elastrain-run.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
from collections.abc import Sequence

import yaml

from elastrain import log
from elastrain.chaos.harness import ChaosHarness, elastrain_node_command, new_run_id
from elastrain.chaos.progress import MetricsProgress
from elastrain.chaos.trace import Action, Trace, load_trace, random_trace
from elastrain.errors import TraceError, UsageError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="elastrain-chaos",
        description="Run a training script as N local elastrain-run nodes and kill/restart them on a trace.",
    )
    p.add_argument("--nodes", type=int, default=None, help="Node slots (default: the trace's 'nodes', or 3).")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", help="Trace file (YAML or JSON) with nodes, start and events.")
    src.add_argument("--random-trace", type=int, metavar="SEED", help="Draw a seeded AzureML-like random trace.")
    p.add_argument("--duration", type=float, default=180.0, help="Random trace: last event time in s (180).")
    p.add_argument("--mean-up", type=float, default=60.0, help="Random trace: mean seconds a node stays up (60).")
    p.add_argument("--mean-down", type=float, default=20.0, help="Random trace: mean seconds a node stays down (20).")
    p.add_argument("--min-alive", type=int, default=1, help="Random trace: never fewer nodes up than this (1).")
    p.add_argument("--notice", type=float, default=None, help="Random trace: SIGTERM with this notice, not SIGKILL.")
    p.add_argument(
        "--protect-node",
        type=int,
        action="append",
        default=[],
        help="Random trace: never preempt this node (repeatable; default: 0, the c10d store's host).",
    )
    p.add_argument("--preempt-any", action="store_true", help="Random trace: node 0 may be preempted too.")
    p.add_argument("--print-trace", action="store_true", help="Print the trace as YAML and exit.")
    p.add_argument("--output-dir", default="chaos-out", help="Node logs and timeline.json go here.")
    p.add_argument(
        "--progress-file",
        default=None,
        help="The job's elastrain metrics.jsonl, for trace events with after_step (the job's highest step).",
    )
    p.add_argument("--port", type=int, default=29400, help="Rendezvous port on 127.0.0.1 (29400).")
    p.add_argument("--run-id", default=None, help="Rendezvous id (default: a fresh one).")
    p.add_argument("--max-restarts", type=int, default=100, help="elastrain-run --max-restarts per node (100).")
    p.add_argument("--launcher-args", default="", help="Extra elastrain-run options, as one quoted string.")
    p.add_argument("--timeout", type=float, default=3600.0, help="Kill everything after this many seconds.")
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- training_script [args...]")
    return p


def trace_from_args(args: argparse.Namespace) -> Trace:
    if args.trace:
        trace = load_trace(args.trace)
        if args.nodes is not None and args.nodes != trace.nodes:
            raise UsageError("--nodes", f"{args.nodes} disagrees with the trace's nodes: {trace.nodes}")
        return trace
    nodes = args.nodes or 3
    if args.random_trace is None:
        return Trace(nodes=nodes)
    return random_trace(
        args.random_trace,
        nodes=nodes,
        duration_s=args.duration,
        mean_up_s=args.mean_up,
        mean_down_s=args.mean_down,
        min_alive=args.min_alive,
        protect=args.protect_node or ([] if args.preempt_any else [0]),
        notice_s=args.notice,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log.configure()
    try:
        trace = trace_from_args(args)
    except (TraceError, UsageError) as exc:
        print(f"elastrain-chaos: error: {exc}", file=sys.stderr)
        return 2
    if args.print_trace:
        print(yaml.safe_dump(trace.to_dict(), sort_keys=False), end="")
        return 0
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        print("elastrain-chaos: error: give the training script after --", file=sys.stderr)
        return 2
    host = trace.start[0]
    # A crash takes a worker only: the agent, which hosts the store, lives.
    stops_host = [e for e in trace.events if e.node == host and e.action not in (Action.START, Action.CRASH)]
    preempted = bool(stops_host) or any(e.action is Action.KILL_ALL for e in trace.events)
    if preempted and "etcd" not in args.launcher_args:
        print(
            f"elastrain-chaos: warning: the trace preempts node {host}, which hosts the c10d rendezvous store; "
            "nodes that return after it died may not find the job (use an etcd backend via --launcher-args)",
            file=sys.stderr,
        )
    run_id = args.run_id or new_run_id()
    launcher_args = shlex.split(args.launcher_args)

    def node_command(_: int) -> list[str]:
        # --nnodes 1:MAX with the trace's max_nodes: slots beyond it are spares.
        return elastrain_node_command(
            script, trace.launcher_max, args.port, run_id, launcher_args, max_restarts=args.max_restarts
        )

    progress = MetricsProgress(args.progress_file) if args.progress_file else None
    try:
        harness = ChaosHarness(trace, node_command, args.output_dir, progress=progress, host_port=args.port)
    except TraceError as exc:
        print(f"elastrain-chaos: error: {exc}", file=sys.stderr)
        return 2
    # On SIGTERM, unwind through the harness's cleanup so that no node outlives it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = harness.run(timeout_s=args.timeout)
    status = "succeeded" if result.succeeded else ("timed out" if result.timed_out else "failed")
    print(f"elastrain-chaos: job {status} after {result.elapsed_s:.1f}s; timeline in {args.output_dir}/timeline.json")
    return 0 if result.succeeded else 1


if __name__ == "__main__":
    sys.exit(main())
