"""``python -m elastrain.platforms.slurm``: render an sbatch script running one elastrain-run per node.

python -m elastrain.platforms.slurm render --name t5 --min-nodes 1 --max-nodes 4 --checkpoint-dir /shared/ckpt \\
    --extras t5 -- examples/t5/train.py --max-steps 100 > t5.sbatch   # its header says how to make .venv
python -m elastrain.platforms.slurm examples          # is launch/slurm/ up to date? (--write)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from elastrain.errors import LaunchSpecError
from elastrain.platforms.render import examples_command
from elastrain.platforms.slurm import example_specs as examples
from elastrain.platforms.slurm.spec import SlurmJobParams, sbatch_script, warnings


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m elastrain.platforms.slurm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("render", help="the sbatch script on stdout")
    r.add_argument("--name", required=True)
    r.add_argument("--checkpoint-dir", required=True, help="on a filesystem every node mounts, or a bucket URL")
    r.add_argument("--min-nodes", type=int, default=1)
    r.add_argument("--max-nodes", type=int, default=2)
    r.add_argument("--nproc-per-node", default="1")
    r.add_argument("--time", default="04:00:00")
    r.add_argument("--partition", default=None)
    r.add_argument("--account", default=None)
    r.add_argument("--gpus-per-node", type=int, default=0)
    r.add_argument("--cpus-per-node", type=int, default=None)
    r.add_argument("--grace-period", type=int, default=120, help="seconds of SIGTERM before the time limit")
    r.add_argument("--rdzv-backend", default="c10d")
    r.add_argument("--rdzv-endpoint", default=None)
    r.add_argument("--max-restarts", type=int, default=3)
    r.add_argument("--preemption-watchers", default="none")
    r.add_argument("--venv", default=".venv", help="made by tools/install.sh in the submit directory (default .venv)")
    r.add_argument("--extras", default="", help="elastrain's extras the script needs, comma-separated (t5)")
    r.add_argument("--python", default=None, help="the step's interpreter (default: the venv's)")
    r.add_argument("script", nargs=argparse.REMAINDER, help="-- training script and its arguments")
    x = sub.add_parser("examples", help="check or rewrite launch/slurm/")
    x.add_argument("--write", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    try:
        if a.command == "examples":
            return examples_command(a.write, examples.rendered, examples.PLATFORM)
        p = SlurmJobParams(
            name=a.name,
            script=tuple(a.script[1:] if a.script[:1] == ["--"] else a.script),
            checkpoint_dir=a.checkpoint_dir,
            min_nodes=a.min_nodes,
            max_nodes=a.max_nodes,
            nproc_per_node=a.nproc_per_node,
            time_limit=a.time,
            partition=a.partition,
            account=a.account,
            gpus_per_node=a.gpus_per_node,
            cpus_per_node=a.cpus_per_node,
            grace_period_s=a.grace_period,
            rdzv_backend=a.rdzv_backend,
            rdzv_endpoint=a.rdzv_endpoint,
            max_restarts=a.max_restarts,
            preemption_watchers=a.preemption_watchers,
            venv=a.venv,
            extras=tuple(e for e in a.extras.split(",") if e),
            python=a.python,
        )
    except LaunchSpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for w in warnings(p):
        print(f"warning: {w}", file=sys.stderr)
    sys.stdout.write(sbatch_script(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
