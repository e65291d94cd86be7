"""Kubernetes: elastic Kubeflow jobs running elastrain-run (``python -m elastrain.platforms.kubernetes``).

``kubeflow_trainer``: Kubeflow Trainer v2 (TrainJob + ClusterTrainingRuntime); ``spec``: the v1 PyTorchJob and an etcd.
"""

from elastrain.platforms.kubernetes.kubeflow_trainer import (
    TrainJobParams,
    cluster_training_runtime,
    trainer_pet_env,
    trainjob,
)
from elastrain.platforms.kubernetes.spec import (
    PyTorchJobParams,
    etcd_manifests,
    kubeflow_pet_env,
    manifests,
    pod_template,
    pytorchjob,
    warnings,
)

__all__ = [
    "PyTorchJobParams",
    "TrainJobParams",
    "cluster_training_runtime",
    "etcd_manifests",
    "kubeflow_pet_env",
    "manifests",
    "pod_template",
    "pytorchjob",
    "trainer_pet_env",
    "trainjob",
    "warnings",
]
