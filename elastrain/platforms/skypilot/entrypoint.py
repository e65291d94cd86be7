"""SkyPilot entrypoint: map a node's ``SKYPILOT_*`` variables to elastrain-run's rendezvous, then exec it.

    python -m elastrain.platforms.skypilot.entrypoint --min-nodes 1 --checkpoint-dir s3://bucket/ckpt \\
        -- [elastrain-run options] train.py [script args]

SkyPilot runs a task's ``run`` on every node with (documented environment variables):

- ``SKYPILOT_NODE_IPS``: the nodes' IPs, one a line, the head node first: the c10d store's host;
- ``SKYPILOT_NUM_NODES``: the node count, the ``MAX`` of ``--nnodes MIN:MAX``;
- ``SKYPILOT_NODE_RANK``: this node's index;
- ``SKYPILOT_TASK_ID``: the rendezvous id; it stays the same across a managed job's recoveries.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence

from elastrain.errors import LaunchSpecError
from elastrain.platforms import entrypoint
from elastrain.platforms.entrypoint import DEFAULT_RDZV_PORT, ClusterNode


def read_skypilot_env(environ: Mapping[str, str]) -> ClusterNode:
    """This node's place in the cluster, from SkyPilot's variables."""
    ips = [line.strip() for line in environ.get("SKYPILOT_NODE_IPS", "").splitlines() if line.strip()]
    if not ips:
        raise LaunchSpecError("SKYPILOT_NODE_IPS is not set: run this from a SkyPilot task's run command")
    count = entrypoint.int_var(environ, "SKYPILOT_NUM_NODES", "SkyPilot") or len(ips)
    if count != len(ips):
        raise LaunchSpecError(f"SKYPILOT_NUM_NODES={count} but SKYPILOT_NODE_IPS lists {len(ips)} nodes")
    task_id = environ.get("SKYPILOT_TASK_ID", "").strip()
    if not task_id:
        raise LaunchSpecError("SKYPILOT_TASK_ID is not set: run this from a SkyPilot task's run command")
    return ClusterNode(
        master_addr=ips[0],
        master_port=DEFAULT_RDZV_PORT,
        node_rank=entrypoint.int_var(environ, "SKYPILOT_NODE_RANK", "SkyPilot") or 0,
        node_count=count,
        run_id=task_id,
    )


def _parser() -> argparse.ArgumentParser:
    return entrypoint.parser(
        "python -m elastrain.platforms.skypilot.entrypoint",
        (__doc__ or "").splitlines()[0],
        count_from="SKYPILOT_NUM_NODES",
        checkpoint_dir=None,  # a bucket: the cluster's own disks go with it
    )


def elastrain_argv(node: ClusterNode, args: argparse.Namespace) -> list[str]:
    return entrypoint.elastrain_argv(node, args, "auto")


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    return entrypoint.main_for("skypilot", _parser, read_skypilot_env, lambda _node: "auto", argv, environ)


if __name__ == "__main__":
    sys.exit(main())
