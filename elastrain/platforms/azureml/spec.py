"""An AzureML command job (CLI/SDK v2 YAML) running elastrain on low-priority nodes, built by pure functions.

Three documents, for ``az ml ... create --file``:

- a compute cluster (``amlCompute`` schema) with ``tier: low_priority`` and ``max_instances`` nodes;
- an environment (``environment`` schema): the repository's Dockerfile build (:mod:`elastrain.platforms.image`),
  the CUDA one by default (the default VM size has a GPU);
- a command job (``commandJob`` schema) with ``distribution: {type: pytorch,
  process_count_per_instance: 1}`` so that AzureML starts one elastrain agent per node,
  ``resources.instance_count`` = the largest node count, and a named output ``checkpoints`` mounted
  read-write. The output's default datastore path is keyed by the job name, so a job that AzureML
  restarts from scratch after a preemption finds the same folder and resumes from it.

Relative paths in a job file resolve against the file's own folder, as ``az ml job create --file`` resolves
them: ``code`` is the folder AzureML uploads and runs the command in (the repository root, ``../..``, for
the examples in ``launch/azureml/``, so that ``examples/t5/train.py`` is in it), and ``environment:
file:environment.yml`` names the environment file beside the job file. Without ``environment``, the job
carries its environment inline (``{image: ...}``).

The command runs :mod:`elastrain.platforms.azureml.entrypoint`, which maps AzureML's variables (``MASTER_ADDR``,
``MASTER_PORT``, ``NODE_RANK``, ``AZUREML_NODE_COUNT``, ``AZUREML_RUN_ID``) to ``elastrain-run``.
:func:`check_command_job` and :func:`check_compute` validate the documents as data, without the Azure
SDK (an optional extra, ``elastrain[azure]``).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Any

from elastrain.errors import LaunchSpecError, UsageError
from elastrain.platforms.image import GPU_IMAGE
from elastrain.preemption.monitor import parse_watchers

JOB_SCHEMA = "https://azuremlschemas.azureedge.net/latest/commandJob.schema.json"
COMPUTE_SCHEMA = "https://azuremlschemas.azureedge.net/latest/amlCompute.schema.json"
ENVIRONMENT_SCHEMA = "https://azuremlschemas.azureedge.net/latest/environment.schema.json"
FILE_PREFIX = "file:"
CHECKPOINT_OUTPUT = "checkpoints"
BACKENDS = ("c10d", "etcd-v3")
OUTPUT_TYPES = ("uri_folder", "uri_file", "mltable", "custom_model", "mlflow_model", "triton_model")
OUTPUT_MODES = ("rw_mount", "upload", "direct")
_NAME = re.compile(r"^[a-zA-Z][a-zA-Z0-9_-]{1,253}$")
_COMPUTE_NAME = re.compile(r"^[a-zA-Z][a-zA-Z0-9-]{1,22}$")
_BINDING = re.compile(r"\$\{\{\s*(inputs|outputs)\.([A-Za-z0-9_]+)\s*\}\}")

Doc = dict[str, Any]


@dataclass(frozen=True)
class AzureMLJobParams:
    script: tuple[str, ...]
    """The training script and its arguments, relative to ``code``."""
    compute: str = "lowpri-cluster"
    experiment_name: str = "elastrain"
    display_name: str | None = None
    code: str = "."
    """The folder AzureML uploads and runs the command in, relative to the job file's folder."""
    environment: str | None = None
    """The job's environment: ``azureml:NAME@latest`` (registered) or ``file:PATH`` (an environment file,
    relative to the job file's folder); None: inline, ``{image: image}``."""
    image: str = GPU_IMAGE
    """The image of the inline environment and of :func:`environment_definition`."""
    vm_size: str = "Standard_NC4as_T4_v3"
    min_nodes: int = 1
    max_nodes: int = 2
    nproc_per_node: int = 1
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str | None = None
    """host:port of an etcd for ``etcd-v3``; c10d uses the first node (MASTER_ADDR:MASTER_PORT)."""
    max_restarts: int = 3
    preemption_watchers: str = "azure"
    idle_s: int = 120
    checkpoint_path: str | None = None
    """Datastore URI for the checkpoints (default: AzureML's per-job output folder)."""

    def __post_init__(self) -> None:
        if not self.script or not self.script[0].strip():
            raise LaunchSpecError("script: give the training script (and its arguments) to run")
        if self.environment is not None and not self.environment.startswith(("azureml:", FILE_PREFIX)):
            raise LaunchSpecError(
                f"environment {self.environment!r}: azureml:NAME@latest, file:PATH, or none for an inline image"
            )
        if not self.image.strip():
            raise LaunchSpecError("image: give the container image that has elastrain and the training code")
        if not _COMPUTE_NAME.match(self.compute):
            raise LaunchSpecError(
                f"compute {self.compute!r}: 2-24 characters, letters, digits and '-', starting with a letter"
            )
        if not _NAME.match(self.experiment_name):
            raise LaunchSpecError(f"experiment_name {self.experiment_name!r}: letters, digits, '_' and '-'")
        if self.min_nodes < 1 or self.max_nodes < self.min_nodes:
            raise LaunchSpecError(f"min_nodes/max_nodes: need 1 <= min <= max, got {self.min_nodes}:{self.max_nodes}")
        if self.nproc_per_node < 1:
            raise LaunchSpecError(f"nproc_per_node: must be >= 1, got {self.nproc_per_node}")
        if self.rdzv_backend not in BACKENDS:
            raise LaunchSpecError(f"rdzv_backend {self.rdzv_backend!r}: choose one of {', '.join(BACKENDS)}")
        if self.rdzv_backend == "etcd-v3" and not self.rdzv_endpoint:
            raise LaunchSpecError("rdzv_endpoint: etcd-v3 needs host:port of an etcd reachable from the cluster")
        if self.max_restarts < 0:
            raise LaunchSpecError(f"max_restarts: must be >= 0, got {self.max_restarts}")
        if self.idle_s < 0:
            raise LaunchSpecError(f"idle_s: must be >= 0, got {self.idle_s}")
        try:
            parse_watchers(self.preemption_watchers)
        except UsageError as exc:
            raise LaunchSpecError(f"preemption_watchers: {exc}") from None


def entrypoint_command(p: AzureMLJobParams) -> str:
    """The job's shell command: the entrypoint with its flags, ``--``, then the training script."""
    flags = [
        "python",
        "-m",
        "elastrain.platforms.azureml.entrypoint",
        "--min-nodes",
        str(p.min_nodes),
        "--nproc-per-node",
        str(p.nproc_per_node),
        "--rdzv-backend",
        p.rdzv_backend,
        "--max-restarts",
        str(p.max_restarts),
        "--preemption-watchers",
        p.preemption_watchers,
    ]
    if p.rdzv_endpoint:
        flags += ["--rdzv-endpoint", p.rdzv_endpoint]
    quoted = " ".join(shlex.quote(f) for f in flags)
    # AzureML substitutes the binding before the shell sees it; it must stay unquoted.
    script = " ".join(shlex.quote(s) for s in p.script)
    return f"{quoted} --checkpoint-dir ${{{{outputs.{CHECKPOINT_OUTPUT}}}}} -- {script}"


def command_job(p: AzureMLJobParams) -> Doc:
    output: Doc = {"type": "uri_folder", "mode": "rw_mount"}
    if p.checkpoint_path:
        output["path"] = p.checkpoint_path
    doc: Doc = {
        "$schema": JOB_SCHEMA,
        "type": "command",
        "experiment_name": p.experiment_name,
        "display_name": p.display_name or f"{p.experiment_name}-elastic",
        "description": f"elastrain on {p.min_nodes}..{p.max_nodes} low-priority nodes; resumes from checkpoints",
        "code": p.code,
        "command": entrypoint_command(p),
        "environment": p.environment or {"image": p.image},
        "compute": f"azureml:{p.compute}",
        "resources": {"instance_count": p.max_nodes},
        "distribution": {"type": "pytorch", "process_count_per_instance": 1},
        "environment_variables": {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        "outputs": {CHECKPOINT_OUTPUT: output},
    }
    return doc


def environment_definition(p: AzureMLJobParams) -> Doc:
    """An environment file (``az ml environment create --file``, or ``environment: file:...`` in a job)."""
    return {
        "$schema": ENVIRONMENT_SCHEMA,
        "image": p.image,
        "description": "elastrain and its T5 example, built from the Dockerfile at the elastrain repository root",
    }


def compute_cluster(p: AzureMLJobParams) -> Doc:
    return {
        "$schema": COMPUTE_SCHEMA,
        "name": p.compute,
        "type": "amlcompute",
        "size": p.vm_size,
        "tier": "low_priority",
        "min_instances": 0,
        "max_instances": p.max_nodes,
        "idle_time_before_scale_down": p.idle_s,
    }


def warnings(p: AzureMLJobParams) -> list[str]:
    out = []
    if p.rdzv_backend == "c10d":
        out.append(
            "the c10d rendezvous store lives on the job's first node (MASTER_ADDR), a low-priority node like the "
            "others: if it is preempted the job stops and AzureML restarts it, which resumes from the last "
            "checkpoint; use rdzv_backend etcd-v3 with an etcd on dedicated compute to ride through it"
        )
    if p.min_nodes == p.max_nodes:
        out.append(f"min_nodes == max_nodes == {p.min_nodes}: the job cannot go on with fewer nodes")
    return out


def _require(doc: Doc, key: str, kind: type | tuple[type, ...], what: str) -> Any:
    if key not in doc:
        raise LaunchSpecError(f"{what}: missing required key {key!r}")
    if not isinstance(doc[key], kind) or (isinstance(doc[key], bool) and kind is int):
        raise LaunchSpecError(f"{what}: {key!r} has type {type(doc[key]).__name__}, expected {kind}")
    return doc[key]


def check_command_job(doc: Doc) -> None:
    """Validate a command job document as data (the fields, types and bindings the v2 schema requires)."""
    what = "command job"
    known = {
        "$schema", "type", "name", "display_name", "experiment_name", "description", "tags", "properties", "code",
        "command", "environment", "environment_variables", "compute", "resources", "distribution", "limits",
        "inputs", "outputs", "identity", "services", "queue_settings",
    }  # fmt: skip
    unknown = sorted(set(doc) - known)
    if unknown:
        raise LaunchSpecError(f"{what}: unknown keys {unknown}")
    if _require(doc, "type", str, what) != "command":
        raise LaunchSpecError(f"{what}: type must be 'command', got {doc['type']!r}")
    command = _require(doc, "command", str, what)
    env = _require(doc, "environment", (str, dict), what)
    if isinstance(env, str) and not env.startswith(("azureml:", FILE_PREFIX)):
        raise LaunchSpecError(
            f"{what}: environment {env!r} must be azureml:<name>@<version|latest>, file:<path> or a mapping"
        )
    if isinstance(env, dict) and not ({"image", "build"} & set(env)):
        raise LaunchSpecError(f"{what}: an inline environment needs 'image' or 'build'")
    compute = _require(doc, "compute", str, what)
    if not compute.startswith("azureml:"):
        raise LaunchSpecError(f"{what}: compute {compute!r} must be azureml:<cluster name>")
    resources = doc.get("resources", {})
    count = _require(resources, "instance_count", int, f"{what} resources")
    if count < 1:
        raise LaunchSpecError(f"{what}: resources.instance_count must be >= 1, got {count}")
    dist = _require(doc, "distribution", dict, what)
    if str(dist.get("type", "")).lower() != "pytorch":
        raise LaunchSpecError(f"{what}: distribution.type must be pytorch, got {dist.get('type')!r}")
    per_instance = _require(dist, "process_count_per_instance", int, f"{what} distribution")
    if per_instance != 1:
        raise LaunchSpecError(
            f"{what}: distribution.process_count_per_instance must be 1 (elastrain-run starts the workers), "
            f"got {per_instance}"
        )
    for key, value in doc.get("environment_variables", {}).items():
        if not isinstance(value, str):
            raise LaunchSpecError(f"{what}: environment_variables.{key} must be a string, got {value!r}")
    outputs = doc.get("outputs", {})
    for name, out in outputs.items():
        if out.get("type") not in OUTPUT_TYPES:
            raise LaunchSpecError(f"{what}: outputs.{name}.type {out.get('type')!r} is not one of {OUTPUT_TYPES}")
        if out.get("mode", "rw_mount") not in OUTPUT_MODES:
            raise LaunchSpecError(f"{what}: outputs.{name}.mode {out.get('mode')!r} is not one of {OUTPUT_MODES}")
    for section, name in _BINDING.findall(command):
        if name not in doc.get(section, {}):
            raise LaunchSpecError(f"{what}: the command uses ${{{{{section}.{name}}}}} but {section} has no {name!r}")


def check_compute(doc: Doc) -> None:
    what = "compute"
    if _require(doc, "type", str, what) != "amlcompute":
        raise LaunchSpecError(f"{what}: type must be amlcompute, got {doc['type']!r}")
    name = _require(doc, "name", str, what)
    if not _COMPUTE_NAME.match(name):
        raise LaunchSpecError(f"{what}: name {name!r} is not a valid compute name")
    if doc.get("tier", "dedicated") not in ("dedicated", "low_priority"):
        raise LaunchSpecError(f"{what}: tier must be dedicated or low_priority, got {doc.get('tier')!r}")
    lo = _require(doc, "min_instances", int, what)
    hi = _require(doc, "max_instances", int, what)
    if not 0 <= lo <= hi or hi < 1:
        raise LaunchSpecError(f"{what}: need 0 <= min_instances <= max_instances and max >= 1, got {lo}..{hi}")
