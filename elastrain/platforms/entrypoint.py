"""What every platform entrypoint shares: a node's place in the job → elastrain-run's arguments → exec.

A platform that starts one process per node (AzureML, SkyPilot, Slurm) tells it, in its own
variables, the first node's address, this node's rank, the node count and a job id that survives a
restart. Each ``<platform>/entrypoint.py`` reads those into a :class:`ClusterNode` (a pure function
of the environment); this module turns it into ``elastrain-run`` flags:

- ``--nnodes MIN:NODE_COUNT`` (``--max-nodes`` to override the count);
- ``--rdzv-endpoint FIRST_NODE:PORT`` for c10d, or the given etcd endpoint for etcd-v3;
- ``--rdzv-id JOB_ID``: a job the platform restarts from scratch keeps its id, and with the same
  ``--checkpoint-dir`` it resumes from the newest complete checkpoint.

torch's per-process variables (``RANK``, ``WORLD_SIZE``, ``MASTER_*``...) are removed before the exec:
the agent sets its own for every worker. Everything after ``--`` goes to elastrain-run unchanged,
after the flags computed here, so it can override them.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from elastrain.errors import LaunchSpecError

DEFAULT_RDZV_PORT = 29400
# Set by platforms (or by torch conventions) for a process; the elastrain agent sets its own per worker.
PER_PROCESS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")


@dataclass(frozen=True)
class ClusterNode:
    """One node's place in a job, as its platform tells it."""

    master_addr: str
    """The first node: where the c10d rendezvous store listens."""
    master_port: int
    node_rank: int
    node_count: int
    run_id: str
    """Stays the same when the platform restarts or requeues the job."""
    restart_count: int = 0
    """How many times the platform restarted or requeued the job, where it says (logged only)."""

    def __post_init__(self) -> None:
        if self.node_count < 1 or not 0 <= self.node_rank < self.node_count:
            raise LaunchSpecError(f"node rank {self.node_rank} does not fit a job of {self.node_count} nodes")
        if not self.master_addr:
            raise LaunchSpecError("no address for the first node")


def int_var(environ: Mapping[str, str], name: str, platform: str) -> int | None:
    """``environ[name]`` as an int, None when unset or empty."""
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise LaunchSpecError(f"{name}={raw!r} is not an integer (is this a {platform} node?)") from None


def parser(prog: str, description: str, *, count_from: str, checkpoint_dir: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--min-nodes", type=int, default=1, help="fewest nodes the job trains on (default 1)")
    p.add_argument("--max-nodes", type=int, default=None, help=f"default: {count_from}")
    p.add_argument("--nproc-per-node", default="1", help="workers per node: N, gpu, cpu or auto (default 1)")
    p.add_argument("--rdzv-backend", default="c10d", choices=("c10d", "etcd-v3"))
    p.add_argument("--rdzv-endpoint", default=None, help="default: the first node, port --rdzv-port")
    p.add_argument("--rdzv-port", type=int, default=None, help="the c10d store's port on the first node")
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument(
        "--checkpoint-dir", default=checkpoint_dir, required=checkpoint_dir is None, help="a path or fsspec URL"
    )
    p.add_argument("--preemption-watchers", default=None, help="none, auto, or azure,aws,gcp")
    p.add_argument("--dry-run", action="store_true", help="print the elastrain-run command instead of running it")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="-- [elastrain-run options] script [args]")
    return p


def elastrain_argv(node: ClusterNode, args: argparse.Namespace, default_watchers: str = "none") -> list[str]:
    """elastrain-run's arguments for this node (everything after ``python -m elastrain``)."""
    rest = list(args.rest[1:] if args.rest[:1] == ["--"] else args.rest)
    if not rest:
        raise LaunchSpecError("give the training script after --, e.g. -- train.py --epochs 3")
    max_nodes = args.max_nodes or node.node_count
    if not 1 <= args.min_nodes <= max_nodes:
        raise LaunchSpecError(f"--min-nodes {args.min_nodes} must be between 1 and the node count {max_nodes}")
    if args.rdzv_backend == "etcd-v3" and not args.rdzv_endpoint:
        raise LaunchSpecError("--rdzv-endpoint: etcd-v3 needs host:port of an etcd that outlives the nodes")
    port = getattr(args, "rdzv_port", None) or node.master_port
    endpoint = args.rdzv_endpoint or f"{node.master_addr}:{port}"
    return [
        "--nnodes",
        f"{args.min_nodes}:{max_nodes}",
        "--nproc-per-node",
        str(args.nproc_per_node),
        "--rdzv-backend",
        args.rdzv_backend,
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        node.run_id,
        "--max-restarts",
        str(args.max_restarts),
        "--checkpoint-dir",
        args.checkpoint_dir,
        "--preemption-watchers",
        args.preemption_watchers or default_watchers,
        *rest,
    ]


def worker_environ(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k not in PER_PROCESS}


def run(
    platform: str,
    args: argparse.Namespace,
    environ: Mapping[str, str],
    read_env: Callable[[Mapping[str, str]], ClusterNode],
    default_watchers: Callable[[ClusterNode], str],
) -> int:
    """Read the node, log one line, then exec ``python -m elastrain`` (or print it with ``--dry-run``)."""
    try:
        node = read_env(environ)
        run_args = elastrain_argv(node, args, default_watchers(node))
    except LaunchSpecError as exc:
        print(f"elastrain {platform} entrypoint: error: {exc}", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "elastrain", *run_args]
    print(
        f"elastrain {platform} node_rank={node.node_rank} nodes={node.node_count} run_id={node.run_id} "
        f"restart_count={node.restart_count} "
        f"command={shlex.join(cmd)}",
        file=sys.stderr,
        flush=True,
    )
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    os.execvpe(cmd[0], cmd, worker_environ(environ))
    return 0  # not reached


def main_for(
    platform: str,
    make_parser: Callable[[], argparse.ArgumentParser],
    read_env: Callable[[Mapping[str, str]], ClusterNode],
    default_watchers: Callable[[ClusterNode], str],
    argv: Sequence[str] | None,
    environ: Mapping[str, str] | None,
) -> int:
    args = make_parser().parse_args(argv)
    return run(platform, args, os.environ if environ is None else environ, read_env, default_watchers)
