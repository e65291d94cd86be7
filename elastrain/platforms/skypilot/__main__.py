"""``python -m elastrain.platforms.skypilot``: render a SkyPilot managed-job task running elastrain.

python -m elastrain.platforms.skypilot render --name t5 --checkpoint-url s3://bucket/ckpt --max-nodes 4 \\
    --accelerators L4:1 --infra aws --infra gcp --extras t5 -- examples/t5/train.py > t5.yaml
sky jobs launch t5.yaml           # from the repository root: the workdir (.) is uploaded to every node
python -m elastrain.platforms.skypilot examples          # is launch/skypilot/ up to date? (--write)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from elastrain.errors import LaunchSpecError
from elastrain.platforms.render import examples_command, to_yaml
from elastrain.platforms.skypilot import example_specs as examples
from elastrain.platforms.skypilot import schema
from elastrain.platforms.skypilot.spec import STRATEGIES, SkyPilotJobParams, task, warnings


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m elastrain.platforms.skypilot", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("render", help="the task YAML on stdout (checked against the kept schema)")
    r.add_argument("--name", required=True)
    r.add_argument("--checkpoint-url", required=True, help="a bucket URL: s3://, gs://, az://...")
    r.add_argument("--min-nodes", type=int, default=1)
    r.add_argument("--max-nodes", type=int, default=2)
    r.add_argument("--nproc-per-node", default=None, help="default: gpu with --accelerators, else 1")
    r.add_argument("--accelerators", default=None, help="per node, e.g. A100:8")
    r.add_argument("--cpus", default=None, help="per node, e.g. 8+")
    r.add_argument("--infra", action="append", default=[], help="aws, gcp/us-central1, k8s... (repeat: any of)")
    r.add_argument("--on-demand", action="store_true", help="no spot instances")
    r.add_argument("--recovery-strategy", default="EAGER_NEXT_REGION", choices=STRATEGIES)
    r.add_argument("--max-restarts-on-errors", type=int, default=0)
    r.add_argument("--rdzv-backend", default="c10d")
    r.add_argument("--rdzv-endpoint", default=None)
    r.add_argument("--max-restarts", type=int, default=3)
    r.add_argument("--preemption-watchers", default="auto")
    r.add_argument("--workdir", default=".", help="uploaded to every node; relative to where sky jobs launch runs")
    r.add_argument("--extras", default="", help="elastrain's extras the script needs, comma-separated (t5)")
    r.add_argument(
        "--setup", default=None, help="install commands (default: tools/install.sh .venv with the extras it needs)"
    )
    r.add_argument("script", nargs=argparse.REMAINDER, help="-- training script and its arguments")
    x = sub.add_parser("examples", help="check or rewrite launch/skypilot/")
    x.add_argument("--write", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    try:
        if a.command == "examples":
            return examples_command(a.write, examples.rendered, examples.PLATFORM)
        p = SkyPilotJobParams(
            name=a.name,
            script=tuple(a.script[1:] if a.script[:1] == ["--"] else a.script),
            checkpoint_url=a.checkpoint_url,
            min_nodes=a.min_nodes,
            max_nodes=a.max_nodes,
            nproc_per_node=a.nproc_per_node,
            accelerators=a.accelerators,
            cpus=a.cpus,
            infra=tuple(a.infra),
            use_spot=not a.on_demand,
            recovery_strategy=a.recovery_strategy,
            max_restarts_on_errors=a.max_restarts_on_errors,
            rdzv_backend=a.rdzv_backend,
            rdzv_endpoint=a.rdzv_endpoint,
            max_restarts=a.max_restarts,
            preemption_watchers=a.preemption_watchers,
            workdir=a.workdir,
            extras=tuple(e for e in a.extras.split(",") if e),
            setup=a.setup,
        )
        doc = task(p)
        schema.validate(doc)
    except LaunchSpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for w in warnings(p):
        print(f"warning: {w}", file=sys.stderr)
    sys.stdout.write(to_yaml([doc]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
