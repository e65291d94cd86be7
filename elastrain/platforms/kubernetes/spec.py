"""An elastic Kubeflow ``PyTorchJob`` for elastrain, built by pure functions from a few parameters.

The job has only ``Worker`` replicas (an elastic job has no special master), an ``elasticPolicy``
(min/max replicas, rendezvous backend, host and port, max restarts), ``spec.nprocPerNode`` (the
training operator v1.7+ field; ``elasticPolicy.nProcPerNode`` is deprecated and its webhook warns), a
``terminationGracePeriodSeconds`` long enough to checkpoint on SIGTERM, and a ``ReadWriteMany``
``PersistentVolumeClaim`` for checkpoints, named after the job, so a pod that replaces a preempted one
resumes from them. The claim names its ``storageClassName`` (:data:`DEFAULT_STORAGE_CLASS` unless told):
a cluster's default class is usually single-writer, and a ``ReadWriteMany`` claim on it stays Pending.

Kubeflow's training operator turns the ``elasticPolicy`` into ``PET_*`` variables in every pod
(:func:`kubeflow_pet_env` mirrors it); ``elastrain-run`` reads them exactly like ``torchrun`` does, so
the container command carries only elastrain's own flags and the training script. The image defaults to
the repository's Dockerfile build (:mod:`elastrain.platforms.image`), whose working directory is the
source checkout: a script path like ``examples/t5/train.py`` resolves there.

Rendezvous: ``c10d`` keeps its store in the pod named by ``rdzvHost`` (Kubeflow's default is
``<job>-worker-0``, a pod as preemptible as the rest: :func:`warnings` says so). ``etcd-v3`` keeps it
in an etcd service outside the job; :func:`etcd_manifests` renders a one-member etcd for that.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from elastrain.errors import LaunchSpecError, UsageError
from elastrain.platforms.image import default_image
from elastrain.preemption.monitor import parse_watchers

API_VERSION = "kubeflow.org/v1"
KIND = "PyTorchJob"
# The operator finds the rendezvous port on this container and port name when rdzvPort is unset.
CONTAINER_NAME = "pytorch"
PORT_NAME = "pytorchjob-port"
DEFAULT_RDZV_PORT = 29400
ETCD_PORT = 2379
ETCD_IMAGE = "quay.io/coreos/etcd:v3.5.17"
BACKENDS = ("c10d", "etcd-v3", "etcd-v2", "etcd")
# A ReadWriteMany class: GKE's Filestore CSI class (enable the driver; it provisions 1 TiB at least). Others:
# azurefile-csi on AKS, an EFS class on EKS (efs-sc in AWS's guide), or any NFS provisioner's class.
DEFAULT_STORAGE_CLASS = "standard-rwx"
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")

Manifest = dict[str, Any]


@dataclass(frozen=True)
class PyTorchJobParams:
    name: str
    """Job name (a DNS-1123 label); pods are <name>-worker-<i>."""
    script: tuple[str, ...]
    """The training script and its arguments, as given to elastrain-run (``-m pkg.train`` works too), relative
    to the image's working directory."""
    image: str | None = None
    """Container image with elastrain and the training code installed; default: the repository's Dockerfile
    build, CUDA with ``gpus``, else CPU (:func:`elastrain.platforms.image.default_image`)."""
    min_nodes: int = 1
    max_nodes: int = 2
    nproc_per_node: int = 1
    namespace: str = "default"
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str | None = None
    """host:port of the rendezvous; default for c10d is <name>-worker-0:29400 (Kubeflow's default host)."""
    max_restarts: int = 3
    grace_period_s: int = 90
    """terminationGracePeriodSeconds: the time between SIGTERM and SIGKILL, to checkpoint and leave."""
    checkpoint_claim: str | None = None
    """PVC for checkpoints (ReadWriteMany); default <name>-checkpoints, one per job; empty string for none."""
    create_claim: bool = True
    checkpoint_mount: str = "/checkpoints"
    checkpoint_storage: str = "20Gi"
    storage_class: str = DEFAULT_STORAGE_CLASS
    """The claim's storageClassName: a class that exists and provides ReadWriteMany; "" binds a pre-made volume."""
    preemption_watchers: str = "auto"
    cpu: str | None = None
    memory: str | None = None
    gpus: int = 0
    env: tuple[tuple[str, str], ...] = ()
    node_selector: tuple[tuple[str, str], ...] = ()
    labels: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not _DNS_LABEL.match(self.name) or len(self.name) > 50:
            raise LaunchSpecError(
                f"name {self.name!r}: use lowercase letters, digits and '-', at most 50 characters "
                "(pod names add '-worker-N' and must fit in 63)"
            )
        if not _DNS_LABEL.match(self.namespace):
            raise LaunchSpecError(f"namespace {self.namespace!r} is not a DNS-1123 label")
        if self.image is not None and not self.image.strip():
            raise LaunchSpecError("image: give the container image that has elastrain and the training code")
        if self.storage_class and (not _DNS_SUBDOMAIN.match(self.storage_class) or len(self.storage_class) > 253):
            raise LaunchSpecError(f"storage_class {self.storage_class!r} is not a StorageClass name")
        if not self.script or not self.script[0].strip():
            raise LaunchSpecError("script: give the training script (and its arguments) to run")
        if self.min_nodes < 1 or self.max_nodes < self.min_nodes:
            raise LaunchSpecError(f"min_nodes/max_nodes: need 1 <= min <= max, got {self.min_nodes}:{self.max_nodes}")
        if self.nproc_per_node < 1:
            raise LaunchSpecError(f"nproc_per_node: must be >= 1, got {self.nproc_per_node}")
        if self.rdzv_backend not in BACKENDS:
            raise LaunchSpecError(f"rdzv_backend {self.rdzv_backend!r}: choose one of {', '.join(BACKENDS)}")
        if self.rdzv_backend != "c10d" and not self.rdzv_endpoint:
            raise LaunchSpecError(f"rdzv_endpoint: {self.rdzv_backend} needs host:port of the etcd service")
        if self.rdzv_endpoint is not None:
            split_endpoint(self.rdzv_endpoint)
        if self.max_restarts < 0:
            raise LaunchSpecError(f"max_restarts: must be >= 0, got {self.max_restarts}")
        if self.grace_period_s < 0:
            raise LaunchSpecError(f"grace_period_s: must be >= 0, got {self.grace_period_s}")
        if self.gpus < 0:
            raise LaunchSpecError(f"gpus: must be >= 0, got {self.gpus}")
        for what, value in (
            ("cpu", self.cpu),
            ("memory", self.memory),
            ("checkpoint_storage", self.checkpoint_storage),
        ):
            if value is not None and not _QUANTITY.match(value):
                raise LaunchSpecError(f"{what} {value!r} is not a Kubernetes quantity (like 4, 500m, 16Gi)")
        if self.claim_name is not None and not _DNS_LABEL.match(self.claim_name):
            raise LaunchSpecError(f"checkpoint_claim {self.claim_name!r} is not a DNS-1123 name")
        if not self.checkpoint_mount.startswith("/"):
            raise LaunchSpecError(f"checkpoint_mount {self.checkpoint_mount!r} must be an absolute path")
        try:
            parse_watchers(self.preemption_watchers)
        except UsageError as exc:
            raise LaunchSpecError(f"preemption_watchers: {exc}") from None

    @property
    def container_image(self) -> str:
        return self.image or default_image(self.gpus > 0)

    @property
    def claim_name(self) -> str | None:
        if self.checkpoint_claim == "":
            return None
        return self.checkpoint_claim or f"{self.name}-checkpoints"

    @property
    def checkpoint_dir(self) -> str | None:
        return f"{self.checkpoint_mount.rstrip('/')}/{self.name}" if self.claim_name else None


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LaunchSpecError(f"rdzv_endpoint {endpoint!r}: expected host:port")
    return host, int(port)


def rendezvous_host_port(p: PyTorchJobParams) -> tuple[str, int]:
    if p.rdzv_endpoint:
        return split_endpoint(p.rdzv_endpoint)
    return f"{p.name}-worker-0", DEFAULT_RDZV_PORT


def worker_pod_names(p: PyTorchJobParams) -> list[str]:
    return [f"{p.name}-worker-{i}" for i in range(p.max_nodes)]


def container_args(p: PyTorchJobParams) -> list[str]:
    """elastrain-run's own flags, then the script; everything torchrun-shaped comes from PET_*."""
    args = ["--preemption-watchers", p.preemption_watchers]
    if p.checkpoint_dir:
        args += ["--checkpoint-dir", p.checkpoint_dir]
    # The checkpoint asked for on SIGTERM must commit before the kubelet's SIGKILL.
    args += ["--save-timeout", str(max(1, p.grace_period_s - 10))]
    return args + list(p.script)


def job_labels(p: PyTorchJobParams) -> dict[str, str]:
    return {"app.kubernetes.io/name": "elastrain", "app.kubernetes.io/instance": p.name, **dict(p.labels)}


def resource_requirements(p: PyTorchJobParams) -> dict[str, Any]:
    limits: dict[str, Any] = {}
    requests: dict[str, Any] = {}
    if p.cpu:
        requests["cpu"] = p.cpu
    if p.memory:
        requests["memory"] = limits["memory"] = p.memory
    if p.gpus:
        limits["nvidia.com/gpu"] = p.gpus
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _pod_rdzv_port(p: PyTorchJobParams) -> int:
    # The c10d store listens in a worker pod; with etcd no pod listens for the rendezvous.
    return rendezvous_host_port(p)[1] if p.rdzv_backend == "c10d" else DEFAULT_RDZV_PORT


def pod_template(p: PyTorchJobParams) -> Manifest:
    """The worker pods' ``PodTemplateSpec``."""
    container: Manifest = {
        "name": CONTAINER_NAME,
        "image": p.container_image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["elastrain-run"],
        "args": container_args(p),
        "ports": [{"name": PORT_NAME, "containerPort": _pod_rdzv_port(p), "protocol": "TCP"}],
        "env": [{"name": k, "value": v} for k, v in p.env],
    }
    resources = resource_requirements(p)
    if resources:
        container["resources"] = resources
    if not container["env"]:
        del container["env"]
    spec: Manifest = {"terminationGracePeriodSeconds": p.grace_period_s, "containers": [container]}
    if p.claim_name:
        container["volumeMounts"] = [{"name": "checkpoints", "mountPath": p.checkpoint_mount}]
        spec["volumes"] = [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": p.claim_name}}]
    if p.node_selector:
        spec["nodeSelector"] = dict(p.node_selector)
    return {"metadata": {"labels": job_labels(p)}, "spec": spec}


def pytorchjob(p: PyTorchJobParams) -> Manifest:
    host, port = rendezvous_host_port(p)
    elastic: Manifest = {
        "minReplicas": p.min_nodes,
        "maxReplicas": p.max_nodes,
        "rdzvBackend": p.rdzv_backend,
        "rdzvHost": host,
        "rdzvPort": port,
        "rdzvId": p.name,
        "maxRestarts": p.max_restarts,
    }
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": p.name, "namespace": p.namespace, "labels": job_labels(p)},
        "spec": {
            "runPolicy": {"cleanPodPolicy": "None"},
            "elasticPolicy": elastic,
            "nprocPerNode": str(p.nproc_per_node),
            "pytorchReplicaSpecs": {
                "Worker": {"replicas": p.max_nodes, "restartPolicy": "OnFailure", "template": pod_template(p)}
            },
        },
    }


def checkpoint_claim(p: PyTorchJobParams) -> Manifest | None:
    if not p.claim_name or not p.create_claim:
        return None
    spec: Manifest = {
        "accessModes": ["ReadWriteMany"],
        "storageClassName": p.storage_class,
        "resources": {"requests": {"storage": p.checkpoint_storage}},
    }
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": p.claim_name, "namespace": p.namespace, "labels": job_labels(p)},
        "spec": spec,
    }


def manifests(p: PyTorchJobParams) -> list[Manifest]:
    """Everything to ``kubectl apply``: the checkpoint claim (if created here), then the job."""
    claim = checkpoint_claim(p)
    return ([claim] if claim else []) + [pytorchjob(p)]


def etcd_manifests(
    name: str = "elastrain-etcd",
    namespace: str = "default",
    image: str = ETCD_IMAGE,
    storage: str = "1Gi",
    node_selector: tuple[tuple[str, str], ...] = (),
) -> list[Manifest]:
    """A one-member etcd (Service + StatefulSet with its own volume) for ``--rdzv-backend etcd-v3``.

    Schedule it off the spot pool (``node_selector``) so that no preemption takes the rendezvous.
    Its endpoint is ``<name>.<namespace>.svc:2379``.
    """
    if not _DNS_LABEL.match(name):
        raise LaunchSpecError(f"etcd name {name!r} is not a DNS-1123 label")
    labels = {"app.kubernetes.io/name": "etcd", "app.kubernetes.io/instance": name}
    service: Manifest = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {"selector": labels, "ports": [{"name": "client", "port": ETCD_PORT, "targetPort": ETCD_PORT}]},
    }
    pod_spec: Manifest = {
        "containers": [
            {
                "name": "etcd",
                "image": image,
                "command": [
                    "etcd",
                    f"--name={name}-0",
                    "--data-dir=/var/lib/etcd",
                    f"--listen-client-urls=http://0.0.0.0:{ETCD_PORT}",
                    f"--advertise-client-urls=http://{name}.{namespace}.svc:{ETCD_PORT}",
                ],
                "ports": [{"name": "client", "containerPort": ETCD_PORT}],
                "volumeMounts": [{"name": "data", "mountPath": "/var/lib/etcd"}],
            }
        ]
    }
    if node_selector:
        pod_spec["nodeSelector"] = dict(node_selector)
    statefulset: Manifest = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "serviceName": name,
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
            "volumeClaimTemplates": [
                {
                    "metadata": {"name": "data"},
                    "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": storage}}},
                }
            ],
        },
    }
    return [service, statefulset]


def warnings(p: PyTorchJobParams) -> list[str]:
    """What in these parameters can cost the job when a node is preempted."""
    out: list[str] = []
    host, _ = rendezvous_host_port(p)
    if p.rdzv_backend == "c10d" and (
        host in worker_pod_names(p) or re.fullmatch(rf"{re.escape(p.name)}-worker-\d+", host)
    ):
        out.append(
            f"the c10d rendezvous store lives in pod {host}, one of the job's own (preemptible) workers: "
            "if that pod is preempted the other nodes lose the rendezvous; use rdzv_backend etcd-v3 with an "
            "etcd outside the spot pool (etcd_manifests) for a job that must survive any node"
        )
    if not p.claim_name:
        out.append("no checkpoint volume: checkpoints stay inside the pod and are lost with it; set checkpoint_claim")
    if p.grace_period_s < 30:
        out.append(
            f"grace_period_s={p.grace_period_s}: a pod has that long between SIGTERM and SIGKILL to checkpoint "
            "and leave; 30 s or more is safer"
        )
    if p.min_nodes == p.max_nodes:
        out.append(f"min_nodes == max_nodes == {p.min_nodes}: the job cannot go on with fewer nodes")
    return out


def kubeflow_pet_env(job: Manifest) -> dict[str, str]:
    """The ``PET_*`` variables Kubeflow's training operator puts in each pod of this job.

    A model of the training operator v1.9 (``pkg/controller.v1/pytorch/envvar.go`` and ``elastic.go``):
    endpoint from rdzvHost/rdzvPort (default host ``<job>-worker-0``), backend (default c10d), NNODES
    as ``min:max``; NPROC_PER_NODE from ``spec.nprocPerNode`` (the deprecated ``elasticPolicy.nProcPerNode``
    when only it is set; the defaulter's ``auto`` when neither is); MAX_RESTARTS, RDZV_ID, RDZV_CONF when set.
    """
    spec = job["spec"]
    ep = spec.get("elasticPolicy")
    if ep is None:
        return {}
    host = ep.get("rdzvHost") or f"{job['metadata']['name']}-worker-0"
    port = ep.get("rdzvPort")
    if port is None:
        container = spec["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
        port = next(p["containerPort"] for p in container.get("ports", []) if p.get("name") == PORT_NAME)
    env = {"PET_RDZV_ENDPOINT": f"{host}:{port}", "PET_RDZV_BACKEND": ep.get("rdzvBackend") or "c10d"}
    if ep.get("minReplicas") is None and ep.get("maxReplicas") is None:
        env["PET_NNODES"] = str(spec["pytorchReplicaSpecs"]["Worker"]["replicas"])
    else:
        env["PET_NNODES"] = f"{ep['minReplicas']}:{ep['maxReplicas']}"
    if ep.get("maxRestarts") is not None:
        env["PET_MAX_RESTARTS"] = str(ep["maxRestarts"])
    if spec.get("nprocPerNode") is not None:
        env["PET_NPROC_PER_NODE"] = str(spec["nprocPerNode"])
    elif ep.get("nProcPerNode") is not None:
        env["PET_NPROC_PER_NODE"] = str(ep["nProcPerNode"])
    else:
        env["PET_NPROC_PER_NODE"] = "auto"
    if ep.get("rdzvId") is not None:
        env["PET_RDZV_ID"] = ep["rdzvId"]
    if ep.get("rdzvConf"):
        env["PET_RDZV_CONF"] = ",".join(f"{c['key']}={c['value']}" for c in ep["rdzvConf"])
    return env
