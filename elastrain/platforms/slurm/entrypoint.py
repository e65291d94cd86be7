"""Slurm entrypoint: map a node's ``SLURM_*`` variables to elastrain-run's rendezvous, then exec it.

    srun --ntasks-per-node=1 python -m elastrain.platforms.slurm.entrypoint --min-nodes 1 \\
        --checkpoint-dir /shared/ckpt/t5 -- [elastrain-run options] train.py [script args]

``srun`` runs this once per node of the allocation with (Slurm's documented output variables):

- ``SLURM_JOB_NODELIST`` (``SLURM_NODELIST``): the allocation as a host list; its first host is where
  the c10d store listens (``--rdzv-endpoint FIRST:29400``; ``--rdzv-port`` to change the port);
- ``SLURM_JOB_NUM_NODES`` (``SLURM_NNODES``): the allocation's size, the ``MAX`` of ``--nnodes MIN:MAX``
  (``#SBATCH --nodes=MIN-MAX`` lets Slurm start the job on fewer nodes than asked for);
- ``SLURM_NODEID``: this node's index in the allocation;
- ``SLURM_JOB_ID`` (``SLURM_ARRAY_JOB_ID``/``SLURM_ARRAY_TASK_ID`` in an array): the rendezvous id. A
  requeued job keeps its id, and resumes from the newest complete checkpoint in ``--checkpoint-dir``;
  ``SLURM_RESTART_COUNT`` (times requeued) goes into the entrypoint's log line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence

from elastrain.errors import LaunchSpecError
from elastrain.platforms import entrypoint
from elastrain.platforms.entrypoint import DEFAULT_RDZV_PORT, ClusterNode
from elastrain.platforms.slurm.hostlist import first_host


def _first(environ: Mapping[str, str], *names: str) -> str:
    return next((environ[n].strip() for n in names if environ.get(n, "").strip()), "")


def slurm_run_id(environ: Mapping[str, str]) -> str:
    array_job, array_task = _first(environ, "SLURM_ARRAY_JOB_ID"), _first(environ, "SLURM_ARRAY_TASK_ID")
    if array_job and array_task:
        return f"slurm-{array_job}_{array_task}"
    job = _first(environ, "SLURM_JOB_ID", "SLURM_JOBID")
    if not job:
        raise LaunchSpecError("SLURM_JOB_ID is not set: run this under srun inside an sbatch/salloc allocation")
    return f"slurm-{job}"


def read_slurm_env(environ: Mapping[str, str]) -> ClusterNode:
    """This node's place in the allocation, from Slurm's variables."""
    nodelist = _first(environ, "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if not nodelist:
        raise LaunchSpecError("SLURM_JOB_NODELIST is not set: run this under srun inside an sbatch allocation")
    count = entrypoint.int_var(environ, "SLURM_JOB_NUM_NODES", "Slurm") or entrypoint.int_var(
        environ, "SLURM_NNODES", "Slurm"
    )
    rank = entrypoint.int_var(environ, "SLURM_NODEID", "Slurm")
    if count is None or rank is None:
        raise LaunchSpecError("SLURM_JOB_NUM_NODES and SLURM_NODEID must be set (srun sets them on each node)")
    return ClusterNode(
        master_addr=first_host(nodelist),
        master_port=DEFAULT_RDZV_PORT,
        node_rank=rank,
        node_count=count,
        run_id=slurm_run_id(environ),
        restart_count=entrypoint.int_var(environ, "SLURM_RESTART_COUNT", "Slurm") or 0,
    )


def _parser() -> argparse.ArgumentParser:
    return entrypoint.parser(
        "python -m elastrain.platforms.slurm.entrypoint",
        (__doc__ or "").splitlines()[0],
        count_from="SLURM_JOB_NUM_NODES",
        checkpoint_dir=None,  # a shared filesystem path or a bucket URL: there is no sensible default
    )


def elastrain_argv(node: ClusterNode, args: argparse.Namespace) -> list[str]:
    return entrypoint.elastrain_argv(node, args, "none")


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    return entrypoint.main_for("slurm", _parser, read_slurm_env, lambda _node: "none", argv, environ)


if __name__ == "__main__":
    sys.exit(main())
