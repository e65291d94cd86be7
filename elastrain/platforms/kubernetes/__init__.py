"""Kubernetes: an elastic Kubeflow PyTorchJob running elastrain-run (``python -m elastrain.platforms.kubernetes``)."""

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
    "etcd_manifests",
    "kubeflow_pet_env",
    "manifests",
    "pod_template",
    "pytorchjob",
    "warnings",
]
