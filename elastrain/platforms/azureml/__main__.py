"""``python -m elastrain.platforms.azureml``: render an AzureML low-priority compute cluster and command job as YAML.

python -m elastrain.platforms.azureml render --compute lowpri --min-nodes 1 --max-nodes 4 -- examples/t5/train.py
python -m elastrain.platforms.azureml examples          # are the rendered examples up to date? (--write)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from elastrain.errors import LaunchSpecError
from elastrain.platforms.azureml import example_specs as examples
from elastrain.platforms.azureml.spec import (
    AzureMLJobParams,
    check_command_job,
    check_compute,
    command_job,
    compute_cluster,
    environment_definition,
    warnings,
)
from elastrain.platforms.render import examples_command, to_yaml


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m elastrain.platforms.azureml", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("render", help="compute.yaml and job.yaml documents on stdout (or into --out)")
    r.add_argument("--compute", default="lowpri-cluster")
    r.add_argument("--experiment-name", default="elastrain")
    r.add_argument("--code", default=".", help="the folder to upload, relative to where job.yaml will be (default .)")
    r.add_argument(
        "--environment", default=None, help="azureml:NAME@latest or file:PATH (default: inline, the --image)"
    )
    r.add_argument("--image", default=AzureMLJobParams.image, help=f"default {AzureMLJobParams.image}")
    r.add_argument("--min-nodes", type=int, default=1)
    r.add_argument("--max-nodes", type=int, default=2)
    r.add_argument("--nproc-per-node", type=int, default=1)
    r.add_argument("--rdzv-backend", default="c10d")
    r.add_argument("--rdzv-endpoint", default=None)
    r.add_argument("--max-restarts", type=int, default=3)
    r.add_argument("--preemption-watchers", default="azure")
    r.add_argument("--vm-size", default=AzureMLJobParams.vm_size)
    r.add_argument("--checkpoint-path", default=None, help="datastore URI (default: the job's own output folder)")
    r.add_argument("--what", choices=("job", "compute", "environment", "both"), default="both")
    r.add_argument("script", nargs=argparse.REMAINDER, help="-- training script and its arguments")
    x = sub.add_parser("examples", help="check or rewrite launch/azureml/")
    x.add_argument("--write", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    try:
        if a.command == "examples":
            return examples_command(a.write, examples.rendered, examples.PLATFORM)
        script = a.script[1:] if a.script[:1] == ["--"] else a.script
        params = AzureMLJobParams(
            script=tuple(script),
            compute=a.compute,
            experiment_name=a.experiment_name,
            code=a.code,
            environment=a.environment,
            image=a.image,
            min_nodes=a.min_nodes,
            max_nodes=a.max_nodes,
            nproc_per_node=a.nproc_per_node,
            rdzv_backend=a.rdzv_backend,
            rdzv_endpoint=a.rdzv_endpoint,
            max_restarts=a.max_restarts,
            preemption_watchers=a.preemption_watchers,
            vm_size=a.vm_size,
            checkpoint_path=a.checkpoint_path,
        )
        docs = []
        if a.what == "environment":
            docs.append(environment_definition(params))
        if a.what in ("compute", "both"):
            docs.append(compute_cluster(params))
            check_compute(docs[-1])
        if a.what in ("job", "both"):
            docs.append(command_job(params))
            check_command_job(docs[-1])
    except LaunchSpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for w in warnings(params):
        print(f"warning: {w}", file=sys.stderr)
    sys.stdout.write(to_yaml(docs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
