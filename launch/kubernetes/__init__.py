"""Kubernetes: an elastic Kubeflow PyTorchJob running elastrain-run (``python -m launch.kubernetes``)."""

from launch.kubernetes.spec import (
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
