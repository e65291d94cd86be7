"""The rendered examples in ``launch/kubernetes/`` and their parameters (CI checks they are current)."""

from __future__ import annotations

from elastrain.platforms.kubernetes import kubeflow_trainer
from elastrain.platforms.kubernetes.spec import PyTorchJobParams, etcd_manifests, manifests, warnings
from elastrain.platforms.render import to_yaml, warnings_block

PLATFORM = "kubernetes"

_T5 = ("examples/t5/train.py", "--steps", "2000")
_SPOT_POOL = (("cloud.google.com/gke-spot", "true"),)

C10D = PyTorchJobParams(
    name="t5-elastic",
    image="ghcr.io/example/elastrain-t5:0.1.0",
    script=_T5,
    min_nodes=1,
    max_nodes=4,
    nproc_per_node=1,
    cpu="4",
    memory="8Gi",
    node_selector=_SPOT_POOL,
    env=(("OMP_NUM_THREADS", "1"),),
)

ETCD_V3 = PyTorchJobParams(
    name="t5-elastic-etcd",
    image="ghcr.io/example/elastrain-t5:0.1.0",
    script=_T5,
    min_nodes=2,
    max_nodes=8,
    nproc_per_node=4,
    gpus=4,
    memory="64Gi",
    rdzv_backend="etcd-v3",
    rdzv_endpoint="elastrain-etcd.default.svc:2379",
    grace_period_s=120,
    node_selector=_SPOT_POOL,
)

# Kubeflow Trainer v2: the same two jobs as a TrainJob and its ClusterTrainingRuntime.
TRAINJOB_C10D = kubeflow_trainer.TrainJobParams(**{**C10D.__dict__, "rdzv_endpoint": None})
TRAINJOB_ETCD_V3 = kubeflow_trainer.TrainJobParams(**ETCD_V3.__dict__, runtime_name="elastrain-torch-gpu")


def rendered() -> dict[str, str]:
    """File name → YAML text for every example."""
    out: dict[str, str] = {}
    for fname, params in (("pytorchjob-c10d.yaml", C10D), ("pytorchjob-etcd-v3.yaml", ETCD_V3)):
        header = "Rendered by `python -m elastrain.platforms.kubernetes examples --write`; do not edit by hand."
        out[fname] = to_yaml(manifests(params), header=header + warnings_block(warnings(params)))
    for fname, t in (("trainjob-c10d.yaml", TRAINJOB_C10D), ("trainjob-etcd-v3.yaml", TRAINJOB_ETCD_V3)):
        header = (
            "Kubeflow Trainer v2 (trainer.kubeflow.org/v1alpha1): the runtime, the checkpoint claim and the TrainJob.\n"
            "Rendered by `python -m elastrain.platforms.kubernetes examples --write`; do not edit by hand."
        )
        out[fname] = to_yaml(
            kubeflow_trainer.manifests(t), header=header + warnings_block(kubeflow_trainer.warnings(t))
        )
    etcd_header = (
        "A one-member etcd for --rdzv-backend etcd-v3, on on-demand nodes (not the spot pool).\n"
        "Rendered by `python -m elastrain.platforms.kubernetes examples --write`; do not edit by hand."
    )
    out["etcd.yaml"] = to_yaml(etcd_manifests(node_selector=(("example.com/pool", "on-demand"),)), header=etcd_header)
    return out
