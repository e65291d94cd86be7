"""Kubeflow Trainer v2: a ``TrainJob`` and the ``ClusterTrainingRuntime`` it refers to, running elastrain-run.

Kubeflow Trainer v2 (``trainer.kubeflow.org/v1alpha1``) replaces the v1 ``PyTorchJob``. A ``TrainJob``
names a runtime and overrides its image, command, node count and resources; the runtime is a JobSet
template whose replicated job ``node`` runs one indexed pod per node. Its torch plugin
(``pkg/runtime/framework/plugins/torch/torch.go``) puts torchrun's static-rendezvous variables in the
``node`` container: ``PET_NNODES`` (the fixed node count), ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``
(the Job completion index), ``PET_MASTER_ADDR`` (``<job>-node-0-0.<job>``, the first pod) and
``PET_MASTER_PORT`` (29500). :func:`trainer_pet_env` models that. v2 has no elastic policy (the
plugin's own TODO waits for elastic JobSets), so the container's arguments turn those variables into an
elastic rendezvous: ``--nnodes MIN:MAX`` on the command line wins over ``PET_NNODES``; with c10d the
store listens on the first pod at ``$(PET_MASTER_ADDR):$(PET_MASTER_PORT)`` (expanded by the kubelet,
:func:`expand_kubelet_vars`); with etcd-v3 it lives outside the job. ``PET_NPROC_PER_NODE`` reaches
elastrain-run unchanged, like torchrun; ``PET_NODE_RANK`` matters only to a static rendezvous.

What the runtime adds for spot nodes: a pod that is deleted with its node (condition
``DisruptionTarget`` with status ``True``) does not count against the Job's ``backoffLimit``
(``podFailurePolicy``), the Job recreates it with the same index and it joins the running job once
scheduled; a Job that fails anyway restarts the whole JobSet (``failurePolicy.maxRestarts``), which
resumes from the checkpoint volume. ``terminationGracePeriodSeconds`` is the time to checkpoint between
SIGTERM and SIGKILL.

The runtime is cluster-scoped and shared by every TrainJob that names it, so it holds nothing of one job:
the checkpoint claim is the job's own (``<job>-checkpoints``, in the job's namespace, like the v1
PyTorchJob's), and the TrainJob mounts it through ``spec.runtimePatches`` (Kubeflow Trainer v2.2+: the
volume and the ``node`` container's mount, merged into the runtime's pod template by name).
:func:`effective_pod_template` models that merge, with the trainer's image, command, arguments,
environment and resources, to check the pod every node runs.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from elastrain.errors import LaunchSpecError
from elastrain.platforms.kubernetes.spec import (
    Manifest,
    PyTorchJobParams,
    checkpoint_claim,
    job_labels,
    resource_requirements,
)

API_VERSION = "trainer.kubeflow.org/v1alpha1"
API_GROUP = "trainer.kubeflow.org"
TRAINJOB_KIND = "TrainJob"
RUNTIME_KIND = "ClusterTrainingRuntime"
# Names the torch plugin looks for (pkg/constants/constants.go): the replicated job and container
# "node", marked as the trainer step; the rendezvous port it exposes on the first pod.
NODE = "node"
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
ANCESTOR_TRAINER = "trainer"
FRAMEWORK_LABEL = "trainer.kubeflow.org/framework"
TRAINER_PORT = 29500
DEFAULT_RUNTIME = "elastrain-torch"
# A runtime patch's owner: a domain-prefixed path, as the Trainer's webhook requires.
PATCH_MANAGER = "elastrain.github.io/checkpoints"
CHECKPOINT_VOLUME = "checkpoints"
BACKENDS = ("c10d", "etcd-v3")
C10D_ENDPOINT = "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)"
_QUANTITY_SUFFIX = {"m": 0.001, "": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


@dataclass(frozen=True)
class TrainJobParams(PyTorchJobParams):
    """:class:`PyTorchJobParams` plus the runtime's own knobs; the checkpoint claim is the job's own."""

    runtime_name: str = DEFAULT_RUNTIME
    """The ClusterTrainingRuntime the TrainJob refers to (rendered alongside)."""
    pod_restarts: int = 6
    """The Job's backoffLimit: pod failures (not preemptions) before the Job fails."""
    jobset_restarts: int = 3
    """JobSet failurePolicy.maxRestarts: whole-job restarts (they resume from the checkpoint volume)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rdzv_backend not in BACKENDS:
            raise LaunchSpecError(f"rdzv_backend {self.rdzv_backend!r}: choose one of {', '.join(BACKENDS)}")
        if self.rdzv_backend == "c10d" and self.rdzv_endpoint is not None:
            raise LaunchSpecError(
                "rdzv_endpoint: with c10d the store listens on the first pod ($(PET_MASTER_ADDR)); leave it unset"
            )
        if not re.match(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", self.runtime_name) or len(self.runtime_name) > 63:
            raise LaunchSpecError(f"runtime_name {self.runtime_name!r} is not a DNS-1123 label")
        if self.pod_restarts < 0 or self.jobset_restarts < 0:
            raise LaunchSpecError(
                f"pod_restarts/jobset_restarts: must be >= 0, got {self.pod_restarts}/{self.jobset_restarts}"
            )


def rdzv_endpoint(p: TrainJobParams) -> str:
    return p.rdzv_endpoint if p.rdzv_endpoint else C10D_ENDPOINT


def trainer_args(p: TrainJobParams) -> list[str]:
    """elastrain-run's arguments in the ``node`` container; the processes per node come from PET_NPROC_PER_NODE."""
    args = [
        "--nnodes",
        f"{p.min_nodes}:{p.max_nodes}",
        "--rdzv-backend",
        p.rdzv_backend,
        "--rdzv-endpoint",
        rdzv_endpoint(p),
        "--rdzv-id",
        p.name,
        "--max-restarts",
        str(p.max_restarts),
        "--preemption-watchers",
        p.preemption_watchers,
    ]
    if p.checkpoint_dir:
        args += ["--checkpoint-dir", p.checkpoint_dir]
    # The checkpoint asked for on SIGTERM must commit before the kubelet's SIGKILL.
    args += ["--save-timeout", str(max(1, p.grace_period_s - 10))]
    return args + list(p.script)


def cluster_training_runtime(p: TrainJobParams) -> Manifest:
    """The ClusterTrainingRuntime: a JobSet with one indexed Job ``node`` and the grace period (no job's volume)."""
    container: Manifest = {"name": NODE, "image": p.container_image, "command": ["elastrain-run"]}
    pod: Manifest = {"restartPolicy": "Never", "terminationGracePeriodSeconds": p.grace_period_s}
    pod["containers"] = [container]
    if p.node_selector:
        pod["nodeSelector"] = dict(p.node_selector)
    job_spec: Manifest = {
        "backoffLimit": p.pod_restarts,
        # A pod lost with its node (preemption, drain) is replaced without using up the backoff limit.
        "podFailurePolicy": {
            "rules": [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]
        },
        # Shared by every TrainJob that names this runtime: no job's own labels here.
        "template": {"metadata": {"labels": {"app.kubernetes.io/name": "elastrain", **dict(p.labels)}}, "spec": pod},
    }
    return {
        "apiVersion": API_VERSION,
        "kind": RUNTIME_KIND,
        "metadata": {
            "name": p.runtime_name,
            "labels": {FRAMEWORK_LABEL: "torch", "app.kubernetes.io/name": "elastrain"},
        },
        "spec": {
            "mlPolicy": {"numNodes": p.max_nodes, "torch": {}},
            "template": {
                "spec": {
                    "failurePolicy": {"maxRestarts": p.jobset_restarts},
                    "replicatedJobs": [
                        {
                            "name": NODE,
                            "replicas": 1,
                            "template": {"metadata": {"labels": {ANCESTOR_LABEL: ANCESTOR_TRAINER}}, "spec": job_spec},
                        }
                    ],
                }
            },
        },
    }


def checkpoint_patch(p: TrainJobParams) -> Manifest:
    """The runtime patch that mounts this job's checkpoint claim in the ``node`` container."""
    pod = {
        "volumes": [{"name": CHECKPOINT_VOLUME, "persistentVolumeClaim": {"claimName": p.claim_name}}],
        "containers": [{"name": NODE, "volumeMounts": [{"name": CHECKPOINT_VOLUME, "mountPath": p.checkpoint_mount}]}],
    }
    node_job = {"name": NODE, "template": {"spec": {"template": {"spec": pod}}}}
    return {"manager": PATCH_MANAGER, "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [node_job]}}}}


def trainjob(p: TrainJobParams) -> Manifest:
    trainer: Manifest = {
        "image": p.container_image,
        "command": ["elastrain-run"],
        "args": trainer_args(p),
        "numNodes": p.max_nodes,
        "numProcPerNode": p.nproc_per_node,
    }
    if p.env:
        trainer["env"] = [{"name": k, "value": v} for k, v in p.env]
    resources = resource_requirements(p)
    if resources:
        trainer["resourcesPerNode"] = resources
    spec: Manifest = {
        "runtimeRef": {"name": p.runtime_name, "apiGroup": API_GROUP, "kind": RUNTIME_KIND},
        "trainer": trainer,
    }
    if p.claim_name:
        spec["runtimePatches"] = [checkpoint_patch(p)]
    return {
        "apiVersion": API_VERSION,
        "kind": TRAINJOB_KIND,
        "metadata": {"name": p.name, "namespace": p.namespace, "labels": job_labels(p)},
        "spec": spec,
    }


def manifests(p: TrainJobParams) -> list[Manifest]:
    """Everything to ``kubectl apply``: the runtime, the checkpoint claim (if created here), then the TrainJob."""
    claim = checkpoint_claim(p)
    return [cluster_training_runtime(p), *([claim] if claim else []), trainjob(p)]


def warnings(p: TrainJobParams) -> list[str]:
    out: list[str] = []
    if p.rdzv_backend == "c10d":
        out.append(
            f"the c10d rendezvous store lives in the first pod ({p.name}-node-0-0), one of the job's own "
            "(preemptible) nodes: if it is preempted the others lose the rendezvous and the JobSet restarts from "
            "the last checkpoint; use rdzv_backend etcd-v3 with an etcd outside the spot pool to ride through it"
        )
    if not p.claim_name:
        out.append("no checkpoint volume: checkpoints stay inside the pod and are lost with it; set checkpoint_claim")
    if p.grace_period_s < 30:
        out.append(f"grace_period_s={p.grace_period_s}: 30 s or more leaves time to checkpoint after SIGTERM")
    if p.min_nodes == p.max_nodes:
        out.append(f"min_nodes == max_nodes == {p.min_nodes}: the job cannot go on with fewer nodes")
    return out


def _cpu_count(quantity: str | int | None) -> int:
    """Kubernetes ``Quantity.Value()`` of a CPU amount: rounded up to a whole number."""
    if quantity is None:
        return 0
    m = re.fullmatch(r"([0-9.]+)(m|k|M|G|Ki|Mi|Gi)?", str(quantity))
    if not m:
        raise LaunchSpecError(f"cpu {quantity!r} is not a Kubernetes quantity")
    value = float(m.group(1)) * _QUANTITY_SUFFIX[m.group(2) or ""]
    return int(-(-value // 1))


def trainer_pet_env(job: Manifest, runtime: Manifest, completion_index: int) -> dict[str, str]:
    """The PET_* variables Kubeflow Trainer's torch plugin puts in the ``node`` container of pod ``completion_index``.

    A model of ``Torch.EnforceMLPolicy`` (v2.3.0): the node count from ``trainer.numNodes`` (else the
    runtime's ``mlPolicy.numNodes``, else 1); processes per node from ``trainer.numProcPerNode``, else
    ``auto`` which, without GPUs, becomes the CPU request (or limit) rounded up, at least 1.
    ``PET_NODE_RANK`` is a downward-API reference to the completion index, resolved here.
    """
    trainer = job["spec"].get("trainer", {})
    nodes = trainer.get("numNodes") or runtime["spec"].get("mlPolicy", {}).get("numNodes") or 1
    if not 0 <= completion_index < nodes:
        raise LaunchSpecError(f"completion_index {completion_index} is outside 0..{nodes - 1}")
    nproc: str = str(trainer["numProcPerNode"]) if trainer.get("numProcPerNode") is not None else "auto"
    res = trainer.get("resourcesPerNode", {})
    gpus = int(res.get("limits", {}).get("nvidia.com/gpu", 0))
    if nproc == "auto" and gpus == 0:
        cpu = res.get("requests", {}).get("cpu") or res.get("limits", {}).get("cpu")
        nproc = str(max(1, _cpu_count(cpu)))
    name = job["metadata"]["name"]
    return {
        "PET_NNODES": str(nodes),
        "PET_NPROC_PER_NODE": nproc,
        "PET_NODE_RANK": str(completion_index),
        "PET_MASTER_ADDR": f"{name}-{NODE}-0-0.{name}",
        "PET_MASTER_PORT": str(TRAINER_PORT),
    }


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand_kubelet_vars(args: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """The kubelet's ``$(VAR)`` expansion of a container's command and args: ``$$`` is a literal ``$``,
    an unknown ``$(VAR)`` stays as written."""

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return [_VAR.sub(one, a) for a in args]


def node_env(job: Manifest, runtime: Manifest, completion_index: int) -> dict[str, str]:
    """The ``node`` container's environment: the TrainJob's ``env`` values, then the PET_* the plugin upserts."""
    env = {e["name"]: e["value"] for e in job["spec"].get("trainer", {}).get("env", []) if "value" in e}
    return {**env, **trainer_pet_env(job, runtime, completion_index)}


def container_argv(job: Manifest, runtime: Manifest, completion_index: int) -> list[str]:
    """elastrain-run's argv in pod ``completion_index``, after the kubelet's expansion."""
    trainer: dict[str, Any] = job["spec"]["trainer"]
    return expand_kubelet_vars(trainer.get("args", []), node_env(job, runtime, completion_index))


def _merge_by(base: list[Manifest], patch: list[Manifest], key: str) -> list[Manifest]:
    """A strategic-merge-patch of a list keyed by ``key``: items with the same key merge, new ones are appended."""
    out = [dict(item) for item in base]
    for item in patch:
        same = next((o for o in out if o.get(key) == item.get(key)), None)
        if same is None:
            out.append(dict(item))
        else:
            same.update({k: v for k, v in item.items() if k not in ("volumeMounts", "env")})
            for field, field_key in (("volumeMounts", "mountPath"), ("env", "name")):
                if field in item:
                    same[field] = _merge_by(same.get(field, []), item[field], field_key)
    return out


def effective_pod_template(job: Manifest, runtime: Manifest) -> Manifest:
    """The ``node`` pod template the Trainer builds for ``job`` from ``runtime``: the runtime's template with the
    TrainJob's runtime patches merged in (volumes by name, containers by name, mounts by path) and the trainer's
    image, command, arguments, environment and resources set on the ``node`` container."""
    jobs = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    node_job = next((j for j in jobs if j["name"] == NODE), None)
    if node_job is None:
        raise LaunchSpecError(f"runtime {runtime['metadata']['name']!r} has no replicated job {NODE!r}")
    template: Manifest = copy.deepcopy(node_job["template"]["spec"]["template"])
    pod = template["spec"]
    for patch in job["spec"].get("runtimePatches", []):
        for rjob in patch.get("trainingRuntimeSpec", {}).get("template", {}).get("spec", {}).get("replicatedJobs", []):
            if rjob["name"] != NODE:
                continue
            pod_patch = rjob.get("template", {}).get("spec", {}).get("template", {}).get("spec", {})
            for field in ("volumes", "containers", "initContainers"):
                if field in pod_patch:
                    pod[field] = _merge_by(pod.get(field, []), pod_patch[field], "name")
    trainer = job["spec"].get("trainer", {})
    container = next((c for c in pod["containers"] if c["name"] == NODE), None)
    if container is None:
        raise LaunchSpecError(f"runtime {runtime['metadata']['name']!r}: the {NODE!r} job has no {NODE!r} container")
    for field, target in (("image", "image"), ("command", "command"), ("args", "args")):
        if field in trainer:
            container[target] = trainer[field]
    if "env" in trainer:
        container["env"] = _merge_by(container.get("env", []), trainer["env"], "name")
    if "resourcesPerNode" in trainer:
        container["resources"] = trainer["resourcesPerNode"]
    return template
