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

The rest (flags, exec, per-process variables) is :mod:`elastrain.platforms.entrypoint`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

from elastrain.errors import LaunchSpecError
from elastrain.platforms import entrypoint
from elastrain.platforms.entrypoint import DEFAULT_RDZV_PORT, ClusterNode, worker_environ

LOCAL_RUN_ID = "azureml-local"
AzureMLNode = ClusterNode
__all__ = ["AzureMLNode", "elastrain_argv", "main", "read_azureml_env", "worker_environ"]


def _host_port(value: str, name: str) -> tuple[str, int | None]:
    host, sep, port = value.strip().rpartition(":")
    if not sep:
        return value.strip(), None
    if not port.isdigit():
        raise LaunchSpecError(f"{name}={value!r}: expected host or host:port")
    return host, int(port)


def read_azureml_env(environ: Mapping[str, str]) -> ClusterNode:
    """This node's place in the job, from AzureML's variables (a single local node when none are set)."""

    def num(name: str) -> int | None:
        return entrypoint.int_var(environ, name, "AzureML")

    port: int | None = None
    if environ.get("MASTER_ADDR"):
        addr = environ["MASTER_ADDR"].strip()
        port = num("MASTER_PORT")
    elif environ.get("AZ_BATCH_MASTER_NODE"):
        addr, port = _host_port(environ["AZ_BATCH_MASTER_NODE"], "AZ_BATCH_MASTER_NODE")
    elif environ.get("AZ_BATCHAI_MPI_MASTER_NODE"):
        addr = environ["AZ_BATCHAI_MPI_MASTER_NODE"].strip()
    else:
        addr = "127.0.0.1"
    ranks = (num(n) for n in ("NODE_RANK", "AZ_BATCHAI_TASK_INDEX", "OMPI_COMM_WORLD_RANK"))
    rank = next((v for v in ranks if v is not None), 0)
    return ClusterNode(
        master_addr=addr,
        master_port=port or DEFAULT_RDZV_PORT,
        node_rank=rank,
        node_count=num("AZUREML_NODE_COUNT") or num("WORLD_SIZE") or 1,
        run_id=environ.get("AZUREML_RUN_ID", "").strip() or LOCAL_RUN_ID,
    )


def _watchers(node: ClusterNode) -> str:
    return "none" if node.run_id == LOCAL_RUN_ID else "azure"


def _parser() -> argparse.ArgumentParser:
    return entrypoint.parser(
        "python -m elastrain.platforms.azureml.entrypoint",
        (__doc__ or "").splitlines()[0],
        count_from="AZUREML_NODE_COUNT",
        checkpoint_dir=os.path.join("outputs", "checkpoints"),
    )


def elastrain_argv(node: ClusterNode, args: argparse.Namespace) -> list[str]:
    """elastrain-run's arguments for this node; Azure's preemption notices are watched on an AzureML node."""
    return entrypoint.elastrain_argv(node, args, _watchers(node))


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    return entrypoint.main_for("azureml", _parser, read_azureml_env, _watchers, argv, environ)


if __name__ == "__main__":
    sys.exit(main())
