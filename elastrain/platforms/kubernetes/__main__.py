"""``python -m elastrain.platforms.kubernetes``: render elastic Kubeflow jobs (v1 PyTorchJob, v2 TrainJob) as YAML.

python -m elastrain.platforms.kubernetes render --name t5 --min-nodes 1 --max-nodes 4 -- examples/t5/train.py
python -m elastrain.platforms.kubernetes trainjob --name t5 --min-nodes 1 --max-nodes 4 -- examples/t5/train.py
python -m elastrain.platforms.kubernetes etcd --name elastrain-etcd
python -m elastrain.platforms.kubernetes env job.yaml      # the PET_* variables Kubeflow gives each pod
python -m elastrain.platforms.kubernetes examples          # are launch/kubernetes/ up to date? (--write)
python -m elastrain.platforms.kubernetes import-crd CRD.yaml --release v2.3.0 --source URL   # keep a new schema
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from elastrain.errors import LaunchSpecError
from elastrain.platforms import image
from elastrain.platforms.kubernetes import example_specs as examples
from elastrain.platforms.kubernetes import kubeflow_trainer, schema, spec
from elastrain.platforms.render import examples_command, from_yaml, to_yaml


def _pairs(values: Sequence[str] | None, flag: str) -> tuple[tuple[str, str], ...]:
    out = []
    for item in values or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise LaunchSpecError(f"{flag}: expected KEY=VALUE, got {item!r}")
        out.append((key, value))
    return tuple(out)


def _job_flags(r: argparse.ArgumentParser, claim_help: str) -> None:
    r.add_argument("--name", required=True)
    r.add_argument(
        "--image",
        default=None,
        help=f"default: the repository's Dockerfile build, {image.GPU_IMAGE} with --gpus, else {image.CPU_IMAGE}",
    )
    r.add_argument("--namespace", default="default")
    r.add_argument("--min-nodes", type=int, default=1)
    r.add_argument("--max-nodes", type=int, default=2)
    r.add_argument("--nproc-per-node", type=int, default=1)
    r.add_argument("--rdzv-backend", default="c10d")
    r.add_argument("--rdzv-endpoint", default=None, help="host:port (required for etcd-v3)")
    r.add_argument("--max-restarts", type=int, default=3, help="elastrain-run's worker restarts")
    r.add_argument("--grace-period", type=int, default=90, help="terminationGracePeriodSeconds")
    r.add_argument("--checkpoint-claim", default=None, help=claim_help)
    r.add_argument("--no-create-claim", action="store_true", help="the PVC exists already")
    r.add_argument("--checkpoint-mount", default="/checkpoints")
    r.add_argument("--storage", default="20Gi")
    r.add_argument(
        "--storage-class",
        default=spec.DEFAULT_STORAGE_CLASS,
        help=f"a StorageClass with ReadWriteMany (default {spec.DEFAULT_STORAGE_CLASS}); '' for a pre-made volume",
    )
    r.add_argument("--preemption-watchers", default="auto")
    r.add_argument("--cpu", default=None)
    r.add_argument("--memory", default=None)
    r.add_argument("--gpus", type=int, default=0)
    r.add_argument("--env", action="append", metavar="KEY=VALUE")
    r.add_argument("--node-selector", action="append", metavar="KEY=VALUE")
    r.add_argument("--validate", action="store_true", help="check against the schemas (needs elastrain[kubernetes])")
    r.add_argument("script", nargs=argparse.REMAINDER, help="-- training script and its arguments")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m elastrain.platforms.kubernetes", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)

    r = sub.add_parser("render", help="an elastic v1 PyTorchJob (and its checkpoint PVC) as YAML on stdout")
    _job_flags(r, "PVC name ('' for none; default <name>-checkpoints)")

    t = sub.add_parser("trainjob", help="a Kubeflow Trainer v2 ClusterTrainingRuntime, PVC and TrainJob")
    _job_flags(t, "PVC name, mounted through the TrainJob's runtimePatches ('' for none; default <name>-checkpoints)")
    t.add_argument("--runtime-name", default=kubeflow_trainer.DEFAULT_RUNTIME)
    t.add_argument("--pod-restarts", type=int, default=6, help="the Job's backoffLimit (preemptions not counted)")
    t.add_argument("--jobset-restarts", type=int, default=3, help="whole-job restarts (failurePolicy.maxRestarts)")

    e = sub.add_parser("etcd", help="a one-member etcd for --rdzv-backend etcd-v3")
    e.add_argument("--name", default="elastrain-etcd")
    e.add_argument("--namespace", default="default")
    e.add_argument("--node-selector", action="append", metavar="KEY=VALUE")

    v = sub.add_parser("env", help="the PET_* variables Kubeflow puts in the pods of a rendered job")
    v.add_argument("file", type=Path)

    x = sub.add_parser("examples", help="check or rewrite launch/kubernetes/")
    x.add_argument("--write", action="store_true")

    c = sub.add_parser("import-crd", help="keep the schema of a Kubeflow Trainer CRD manifest (maintainers)")
    c.add_argument("crd", type=Path)
    c.add_argument("--release", required=True, help="the Kubeflow Trainer release it comes from, e.g. v2.3.0")
    c.add_argument("--source", required=True, help="where the manifest was read (URL at a tag or commit)")
    c.add_argument("--commit", default="")
    c.add_argument("--version", default="v1alpha1")
    return parser


def _params(a: argparse.Namespace) -> dict[str, Any]:
    script = a.script[1:] if a.script[:1] == ["--"] else list(a.script)
    return {
        "name": a.name,
        "image": a.image,
        "script": tuple(script),
        "min_nodes": a.min_nodes,
        "max_nodes": a.max_nodes,
        "nproc_per_node": a.nproc_per_node,
        "namespace": a.namespace,
        "rdzv_backend": a.rdzv_backend,
        "rdzv_endpoint": a.rdzv_endpoint,
        "max_restarts": a.max_restarts,
        "grace_period_s": a.grace_period,
        "checkpoint_claim": a.checkpoint_claim,
        "create_claim": not a.no_create_claim,
        "checkpoint_mount": a.checkpoint_mount,
        "checkpoint_storage": a.storage,
        "storage_class": a.storage_class,
        "preemption_watchers": a.preemption_watchers,
        "cpu": a.cpu,
        "memory": a.memory,
        "gpus": a.gpus,
        "env": _pairs(a.env, "--env"),
        "node_selector": _pairs(a.node_selector, "--node-selector"),
    }


def _emit(docs: list[dict[str, Any]], notes: list[str], validate: bool) -> int:
    if validate:
        schema.validate(docs)
    for w in notes:
        print(f"warning: {w}", file=sys.stderr)
    sys.stdout.write(to_yaml(docs))
    return 0


def _env(path: Path) -> int:
    docs = from_yaml(path.read_text())
    runtimes = {d["metadata"]["name"]: d for d in docs if d.get("kind") == kubeflow_trainer.RUNTIME_KIND}
    for doc in docs:
        if doc.get("kind") == spec.KIND:
            for k, val in spec.kubeflow_pet_env(doc).items():
                print(f"{k}={val}")
        elif doc.get("kind") == kubeflow_trainer.TRAINJOB_KIND:
            ref = doc["spec"]["runtimeRef"]["name"]
            if ref not in runtimes:
                raise LaunchSpecError(f"{path}: TrainJob refers to runtime {ref!r}, which is not in this file")
            env = kubeflow_trainer.trainer_pet_env(doc, runtimes[ref], 0)
            print(f"# {doc['metadata']['name']}: pod i of {env['PET_NNODES']} has PET_NODE_RANK=i; the rest alike")
            for k, val in env.items():
                print(f"{k}={val}")
            print(f"# runs: elastrain-run {' '.join(kubeflow_trainer.container_argv(doc, runtimes[ref], 0))}")
    return 0


def _import_crd(a: argparse.Namespace) -> int:
    crd = yaml.safe_load(a.crd.read_text())
    kind = crd["spec"]["names"]["kind"]
    if kind not in schema.TRAINER_SCHEMAS:
        raise LaunchSpecError(
            f"{a.crd}: kind {kind!r} is not one elastrain renders ({', '.join(schema.TRAINER_SCHEMAS)})"
        )
    kept = {
        "release": a.release,
        "commit": a.commit,
        "source": a.source,
        "crd": crd["metadata"]["name"],
        "version": a.version,
        "note": "openAPIV3Schema of the CRD, description fields removed; "
        "written by python -m elastrain.platforms.kubernetes import-crd",
        "openAPIV3Schema": schema.crd_schema(crd, a.version),
    }
    out = schema.SCHEMAS_DIR / schema.TRAINER_SCHEMAS[kind]
    out.write_text(json.dumps(kept, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    try:
        if a.command == "render":
            p = spec.PyTorchJobParams(**_params(a))
            return _emit(spec.manifests(p), spec.warnings(p), a.validate)
        if a.command == "trainjob":
            t = kubeflow_trainer.TrainJobParams(
                **_params(a),
                runtime_name=a.runtime_name,
                pod_restarts=a.pod_restarts,
                jobset_restarts=a.jobset_restarts,
            )
            return _emit(kubeflow_trainer.manifests(t), kubeflow_trainer.warnings(t), a.validate)
        if a.command == "etcd":
            docs = spec.etcd_manifests(a.name, a.namespace, node_selector=_pairs(a.node_selector, "--node-selector"))
            sys.stdout.write(to_yaml(docs))
            return 0
        if a.command == "env":
            return _env(a.file)
        if a.command == "import-crd":
            return _import_crd(a)
        return examples_command(a.write, examples.rendered, examples.PLATFORM)
    except LaunchSpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
