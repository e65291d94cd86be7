"""``python -m elastrain.platforms.kubernetes``: render an elastic PyTorchJob (and an etcd) as YAML.

python -m elastrain.platforms.kubernetes render --name t5 --image IMG --min-nodes 1 --max-nodes 4 -- train.py
python -m elastrain.platforms.kubernetes etcd --name elastrain-etcd
python -m elastrain.platforms.kubernetes env job.yaml          # the PET_* variables Kubeflow will inject
python -m elastrain.platforms.kubernetes examples              # are the rendered examples up to date? (--write)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from elastrain.errors import LaunchSpecError
from elastrain.platforms.kubernetes import example_specs as examples
from elastrain.platforms.kubernetes import schema
from elastrain.platforms.kubernetes.spec import PyTorchJobParams, etcd_manifests, kubeflow_pet_env, manifests, warnings
from elastrain.platforms.render import examples_command, from_yaml, to_yaml


def _pairs(values: Sequence[str] | None, flag: str) -> tuple[tuple[str, str], ...]:
    out = []
    for item in values or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise LaunchSpecError(f"{flag}: expected KEY=VALUE, got {item!r}")
        out.append((key, value))
    return tuple(out)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m elastrain.platforms.kubernetes", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)

    r = sub.add_parser("render", help="an elastic PyTorchJob (and its checkpoint PVC) as YAML on stdout")
    r.add_argument("--name", required=True)
    r.add_argument("--image", required=True)
    r.add_argument("--namespace", default="default")
    r.add_argument("--min-nodes", type=int, default=1)
    r.add_argument("--max-nodes", type=int, default=2)
    r.add_argument("--nproc-per-node", type=int, default=1)
    r.add_argument("--rdzv-backend", default="c10d")
    r.add_argument("--rdzv-endpoint", default=None, help="host:port (required for etcd-v3)")
    r.add_argument("--max-restarts", type=int, default=3)
    r.add_argument("--grace-period", type=int, default=90, help="terminationGracePeriodSeconds")
    r.add_argument("--checkpoint-claim", default=None, help="PVC name ('' for none; default <name>-checkpoints)")
    r.add_argument("--no-create-claim", action="store_true", help="the PVC exists already")
    r.add_argument("--checkpoint-mount", default="/checkpoints")
    r.add_argument("--storage", default="20Gi")
    r.add_argument("--storage-class", default=None)
    r.add_argument("--preemption-watchers", default="auto")
    r.add_argument("--cpu", default=None)
    r.add_argument("--memory", default=None)
    r.add_argument("--gpus", type=int, default=0)
    r.add_argument("--env", action="append", metavar="KEY=VALUE")
    r.add_argument("--node-selector", action="append", metavar="KEY=VALUE")
    r.add_argument("--validate", action="store_true", help="check against the schemas (needs kubernetes-validate)")
    r.add_argument("script", nargs=argparse.REMAINDER, help="-- training script and its arguments")

    e = sub.add_parser("etcd", help="a one-member etcd for --rdzv-backend etcd-v3")
    e.add_argument("--name", default="elastrain-etcd")
    e.add_argument("--namespace", default="default")
    e.add_argument("--node-selector", action="append", metavar="KEY=VALUE")

    v = sub.add_parser("env", help="the PET_* variables Kubeflow puts in the pods of a rendered job")
    v.add_argument("file", type=Path)

    x = sub.add_parser("examples", help="check or rewrite launch/kubernetes/")
    x.add_argument("--write", action="store_true")
    return parser


def _render(a: argparse.Namespace) -> int:
    script = [s for s in a.script if s != "--"] if a.script[:1] == ["--"] else list(a.script)
    params = PyTorchJobParams(
        name=a.name,
        image=a.image,
        script=tuple(script),
        min_nodes=a.min_nodes,
        max_nodes=a.max_nodes,
        nproc_per_node=a.nproc_per_node,
        namespace=a.namespace,
        rdzv_backend=a.rdzv_backend,
        rdzv_endpoint=a.rdzv_endpoint,
        max_restarts=a.max_restarts,
        grace_period_s=a.grace_period,
        checkpoint_claim=a.checkpoint_claim,
        create_claim=not a.no_create_claim,
        checkpoint_mount=a.checkpoint_mount,
        checkpoint_storage=a.storage,
        storage_class=a.storage_class,
        preemption_watchers=a.preemption_watchers,
        cpu=a.cpu,
        memory=a.memory,
        gpus=a.gpus,
        env=_pairs(a.env, "--env"),
        node_selector=_pairs(a.node_selector, "--node-selector"),
    )
    docs = manifests(params)
    if a.validate:
        schema.validate(docs)
    for w in warnings(params):
        print(f"warning: {w}", file=sys.stderr)
    sys.stdout.write(to_yaml(docs))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    try:
        if a.command == "render":
            return _render(a)
        if a.command == "etcd":
            docs = etcd_manifests(a.name, a.namespace, node_selector=_pairs(a.node_selector, "--node-selector"))
            sys.stdout.write(to_yaml(docs))
            return 0
        if a.command == "env":
            for doc in from_yaml(a.file.read_text()):
                if doc.get("kind") == "PyTorchJob":
                    for k, val in kubeflow_pet_env(doc).items():
                        print(f"{k}={val}")
            return 0
        return examples_command(a.write, examples.rendered, examples.PLATFORM)
    except LaunchSpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
