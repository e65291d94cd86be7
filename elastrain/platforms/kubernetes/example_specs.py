"""The rendered examples in ``launch/kubernetes/`` and their parameters (CI checks they are current)."""

from __future__ import annotations

from elastrain.platforms.kubernetes import kubeflow_trainer
from elastrain.platforms.kubernetes.spec import PyTorchJobParams, etcd_manifests, manifests, warnings
from elastrain.platforms.render import to_yaml, warnings_block

PLATFORM = "kubernetes"
_RENDERED = "Rendered by `python -m elastrain.platforms.kubernetes examples --write`; do not edit by hand."
_SPOT_POOL = (("cloud.google.com/gke-spot", "true"),)
_MOUNT = "/checkpoints"


def _t5(name: str) -> tuple[str, ...]:
    # The script's data, tokenizer and metrics go to the job's claim too: rank 0 builds the data once and the
    # other nodes read it, so it must be on storage every node mounts.
    return ("examples/t5/train.py", "--max-steps", "2000", "--output-dir", f"{_MOUNT}/{name}-output")


C10D = PyTorchJobParams(
    name="t5-elastic",
    script=_t5("t5-elastic"),
    min_nodes=1,
    max_nodes=4,
    nproc_per_node=1,
    cpu="4",
    memory="8Gi",
    checkpoint_mount=_MOUNT,
    node_selector=_SPOT_POOL,
    env=(("OMP_NUM_THREADS", "1"),),
)

ETCD_V3 = PyTorchJobParams(
    name="t5-elastic-etcd",
    script=_t5("t5-elastic-etcd"),
    min_nodes=2,
    max_nodes=8,
    nproc_per_node=4,
    gpus=4,
    memory="64Gi",
    rdzv_backend="etcd-v3",
    rdzv_endpoint="elastrain-etcd.default.svc:2379",
    grace_period_s=120,
    checkpoint_mount=_MOUNT,
    node_selector=_SPOT_POOL,
)

# Kubeflow Trainer v2: the same two jobs as TrainJobs (names of their own: each job has its own claim) and the
# ClusterTrainingRuntimes they name.
TRAINJOB_C10D = kubeflow_trainer.TrainJobParams(
    **{**C10D.__dict__, "name": "t5-trainjob", "script": _t5("t5-trainjob"), "rdzv_endpoint": None}
)
TRAINJOB_ETCD_V3 = kubeflow_trainer.TrainJobParams(
    **{**ETCD_V3.__dict__, "name": "t5-trainjob-etcd", "script": _t5("t5-trainjob-etcd")},
    runtime_name="elastrain-torch-gpu",
)

FILES = {
    "pytorchjob-c10d.yaml": C10D,
    "pytorchjob-etcd-v3.yaml": ETCD_V3,
    "trainjob-c10d.yaml": TRAINJOB_C10D,
    "trainjob-etcd-v3.yaml": TRAINJOB_ETCD_V3,
}
ETCD_FILE = "etcd.yaml"


def apply_command(fname: str) -> str:
    """How to submit a rendered file, from the repository root."""
    return f"kubectl apply -f launch/{PLATFORM}/{fname}"


def rendered() -> dict[str, str]:
    """File name → YAML text for every example."""
    out: dict[str, str] = {}
    for fname, params in FILES.items():
        submit = f"Apply from the repository root: {apply_command(fname)}"
        if isinstance(params, kubeflow_trainer.TrainJobParams):
            header = (
                "Kubeflow Trainer v2 (trainer.kubeflow.org/v1alpha1): the runtime, the job's checkpoint claim and "
                f"the TrainJob.\n{_RENDERED}\n{submit}"
            )
            notes = kubeflow_trainer.warnings(params)
            docs = kubeflow_trainer.manifests(params)
        else:
            header = f"Kubeflow training operator v1 PyTorchJob and its checkpoint claim.\n{_RENDERED}\n{submit}"
            notes, docs = warnings(params), manifests(params)
        out[fname] = to_yaml(docs, header=header + warnings_block(notes))
    etcd_header = (
        "A one-member etcd for --rdzv-backend etcd-v3, on on-demand nodes (not the spot pool).\n"
        f"{_RENDERED}\nApply from the repository root: {apply_command(ETCD_FILE)}"
    )
    out[ETCD_FILE] = to_yaml(etcd_manifests(node_selector=(("example.com/pool", "on-demand"),)), header=etcd_header)
    return out
