"""Offline validation of the rendered manifests against schemas.

- Core kinds (PersistentVolumeClaim, Service, StatefulSet) and the worker ``PodTemplateSpec`` inside
  the PyTorchJob: the Kubernetes OpenAPI schemas shipped by ``kubernetes-validate`` (strict mode:
  unknown fields are errors), no cluster needed.
- The PyTorchJob itself: :data:`PYTORCHJOB_SCHEMA`, the fields of Kubeflow's ``kubeflow.org/v1``
  types (``pytorch_types.go``: ``PyTorchJobSpec``, ``ElasticPolicy``, ``RDZVConf``; ``ReplicaSpec``
  and ``RunPolicy`` from the common types), with unknown fields as errors.

Both need the optional packages ``jsonschema`` and ``kubernetes-validate`` (``pip install
kubernetes-validate``); :func:`validate` raises :class:`LaunchSpecError` naming them when missing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from elastrain.errors import LaunchSpecError

KUBERNETES_VERSION = "1.30"

_INT32 = {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1}
_NONNEG32 = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}

_REPLICA_SPEC = {
    "type": "object",
    "additionalProperties": False,
    "required": ["template"],
    "properties": {
        "replicas": _NONNEG32,
        "template": {"type": "object"},
        "restartPolicy": {"enum": ["Always", "OnFailure", "Never", "ExitCode"]},
    },
}

PYTORCHJOB_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "kubeflow.org/v1"},
        "kind": {"const": "PyTorchJob"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "required": ["pytorchReplicaSpecs"],
            "additionalProperties": False,
            "properties": {
                "runPolicy": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "cleanPodPolicy": {"enum": ["All", "Running", "None"]},
                        "ttlSecondsAfterFinished": _INT32,
                        "activeDeadlineSeconds": {"type": "integer"},
                        "backoffLimit": _INT32,
                        "schedulingPolicy": {"type": "object"},
                        "suspend": {"type": "boolean"},
                        "managedBy": {"type": "string"},
                    },
                },
                "elasticPolicy": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "minReplicas": _INT32,
                        "maxReplicas": _INT32,
                        "rdzvBackend": {"type": "string"},
                        "rdzvPort": _INT32,
                        "rdzvHost": {"type": "string"},
                        "rdzvId": {"type": "string"},
                        "rdzvConf": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {"key": {"type": "string"}, "value": {"type": "string"}},
                            },
                        },
                        "standalone": {"type": "boolean"},
                        "nProcPerNode": _INT32,
                        "maxRestarts": _INT32,
                        "metrics": {"type": "array", "items": {"type": "object"}},
                    },
                },
                "nprocPerNode": {"type": "string"},
                "pytorchReplicaSpecs": {
                    "type": "object",
                    "additionalProperties": False,
                    "minProperties": 1,
                    "properties": {"Master": _REPLICA_SPEC, "Worker": _REPLICA_SPEC},
                },
            },
        },
    },
}


def _libs() -> tuple[Any, Any]:
    try:
        import jsonschema
        import kubernetes_validate
    except ImportError as exc:
        raise LaunchSpecError(
            f"schema validation needs jsonschema and kubernetes-validate ({exc.name} is missing): "
            "pip install kubernetes-validate"
        ) from None
    return jsonschema, kubernetes_validate


def _path(error: Any) -> str:
    return "/".join(str(p) for p in error.absolute_path) or "(top)"


def validate_core(doc: dict[str, Any], version: str = KUBERNETES_VERSION) -> None:
    """A core Kubernetes object against the OpenAPI schema of ``version`` (strict)."""
    _, kv = _libs()
    try:
        kv.validate(doc, version, strict=True)
    except kv.ValidationError as exc:
        raise LaunchSpecError(f"{doc.get('kind')} {_path(exc)}: {exc.message}") from None


def validate_pytorchjob(doc: dict[str, Any], version: str = KUBERNETES_VERSION) -> None:
    jsonschema, _ = _libs()
    try:
        jsonschema.validate(doc, PYTORCHJOB_SCHEMA)
    except jsonschema.ValidationError as exc:
        raise LaunchSpecError(f"PyTorchJob {_path(exc)}: {exc.message}") from None
    for rtype, rspec in doc["spec"]["pytorchReplicaSpecs"].items():
        template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"{rtype.lower()}"}}
        try:
            validate_core({**template, "template": rspec["template"]}, version)
        except LaunchSpecError as exc:
            raise LaunchSpecError(f"PyTorchJob pytorchReplicaSpecs/{rtype}/template: {exc}") from None


def validate(docs: Sequence[dict[str, Any]], version: str = KUBERNETES_VERSION) -> None:
    """Validate every manifest; raise :class:`LaunchSpecError` at the first problem."""
    for doc in docs:
        if doc.get("kind") == "PyTorchJob":
            validate_pytorchjob(doc, version)
        else:
            validate_core(doc, version)
