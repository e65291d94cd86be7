"""An ``sbatch`` script for elastrain, rendered by a pure function from a few parameters.

- ``#SBATCH --nodes=MIN-MAX``: Slurm may start the job on as few as MIN nodes; ``--ntasks-per-node=1``
  and ``srun --ntasks-per-node=1`` run one elastrain-run agent per node, which starts the workers.
- ``srun --cpus-per-task="$SLURM_CPUS_PER_TASK"``: since Slurm 22.05 a step does not inherit the job's
  ``--cpus-per-task`` (it would get one CPU per task), so the step asks for the job's count again.
- ``--no-kill`` (on the job and on the step) and ``srun --kill-on-bad-exit=0``: a failed node, or an agent
  that exits, ends neither the job nor the step; the other agents re-form without it (shrink in place).
- ``--requeue`` and ``--signal=B:TERM@GRACE``. When the job is requeued, and when not:

  - time limit: GRACE seconds before it, Slurm sends SIGTERM to the batch shell (``B:``); its trap
    forwards it to the step (srun relays it to every agent, which checkpoints and leaves), waits for the
    step, then runs ``scontrol requeue``;
  - preemption, with the partition's ``PreemptMode=REQUEUE``: Slurm signals the step's tasks with SIGTERM
    (the agents checkpoint and leave; the batch shell is not signalled), kills what is left after the
    partition's ``GraceTime`` (with ``GraceTime=0`` at once, with no time to checkpoint: the job resumes
    from its last periodic checkpoint) and requeues the job itself;
  - preemption, with ``PreemptParameters=send_user_signal``: the ``--signal`` SIGTERM goes to the batch
    shell at preemption, whatever the time left, and the trap checkpoints and requeues as for the time
    limit (within ``GraceTime``);
  - preemption under ``PreemptMode=CANCEL`` (or ``SUSPEND``) without ``send_user_signal``: the job is
    cancelled (or suspended), not requeued: submit it again and it resumes from the checkpoint folder.

  A requeued job keeps its ``SLURM_JOB_ID``, so the entrypoint gives it the same rendezvous id and it
  resumes from the newest complete checkpoint.

The step runs :mod:`elastrain.platforms.slurm.entrypoint`, which maps ``SLURM_*`` to ``--nnodes``,
``--rdzv-endpoint`` (the first host of ``SLURM_JOB_NODELIST``) and ``--rdzv-id``, with the interpreter of
an environment every node sees: ``tools/install.sh`` (:mod:`elastrain.platforms.install`) makes it in the
submit directory before the first submission, and the script's header says how.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from elastrain.errors import LaunchSpecError, UsageError
from elastrain.platforms.image import GPU_VARIANT
from elastrain.platforms.install import Install, bucket_package, job_extras
from elastrain.preemption.monitor import parse_watchers

ENTRYPOINT = "elastrain.platforms.slurm.entrypoint"
BACKENDS = ("c10d", "etcd-v3")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_TIME = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$|^\d+$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# The step's CPUs: the job's, read when the step starts (Slurm >= 22.05 does not pass them on by itself).
CPUS_PER_TASK = "--cpus-per-task=${SLURM_CPUS_PER_TASK}"
_SHELL_WORDS = {CPUS_PER_TASK: '--cpus-per-task="${SLURM_CPUS_PER_TASK}"'}


@dataclass(frozen=True)
class SlurmJobParams:
    name: str
    script: tuple[str, ...]
    """The training script and its arguments, relative to the submit directory."""
    checkpoint_dir: str
    """On a filesystem every node mounts (or an fsspec URL); a folder per job."""
    min_nodes: int = 1
    max_nodes: int = 2
    nproc_per_node: str = "1"
    """N, gpu, cpu or auto (elastrain-run's --nproc-per-node)."""
    time_limit: str = "04:00:00"
    partition: str | None = None
    account: str | None = None
    gpus_per_node: int = 0
    cpus_per_node: int | None = None
    grace_period_s: int = 120
    """Seconds between SIGTERM and the time limit, to checkpoint and leave (``--signal=B:TERM@N``)."""
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str | None = None
    rdzv_port: int = 29400
    max_restarts: int = 3
    preemption_watchers: str = "none"
    venv: str = ".venv"
    """The environment, in the submit directory on a filesystem every node mounts, made by ``tools/install.sh``
    before the first submission; its python runs the step."""
    extras: tuple[str, ...] = ()
    """elastrain's extras the script needs (``t5`` for the T5 example): the install command installs them."""
    python: str | None = None
    """The step's interpreter; default: the venv's."""
    output: str = "%x-%j.out"
    env: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise LaunchSpecError(f"name {self.name!r}: letters, digits, '.', '_' and '-'")
        if not self.script or not self.script[0].strip():
            raise LaunchSpecError("script: give the training script (and its arguments) to run")
        if not self.checkpoint_dir.strip():
            raise LaunchSpecError("checkpoint_dir: give a folder on a filesystem every node mounts")
        if self.min_nodes < 1 or self.max_nodes < self.min_nodes:
            raise LaunchSpecError(f"min_nodes/max_nodes: need 1 <= min <= max, got {self.min_nodes}:{self.max_nodes}")
        if not (self.nproc_per_node.isdigit() and int(self.nproc_per_node) > 0) and self.nproc_per_node not in (
            "gpu",
            "cpu",
            "auto",
        ):
            raise LaunchSpecError(f"nproc_per_node {self.nproc_per_node!r}: a number, gpu, cpu or auto")
        if not _TIME.match(self.time_limit):
            raise LaunchSpecError(f"time_limit {self.time_limit!r}: minutes, HH:MM:SS or D-HH:MM:SS")
        if self.gpus_per_node < 0 or (self.cpus_per_node is not None and self.cpus_per_node < 1):
            raise LaunchSpecError("gpus_per_node must be >= 0 and cpus_per_node >= 1")
        if not 10 <= self.grace_period_s <= 65535:
            raise LaunchSpecError(f"grace_period_s: 10 to 65535 (Slurm's --signal range), got {self.grace_period_s}")
        if self.rdzv_backend not in BACKENDS:
            raise LaunchSpecError(f"rdzv_backend {self.rdzv_backend!r}: choose one of {', '.join(BACKENDS)}")
        if self.rdzv_backend == "etcd-v3" and not self.rdzv_endpoint:
            raise LaunchSpecError("rdzv_endpoint: etcd-v3 needs host:port of an etcd outside the allocation")
        if not 0 < self.rdzv_port < 65536:
            raise LaunchSpecError(f"rdzv_port {self.rdzv_port}: not a TCP port")
        if self.max_restarts < 0:
            raise LaunchSpecError(f"max_restarts: must be >= 0, got {self.max_restarts}")
        for key, _ in self.env:
            if not _ENV_NAME.match(key):
                raise LaunchSpecError(f"env: {key!r} is not a variable name")
        try:
            parse_watchers(self.preemption_watchers)
        except UsageError as exc:
            raise LaunchSpecError(f"preemption_watchers: {exc}") from None
        Install(venv=self.venv, extras=self.extras)  # raises for a bad extra name or venv

    @property
    def install(self) -> Install:
        """The environment to make before submitting: torch's CUDA build with GPUs, the script's and the
        rendezvous backend's extras, and fsspec's package for a bucket URL."""
        bucket = bucket_package(self.checkpoint_dir)
        return Install(
            venv=self.venv,
            extras=job_extras(self.extras, self.rdzv_backend),
            requirements=(bucket,) if bucket else (),
            variant=GPU_VARIANT if self.gpus_per_node else "cpu",
        )

    @property
    def interpreter(self) -> str:
        return self.python or self.install.python


def sbatch_directives(p: SlurmJobParams) -> list[tuple[str, str | None]]:
    """``#SBATCH`` options in order, as (option, value or None for a flag)."""
    out: list[tuple[str, str | None]] = [
        ("--job-name", p.name),
        ("--nodes", f"{p.min_nodes}-{p.max_nodes}" if p.min_nodes != p.max_nodes else str(p.max_nodes)),
        ("--ntasks-per-node", "1"),
    ]
    if p.cpus_per_node:
        out.append(("--cpus-per-task", str(p.cpus_per_node)))
    if p.gpus_per_node:
        out.append(("--gpus-per-node", str(p.gpus_per_node)))
    out.append(("--time", p.time_limit))
    if p.partition:
        out.append(("--partition", p.partition))
    if p.account:
        out.append(("--account", p.account))
    out += [
        ("--requeue", None),
        ("--signal", f"B:TERM@{p.grace_period_s}"),
        ("--no-kill", None),
        ("--open-mode", "append"),
        ("--output", p.output),
    ]
    return out


def srun_lines(p: SlurmJobParams) -> list[list[str]]:
    """The step's command, one group of arguments per script line: srun, then the entrypoint on every node."""
    rdzv = ["--rdzv-endpoint", p.rdzv_endpoint] if p.rdzv_endpoint else ["--rdzv-port", str(p.rdzv_port)]
    cpus = [CPUS_PER_TASK] if p.cpus_per_node else []
    return [
        ["srun", "--ntasks-per-node=1", *cpus, "--no-kill", "--kill-on-bad-exit=0"],
        [p.interpreter, "-m", ENTRYPOINT],
        [
            "--min-nodes",
            str(p.min_nodes),
            "--nproc-per-node",
            p.nproc_per_node,
            "--rdzv-backend",
            p.rdzv_backend,
            *rdzv,
        ],
        ["--max-restarts", str(p.max_restarts), "--preemption-watchers", p.preemption_watchers],
        ["--checkpoint-dir", p.checkpoint_dir],
        # elastrain-run's own flag: the checkpoint asked for on SIGTERM must commit before Slurm's SIGKILL.
        ["--", "--save-timeout", str(max(1, p.grace_period_s - 10)), *p.script],
    ]


def srun_argv(p: SlurmJobParams) -> list[str]:
    return [arg for line in srun_lines(p) for arg in line]


_BODY = """\
set -u
{env}
step=""
on_term() {{
    # The batch shell gets SIGTERM from --signal=B:TERM@GRACE: GRACE s before the time limit, or at preemption
    # where the site sets PreemptParameters=send_user_signal. (A PreemptMode=REQUEUE preemption signals the step,
    # not this shell, and requeues the job itself; PreemptMode=CANCEL ends it.) Forward it to the step (srun
    # relays it to every agent: checkpoint, then leave), wait for it, then requeue: the requeued job keeps
    # SLURM_JOB_ID and resumes from the newest checkpoint.
    echo "elastrain slurm: SIGTERM for job ${{SLURM_JOB_ID}}: checkpointing and requeueing" >&2
    if [ -n "$step" ]; then
        kill -TERM "$step" 2>/dev/null
        wait "$step"
    fi
    scontrol requeue "${{SLURM_JOB_ID}}"
    exit 0
}}
trap on_term TERM

# One elastrain-run per node; the entrypoint reads SLURM_JOB_NODELIST, SLURM_JOB_NUM_NODES, SLURM_NODEID
# and SLURM_JOB_ID for --rdzv-endpoint, --nnodes and --rdzv-id.
{srun} &
step=$!
wait "$step"
"""


def _shell_line(words: list[str]) -> str:
    return " ".join(_SHELL_WORDS.get(w) or shlex.quote(w) for w in words)


def sbatch_script(p: SlurmJobParams, header: str = "") -> str:
    directives = "".join(f"#SBATCH {k}={v}\n" if v is not None else f"#SBATCH {k}\n" for k, v in sbatch_directives(p))
    env = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in p.env).rstrip("\n")
    body = _BODY.format(env=env, srun=" \\\n    ".join(_shell_line(line) for line in srun_lines(p)))
    if p.python is None:
        header += (
            f"\nThe step runs {p.interpreter} of the submit directory, on a filesystem every node mounts;"
            f"\nmake it there once, before the first submission:\n  {p.install.command()}"
        )
    comment = "".join(f"# {line}".rstrip() + "\n" for line in header.strip("\n").splitlines())
    return f"#!/bin/bash\n{directives}{comment}{body}"


def warnings(p: SlurmJobParams) -> list[str]:
    out = []
    if p.rdzv_backend == "c10d":
        out.append(
            "the c10d rendezvous store lives on the allocation's first node: if that node fails the others "
            "lose the rendezvous and the job ends (requeue it to resume); use rdzv_backend etcd-v3 with an etcd "
            "outside the allocation to ride through it"
        )
    if p.min_nodes == p.max_nodes:
        out.append(f"min_nodes == max_nodes == {p.min_nodes}: the job cannot go on with fewer nodes")
    if p.grace_period_s < 30:
        out.append(f"grace_period_s={p.grace_period_s}: 30 s or more leaves time to checkpoint after SIGTERM")
    return out
