"""AzureML entrypoint: map the node's AzureML environment to elastrain-run's rendezvous, then exec it.

    python -m elastrain.platforms.azureml.entrypoint --min-nodes 1 --checkpoint-dir ${{outputs.checkpoints}} \\
        -- [elastrain-run options] train.py [script args]

With ``distribution: {type: pytorch, process_count_per_instance: 1}`` AzureML runs this once per node
and sets (documented for PyTorch jobs) ``MASTER_ADDR`` / ``MASTER_PORT`` (the first node and a free
port on it), ``NODE_RANK``, ``WORLD_SIZE`` (here: the node count) plus ``AZUREML_NODE_COUNT`` and
``AZUREML_RUN_ID``; MPI jobs set ``AZ_BATCH_MASTER_NODE`` (``ip:port``) or
``AZ_BATCHAI_MPI_MASTER_NODE`` instead. They become:

- ``--nnodes MIN:AZUREML_NODE_COUNT`` and ``--rdzv-endpoint MASTER_ADDR:MASTER_PORT`` (c10d) or the
  given etcd endpoint (etcd-v3);
- ``--rdzv-id AZUREML_RUN_ID``: a job that AzureML restarts from scratch keeps its run id, and with
  the same ``--checkpoint-dir`` (the job's ``outputs``) it resumes from the newest complete checkpoint.

torch's per-process variables (``RANK``, ``WORLD_SIZE``, ``MASTER_*``...) are removed before the exec:
the agent sets its own for every worker. Everything after ``--`` goes to elastrain-run unchanged, after
the flags computed here, so it can override them.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from elastrain.errors import LaunchSpecError

DEFAULT_RDZV_PORT = 29400
LOCAL_RUN_ID = "azureml-local"
# Set by AzureML (or by torch conventions) for a process; the elastrain agent sets its own per worker.
_PER_PROCESS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")


@dataclass(frozen=True)
class AzureMLNode:
    master_addr: str
    master_port: int
    node_rank: int
    node_count: int
    run_id: str


def _int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise LaunchSpecError(f"{name}={raw!r} is not an integer (is this an AzureML node?)") from None


def _host_port(value: str, name: str) -> tuple[str, int | None]:
    host, sep, port = value.strip().rpartition(":")
    if not sep:
        return value.strip(), None
    if not port.isdigit():
        raise LaunchSpecError(f"{name}={value!r}: expected host or host:port")
    return host, int(port)


def read_azureml_env(environ: Mapping[str, str]) -> AzureMLNode:
    """This node's place in the job, from AzureML's variables (a single local node when none are set)."""
    port: int | None = None
    if environ.get("MASTER_ADDR"):
        addr = environ["MASTER_ADDR"].strip()
        port = _int(environ, "MASTER_PORT")
    elif environ.get("AZ_BATCH_MASTER_NODE"):
        addr, port = _host_port(environ["AZ_BATCH_MASTER_NODE"], "AZ_BATCH_MASTER_NODE")
    elif environ.get("AZ_BATCHAI_MPI_MASTER_NODE"):
        addr = environ["AZ_BATCHAI_MPI_MASTER_NODE"].strip()
    else:
        addr = "127.0.0.1"
    rank = next(
        (
            v
            for v in (_int(environ, n) for n in ("NODE_RANK", "AZ_BATCHAI_TASK_INDEX", "OMPI_COMM_WORLD_RANK"))
            if v is not None
        ),
        0,
    )
    count = _int(environ, "AZUREML_NODE_COUNT") or _int(environ, "WORLD_SIZE") or 1
    if count < 1 or not 0 <= rank < count:
        raise LaunchSpecError(
            f"node rank {rank} does not fit a job of {count} nodes (check NODE_RANK, AZUREML_NODE_COUNT)"
        )
    return AzureMLNode(
        master_addr=addr,
        master_port=port or DEFAULT_RDZV_PORT,
        node_rank=rank,
        node_count=count,
        run_id=environ.get("AZUREML_RUN_ID", "").strip() or LOCAL_RUN_ID,
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m elastrain.platforms.azureml.entrypoint", description=__doc__.splitlines()[0]
    )
    p.add_argument("--min-nodes", type=int, default=1, help="fewest nodes the job trains on (default 1)")
    p.add_argument("--max-nodes", type=int, default=None, help="default: AZUREML_NODE_COUNT")
    p.add_argument("--nproc-per-node", default="1", help="workers per node: N, gpu, cpu or auto (default 1)")
    p.add_argument("--rdzv-backend", default="c10d")
    p.add_argument("--rdzv-endpoint", default=None, help="default: MASTER_ADDR:MASTER_PORT (the first node)")
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--checkpoint-dir", default=os.path.join("outputs", "checkpoints"))
    p.add_argument(
        "--preemption-watchers",
        default=None,
        help="none, auto, or azure,aws,gcp (default: azure on an AzureML node, none elsewhere)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the elastrain-run command instead of running it")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="-- [elastrain-run options] script [args]")
    return p


def elastrain_argv(node: AzureMLNode, args: argparse.Namespace) -> list[str]:
    """elastrain-run's arguments for this node (everything after ``python -m elastrain``)."""
    rest = list(args.rest[1:] if args.rest[:1] == ["--"] else args.rest)
    if not rest:
        raise LaunchSpecError("give the training script after --, e.g. -- train.py --epochs 3")
    max_nodes = args.max_nodes or node.node_count
    if not 1 <= args.min_nodes <= max_nodes:
        raise LaunchSpecError(f"--min-nodes {args.min_nodes} must be between 1 and the node count {max_nodes}")
    endpoint = args.rdzv_endpoint or f"{node.master_addr}:{node.master_port}"
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
        args.preemption_watchers or ("none" if node.run_id == LOCAL_RUN_ID else "azure"),
        *rest,
    ]


def worker_environ(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k not in _PER_PROCESS}


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    env = os.environ if environ is None else environ
    args = _parser().parse_args(argv)
    try:
        node = read_azureml_env(env)
        run_args = elastrain_argv(node, args)
    except LaunchSpecError as exc:
        print(f"elastrain.platforms.azureml.entrypoint: error: {exc}", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "elastrain", *run_args]
    print(
        f"elastrain azureml node_rank={node.node_rank} nodes={node.node_count} run_id={node.run_id} "
        f"command={shlex.join(cmd)}",
        file=sys.stderr,
        flush=True,
    )
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    os.execvpe(cmd[0], cmd, worker_environ(env))
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
