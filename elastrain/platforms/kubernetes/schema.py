"""Offline validation of the rendered manifests against schemas.

- Core kinds (PersistentVolumeClaim, Service, StatefulSet), the worker ``PodTemplateSpec`` inside
  the PyTorchJob, the ``Job`` templates inside a ClusterTrainingRuntime and the pod a TrainJob's nodes
  run (the runtime's template with the TrainJob's patches and trainer settings): the Kubernetes OpenAPI
  schemas shipped by ``kubernetes-validate``, of every version in :data:`KUBERNETES_VERSIONS` (strict
  mode: unknown fields are errors, and a field one version requires is required), no cluster needed.
- The PyTorchJob itself: :data:`PYTORCHJOB_SCHEMA`, the fields of Kubeflow's ``kubeflow.org/v1``
  types (``pytorch_types.go``: ``PyTorchJobSpec``, ``ElasticPolicy``, ``RDZVConf``; ``ReplicaSpec``
  and ``RunPolicy`` from the common types), with unknown fields as errors.

- Kubeflow Trainer v2's ``TrainJob`` and ``ClusterTrainingRuntime`` (which inlines the JobSet spec and
  its pod templates): the ``openAPIV3Schema`` of the CRD manifests Kubeflow Trainer publishes, kept in
  ``schemas/`` with their release, commit and source (descriptions removed). Like ``kubectl apply
  --validate=strict``, a field the schema does not declare is an error (:func:`strict_schema`); the
  CEL rules (``x-kubernetes-validations``) are not checked. To take a newer release:
  ``python -m elastrain.platforms.kubernetes import-crd CRD.yaml --release vX.Y.Z --source URL``.

They need the optional packages ``jsonschema`` and ``kubernetes-validate`` (``pip install
kubernetes-validate``); :func:`validate` raises :class:`LaunchSpecError` naming them when missing.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

from elastrain.errors import LaunchSpecError
from elastrain.platforms.kubernetes.kubeflow_trainer import effective_pod_template

# The Kubernetes releases a rendered manifest must suit: every one kubernetes-validate 1.37.0 has schemas for,
# from the oldest still in the clouds' extended support.
KUBERNETES_VERSIONS = tuple(f"1.{minor}" for minor in range(30, 38))
SCHEMAS_DIR = Path(__file__).resolve().parent / "schemas"
TRAINER_API_VERSION = "trainer.kubeflow.org/v1alpha1"
# kind -> kept schema file (package data)
TRAINER_SCHEMAS = {
    "TrainJob": "kubeflow-trainer-trainjob.json",
    "ClusterTrainingRuntime": "kubeflow-trainer-clustertrainingruntime.json",
}

_DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
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


def crd_schema(crd: Mapping[str, Any], version: str) -> dict[str, Any]:
    """The ``openAPIV3Schema`` of one served version of a CRD manifest, without its descriptions."""

    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k != "description"}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    for v in crd.get("spec", {}).get("versions", []):
        if v.get("name") == version:
            return dict(strip(v["schema"]["openAPIV3Schema"]))
    raise LaunchSpecError(f"CRD {crd.get('metadata', {}).get('name')!r} has no version {version!r}")


def strict_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """``schema`` with every object that lists its properties closed to others (``additionalProperties: false``),
    except where Kubernetes keeps unknown fields (``x-kubernetes-preserve-unknown-fields``)."""
    out = copy.deepcopy(dict(schema))

    def close(node: Any) -> None:
        if isinstance(node, list):
            for v in node:
                close(v)
            return
        if not isinstance(node, dict):
            return
        if (
            "properties" in node
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            node["additionalProperties"] = False
        for key, value in node.items():
            if key == "properties":
                for sub in value.values():
                    close(sub)
            elif key in ("items", "additionalProperties", "anyOf", "allOf", "oneOf"):
                close(value)

    close(out)
    return out


@cache
def trainer_schema(kind: str) -> dict[str, Any]:
    """The kept, strict schema of a Kubeflow Trainer kind, and where it came from (``release``, ``source``)."""
    if kind not in TRAINER_SCHEMAS:
        raise LaunchSpecError(f"no kept schema for kind {kind!r}; have {', '.join(TRAINER_SCHEMAS)}")
    kept = json.loads((SCHEMAS_DIR / TRAINER_SCHEMAS[kind]).read_text())
    return {**kept, "openAPIV3Schema": strict_schema(kept["openAPIV3Schema"])}


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


def validate_core(doc: dict[str, Any], versions: Sequence[str] = KUBERNETES_VERSIONS) -> None:
    """A core Kubernetes object against the OpenAPI schema of each of ``versions`` (strict)."""
    _, kv = _libs()
    for version in versions:
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as exc:
            raise LaunchSpecError(f"{doc.get('kind')} {_path(exc)}: {exc.message} (Kubernetes {version})") from None


def validate_pytorchjob(doc: dict[str, Any], versions: Sequence[str] = KUBERNETES_VERSIONS) -> None:
    jsonschema, _ = _libs()
    try:
        jsonschema.validate(doc, PYTORCHJOB_SCHEMA)
    except jsonschema.ValidationError as exc:
        raise LaunchSpecError(f"PyTorchJob {_path(exc)}: {exc.message}") from None
    for rtype, rspec in doc["spec"]["pytorchReplicaSpecs"].items():
        template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"{rtype.lower()}"}}
        try:
            validate_core({**template, "template": rspec["template"]}, versions)
        except LaunchSpecError as exc:
            raise LaunchSpecError(f"PyTorchJob pytorchReplicaSpecs/{rtype}/template: {exc}") from None


def validate_runtime_jobs(doc: Mapping[str, Any], versions: Sequence[str] = KUBERNETES_VERSIONS) -> None:
    """Each replicated Job template of a ClusterTrainingRuntime, as a ``batch/v1`` Job of each version (strict):
    the CRD inlines the JobSpec of the release it was built with, which may accept what an older one refuses."""
    for rjob in doc["spec"]["template"]["spec"].get("replicatedJobs", []):
        template = rjob.get("template", {})
        job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": rjob["name"]}, "spec": template["spec"]}
        try:
            validate_core(job, versions)
        except LaunchSpecError as exc:
            raise LaunchSpecError(f"ClusterTrainingRuntime replicatedJobs/{rjob['name']}/template: {exc}") from None


def validate_node_pod(job: Mapping[str, Any], runtime: Mapping[str, Any], versions: Sequence[str]) -> None:
    """The pod a TrainJob's nodes run (:func:`kubeflow_trainer.effective_pod_template`), as a core PodTemplate."""
    template = effective_pod_template(dict(job), dict(runtime))
    doc = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "node"}, "template": template}
    try:
        validate_core(doc, versions)
    except LaunchSpecError as exc:
        raise LaunchSpecError(f"TrainJob {job['metadata']['name']}: the node pod: {exc}") from None


@cache
def _validator(kind: str) -> Any:
    import jsonschema

    # The kept schemas are checked once by the tests; validating them again on every call is slow.
    return jsonschema.Draft7Validator(trainer_schema(kind)["openAPIV3Schema"])


def validate_trainer(doc: Mapping[str, Any]) -> None:
    """A TrainJob or ClusterTrainingRuntime against the kept CRD schema of its kind (strict)."""
    try:
        import jsonschema
    except ImportError:
        raise LaunchSpecError("schema validation needs jsonschema: pip install jsonschema") from None
    kind = str(doc.get("kind"))
    if doc.get("apiVersion") != TRAINER_API_VERSION:
        raise LaunchSpecError(f"{kind}: apiVersion must be {TRAINER_API_VERSION}, got {doc.get('apiVersion')!r}")
    kept = trainer_schema(kind)
    try:
        _validator(kind).validate(doc)
    except jsonschema.ValidationError as exc:
        raise LaunchSpecError(
            f"{kind} {_path(exc)}: {exc.message} (schema of Kubeflow Trainer {kept['release']})"
        ) from None
    name = doc.get("metadata", {}).get("name", "")
    if not isinstance(name, str) or not _DNS_1123.match(name) or len(name) > 63:
        raise LaunchSpecError(f"{kind} metadata/name {name!r} is not a DNS-1123 label")


def validate(docs: Sequence[dict[str, Any]], versions: Sequence[str] = KUBERNETES_VERSIONS) -> None:
    """Validate every manifest, and the pod of each TrainJob whose runtime is among them; raise
    :class:`LaunchSpecError` at the first problem."""
    runtimes = {d["metadata"]["name"]: d for d in docs if d.get("kind") == "ClusterTrainingRuntime"}
    for doc in docs:
        if doc.get("kind") == "PyTorchJob":
            validate_pytorchjob(doc, versions)
        elif doc.get("kind") in TRAINER_SCHEMAS:
            validate_trainer(doc)
            if doc["kind"] == "ClusterTrainingRuntime":
                validate_runtime_jobs(doc, versions)
            elif doc["spec"]["runtimeRef"]["name"] in runtimes:
                validate_node_pod(doc, runtimes[doc["spec"]["runtimeRef"]["name"]], versions)
        else:
            validate_core(doc, versions)
