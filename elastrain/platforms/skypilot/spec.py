"""A SkyPilot managed-job task (``sky jobs launch task.yaml``) running elastrain, built by a pure function.

- ``num_nodes``: the largest node count; ``resources.use_spot`` with ``any_of`` the clouds (or
  ``infra`` strings) to place it on; ``job_recovery`` says how SkyPilot relaunches it.
- ``run``: :mod:`elastrain.platforms.skypilot.entrypoint` on every node, which maps ``SKYPILOT_NODE_IPS``
  (first line: the head node, where the c10d store listens), ``SKYPILOT_NUM_NODES`` and
  ``SKYPILOT_TASK_ID`` (the same across recoveries) to ``elastrain-run --nnodes MIN:N --rdzv-endpoint
  --rdzv-id``.
- Checkpoints go to a bucket URL (``--checkpoint-dir s3://...``: elastrain writes object stores through
  fsspec), which outlives every cluster SkyPilot launches, so a relaunch resumes from the newest
  complete checkpoint.
- ``workdir``: SkyPilot resolves it against the directory ``sky jobs launch`` runs in and uploads it (minus
  what ``.gitignore`` leaves out); ``setup`` and ``run`` run in the uploaded copy. The default ``.`` is the
  repository root when the task is launched from there, as ``launch/README.md`` says:
  ``sky jobs launch launch/skypilot/t5-elastic.yaml``.
- ``file_mounts``: local folders copied to the same path on every node (a relative source resolves against
  the launch directory too), for what must be the same everywhere and is not in the workdir: the T5 example's
  data, built once by rank 0 into a folder the other nodes cannot see unless every node has it.
- ``setup``: ``tools/install.sh`` (:mod:`elastrain.platforms.install`, the same install list as ``./dev
  setup`` and the Dockerfile) makes ``.venv`` with elastrain, the script's extras, the rendezvous backend's
  and the bucket's fsspec package, and torch's CUDA build on GPU nodes; ``run`` uses that interpreter.

What a preemption does: SkyPilot's managed-job controller checks the cluster every few seconds and
treats a multi-node cluster that is not fully ``UP`` as preempted (``sky/jobs/controller.py``): it
tears the cluster down and relaunches all ``num_nodes`` (in another region or cloud with
``EAGER_NEXT_REGION``), then runs ``run`` again. Until then elastrain's survivors re-form without the
lost node and keep training; the node that got the cloud's notice checkpoints before it goes
(``--preemption-watchers``), so the relaunch loses no step.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Any

from elastrain.errors import LaunchSpecError, UsageError
from elastrain.platforms.image import GPU_VARIANT
from elastrain.platforms.install import Install, bucket_package, job_extras
from elastrain.preemption.monitor import parse_watchers

ENTRYPOINT = "elastrain.platforms.skypilot.entrypoint"
BACKENDS = ("c10d", "etcd-v3")
STRATEGIES = ("EAGER_NEXT_REGION", "FAILOVER")
_NAME = re.compile(r"^[a-zA-Z0-9]([-_.a-zA-Z0-9]*[a-zA-Z0-9])?$")
_ENV_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

Task = dict[str, Any]


@dataclass(frozen=True)
class SkyPilotJobParams:
    name: str
    script: tuple[str, ...]
    """The training script and its arguments, relative to ``workdir``."""
    checkpoint_url: str
    """A bucket URL (s3://, gs://, az://...) that outlives the clusters, a folder per job."""
    min_nodes: int = 1
    max_nodes: int = 2
    nproc_per_node: str | None = None
    """Workers per node: N, gpu, cpu or auto; default gpu with accelerators, else 1."""
    accelerators: str | None = None
    """Per node, e.g. ``A100:8``; None for CPU nodes."""
    cpus: str | None = None
    """Per node, e.g. ``8+``."""
    infra: tuple[str, ...] = ()
    """Where SkyPilot may place the job (``aws``, ``gcp/us-central1``, ``k8s``...); any of them."""
    use_spot: bool = True
    recovery_strategy: str = "EAGER_NEXT_REGION"
    max_restarts_on_errors: int = 0
    """Relaunches when the job fails on its own (not preempted); preemptions always relaunch."""
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str | None = None
    max_restarts: int = 3
    preemption_watchers: str = "auto"
    workdir: str = "."
    """Uploaded to every node; relative to the directory ``sky jobs launch`` runs in."""
    extras: tuple[str, ...] = ()
    """elastrain's extras the script needs (``t5`` for the T5 example), installed by the default setup."""
    venv: str = ".venv"
    """The environment the default setup makes in the uploaded workdir, and whose python runs the job."""
    setup: str | None = None
    """Shell commands that install elastrain and the training code (default: :func:`default_setup`)."""
    env: tuple[tuple[str, str], ...] = ()
    file_mounts: tuple[tuple[str, str], ...] = ()
    """(path on every node, local source) pairs; a relative source is relative to the launch directory."""

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise LaunchSpecError(f"name {self.name!r}: letters, digits, '-', '_' and '.'")
        if not self.script or not self.script[0].strip():
            raise LaunchSpecError("script: give the training script (and its arguments) to run")
        if not self.checkpoint_url.strip():
            raise LaunchSpecError("checkpoint_url: give a bucket URL (s3://bucket/path) that outlives the cluster")
        if self.min_nodes < 1 or self.max_nodes < self.min_nodes:
            raise LaunchSpecError(f"min_nodes/max_nodes: need 1 <= min <= max, got {self.min_nodes}:{self.max_nodes}")
        if self.recovery_strategy not in STRATEGIES:
            raise LaunchSpecError(f"recovery_strategy {self.recovery_strategy!r}: one of {', '.join(STRATEGIES)}")
        if self.max_restarts_on_errors < 0 or self.max_restarts < 0:
            raise LaunchSpecError("max_restarts_on_errors and max_restarts must be >= 0")
        if self.rdzv_backend not in BACKENDS:
            raise LaunchSpecError(f"rdzv_backend {self.rdzv_backend!r}: choose one of {', '.join(BACKENDS)}")
        if self.rdzv_backend == "etcd-v3" and not self.rdzv_endpoint:
            raise LaunchSpecError("rdzv_endpoint: etcd-v3 needs host:port of an etcd outside the spot cluster")
        for key, _ in self.env:
            if not _ENV_NAME.match(key):
                raise LaunchSpecError(f"env: {key!r} is not a variable name")
        for target, source in self.file_mounts:
            if not target.startswith(("/", "~")) or not source.strip():
                raise LaunchSpecError(f"file_mounts: {target!r} must be an absolute or ~ path with a source")
        try:
            parse_watchers(self.preemption_watchers)
        except UsageError as exc:
            raise LaunchSpecError(f"preemption_watchers: {exc}") from None
        Install(venv=self.venv, extras=self.extras)  # raises for a bad extra name or venv

    @property
    def install(self) -> Install:
        """What the default setup installs: torch's CUDA build on GPU nodes, the script's and the backend's
        extras, and the bucket's fsspec package."""
        bucket = bucket_package(self.checkpoint_url)
        return Install(
            venv=self.venv,
            extras=job_extras(self.extras, self.rdzv_backend),
            requirements=(bucket,) if bucket else (),
            variant=GPU_VARIANT if self.accelerators else "cpu",
        )

    @property
    def python(self) -> str:
        """The default setup's environment's python; plain ``python`` after a setup of the user's own."""
        return self.install.python if self.setup is None else "python"

    @property
    def nproc(self) -> str:
        return self.nproc_per_node or ("gpu" if self.accelerators else "1")

    @property
    def checkpoint_dir(self) -> str:
        return f"{self.checkpoint_url.rstrip('/')}/{self.name}"


def default_setup(p: SkyPilotJobParams) -> str:
    return p.install.command()


def run_lines(p: SkyPilotJobParams) -> list[list[str]]:
    """What ``run`` executes on every node, one group of arguments per line."""
    rdzv = ["--rdzv-backend", p.rdzv_backend] + (["--rdzv-endpoint", p.rdzv_endpoint] if p.rdzv_endpoint else [])
    return [
        [p.python, "-m", ENTRYPOINT],
        ["--min-nodes", str(p.min_nodes), "--nproc-per-node", p.nproc, "--max-restarts", str(p.max_restarts)],
        [*rdzv, "--preemption-watchers", p.preemption_watchers],
        ["--checkpoint-dir", p.checkpoint_dir],
        ["--", *p.script],
    ]


def run_argv(p: SkyPilotJobParams) -> list[str]:
    return [arg for line in run_lines(p) for arg in line]


def resources(p: SkyPilotJobParams) -> dict[str, Any]:
    out: dict[str, Any] = {"use_spot": p.use_spot}
    if p.accelerators:
        out["accelerators"] = p.accelerators
    if p.cpus:
        out["cpus"] = p.cpus
    out["job_recovery"] = {"strategy": p.recovery_strategy, "max_restarts_on_errors": p.max_restarts_on_errors}
    if len(p.infra) == 1:
        out["infra"] = p.infra[0]
    elif p.infra:
        out["any_of"] = [{"infra": i} for i in p.infra]
    return out


def task(p: SkyPilotJobParams) -> Task:
    return {
        "name": p.name,
        "num_nodes": p.max_nodes,
        "resources": resources(p),
        "workdir": p.workdir,
        "envs": {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **dict(p.env)},
        **({"file_mounts": dict(p.file_mounts)} if p.file_mounts else {}),
        "setup": (p.setup or default_setup(p)) + "\n",
        "run": " \\\n  ".join(shlex.join(line) for line in run_lines(p)) + "\n",
    }


def warnings(p: SkyPilotJobParams) -> list[str]:
    out = []
    if p.rdzv_backend == "c10d":
        out.append(
            "the c10d rendezvous store lives on the head node (first of SKYPILOT_NODE_IPS): if that node is "
            "preempted the others lose the rendezvous until SkyPilot relaunches the cluster; use rdzv_backend "
            "etcd-v3 with an etcd outside the spot cluster to keep training"
        )
    if "://" not in p.checkpoint_url:
        out.append(
            f"checkpoint_url {p.checkpoint_url!r} is not a bucket URL: a relaunched cluster starts on new disks, "
            "so checkpoints must live in object storage (or a volume every cluster mounts)"
        )
    if p.min_nodes == p.max_nodes:
        out.append(f"min_nodes == max_nodes == {p.min_nodes}: the job cannot go on with fewer nodes")
    return out
