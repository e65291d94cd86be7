"""The worker contract: what the launcher tells each worker, and the only module that names ELASTRAIN_* variables.

The agent builds a :class:`LaunchContext` for each start of the workers and exports it with
:func:`to_environ`; the training script reads it back as a typed :class:`WorkerEnv`::

    from elastrain import WorkerEnv
    env = WorkerEnv.from_environ()
    if env.start_reason is StartReason.SCALE_DOWN: ...

Rank, local rank and world size are torch's own variables (RANK, LOCAL_RANK, WORLD_SIZE, ...), so a
script launched by plain torchrun still gets a usable WorkerEnv with the elastrain fields defaulted.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass

from elastrain.errors import WorkerEnvError

# Every ELASTRAIN_* variable, named here and nowhere else.
RUN_ID = "ELASTRAIN_RUN_ID"
RESTART_COUNT = "ELASTRAIN_RESTART_COUNT"
FAILURE_COUNT = "ELASTRAIN_FAILURE_COUNT"
START_REASON = "ELASTRAIN_START_REASON"
PREVIOUS_WORLD_SIZE = "ELASTRAIN_PREVIOUS_WORLD_SIZE"
ROUND = "ELASTRAIN_ROUND"
GENERATION = "ELASTRAIN_GENERATION"
CHAOS_TAG = "ELASTRAIN_CHAOS_TAG"  # marks the processes of one chaos-harness node (elastrain.chaos.procs)
CHECKPOINT_DIR = "ELASTRAIN_CHECKPOINT_DIR"
CONTROL_DIR = "ELASTRAIN_CONTROL_DIR"
EVENTS_FILE = "ELASTRAIN_EVENTS_FILE"
COLLECTIVE_TIMEOUT = "ELASTRAIN_COLLECTIVE_TIMEOUT"
FIRST_STEP_TIMEOUT = "ELASTRAIN_FIRST_STEP_TIMEOUT"
IO_TIMEOUT = "ELASTRAIN_IO_TIMEOUT"
LOG_LEVEL = "ELASTRAIN_LOG_LEVEL"
ZYGOTE = "ELASTRAIN_ZYGOTE"
# Live reconfiguration (elastrain-run --live true): the worker regroups in place; see elastrain.live.
LIVE = "ELASTRAIN_LIVE"
REGROUP_TIMEOUT = "ELASTRAIN_REGROUP_TIMEOUT"
# --live: the worker was started *warm*, before its node joined a round; it has no rank until the agent's
# first regroup notice (a Session waits for it; see elastrain.live.member).
WARM = "ELASTRAIN_WARM"
# --live: "1" when the worker's round is the job's first, whose every member runs its script from the top (a warm
# worker learns it from its first notice). See TrainerMembership.
FIRST_ROUND = "ELASTRAIN_FIRST_ROUND"
# Set by elastrain's own launcher only: a worker that sees it knows an elastrain agent supervises it.
AGENT_PID = "ELASTRAIN_AGENT_PID"
# Set by a worker, for the processes it starts: its own pid (elastrain.control.worker_sigterm).
SIGTERM_WORKER_PID = "ELASTRAIN_SIGTERM_WORKER_PID"
# Read by the launcher, never set by it: a file holding the job's rendezvous secret (as --rdzv-conf secret_file).
RDZV_SECRET_FILE = "ELASTRAIN_RDZV_SECRET_FILE"
# --trainer-integration: "1" makes the workers' bootstrap (elastrain/launcher/bootstrap) patch the HF Trainer.
TRAINER_INTEGRATION = "ELASTRAIN_TRAINER_INTEGRATION"
# Read by a live CPU worker, never set by elastrain: "0" leaves its allocator as glibc sets it (elastrain.live.heap).
KEEP_HEAP = "ELASTRAIN_KEEP_HEAP"

ALL_VARIABLES: tuple[str, ...] = (
    RUN_ID,
    RESTART_COUNT,
    FAILURE_COUNT,
    START_REASON,
    PREVIOUS_WORLD_SIZE,
    ROUND,
    CHECKPOINT_DIR,
    CONTROL_DIR,
    EVENTS_FILE,
    COLLECTIVE_TIMEOUT,
    FIRST_STEP_TIMEOUT,
    IO_TIMEOUT,
    LOG_LEVEL,
    ZYGOTE,
    LIVE,
    REGROUP_TIMEOUT,
    FIRST_ROUND,
    AGENT_PID,
    SIGTERM_WORKER_PID,
    TRAINER_INTEGRATION,
)


# Collectives that wait on storage get this long unless the launcher says otherwise (--io-timeout).
DEFAULT_IO_TIMEOUT_S = 600.0
# A live worker whose collective broke waits this long for the agent's regroup notice (--live).
DEFAULT_REGROUP_TIMEOUT_S = 60.0


class StartReason(str, enum.Enum):
    """Why the workers were (re)started."""

    FIRST_START = "first_start"
    FAILURE = "failure"
    SCALE_DOWN = "scale_down"
    SCALE_UP = "scale_up"
    # The world size stayed the same but membership changed (a node was replaced).
    MEMBERSHIP = "membership"


def start_reason(previous_world_size: int | None, world_size: int, worker_failed: bool) -> StartReason:
    """Classify a start from the world sizes before and after it.

    A change of size wins over a failure: when a node dies, the survivors' workers fail in their
    collectives, but what happened to the job is a scale-down.
    """
    if previous_world_size is None:
        return StartReason.FIRST_START
    if world_size < previous_world_size:
        return StartReason.SCALE_DOWN
    if world_size > previous_world_size:
        return StartReason.SCALE_UP
    return StartReason.FAILURE if worker_failed else StartReason.MEMBERSHIP


@dataclass(frozen=True)
class LaunchContext:
    """What the agent knows about one start of its workers, shared by every worker on the node."""

    run_id: str
    restart_count: int
    failure_count: int
    start_reason: StartReason
    previous_world_size: int | None
    round: int
    checkpoint_dir: str | None = None
    control_dir: str | None = None
    events_file: str | None = None
    collective_timeout_s: float | None = None
    first_step_timeout_s: float | None = None
    generation: int | None = None
    io_timeout_s: float | None = None
    live: bool = False
    regroup_timeout_s: float | None = None
    first_round: bool = False
    """The job's first round: every member of it starts its script from the top (see :data:`FIRST_ROUND`)."""


def to_environ(ctx: LaunchContext) -> dict[str, str]:
    """The ELASTRAIN_* variables for ``ctx``; unset optional fields are left out."""
    out = {
        RUN_ID: ctx.run_id,
        RESTART_COUNT: str(ctx.restart_count),
        FAILURE_COUNT: str(ctx.failure_count),
        START_REASON: ctx.start_reason.value,
        ROUND: str(ctx.round),
        AGENT_PID: str(os.getpid()),
    }
    if ctx.previous_world_size is not None:
        out[PREVIOUS_WORLD_SIZE] = str(ctx.previous_world_size)
    if ctx.checkpoint_dir:
        out[CHECKPOINT_DIR] = ctx.checkpoint_dir
    if ctx.control_dir:
        out[CONTROL_DIR] = ctx.control_dir
    if ctx.events_file:
        out[EVENTS_FILE] = ctx.events_file
    if ctx.collective_timeout_s is not None:
        out[COLLECTIVE_TIMEOUT] = repr(float(ctx.collective_timeout_s))
    if ctx.first_step_timeout_s is not None:
        out[FIRST_STEP_TIMEOUT] = repr(float(ctx.first_step_timeout_s))
    if ctx.generation is not None:
        out[GENERATION] = str(ctx.generation)
    if ctx.io_timeout_s is not None:
        out[IO_TIMEOUT] = repr(float(ctx.io_timeout_s))
    if ctx.live:
        out[LIVE] = "1"
    if ctx.regroup_timeout_s is not None:
        out[REGROUP_TIMEOUT] = repr(float(ctx.regroup_timeout_s))
    if ctx.first_round:
        out[FIRST_ROUND] = "1"
    return out


def regrouped_environ(
    ctx: LaunchContext, rank: int, world_size: int, group_rank: int, master_addr: str, master_port: int
) -> dict[str, str]:
    """The variables a live worker rewrites in its own environment after an in-place regroup.

    The agent set them when it started the worker; after a regroup they would be stale, so the
    worker (elastrain.session) replaces them and ``WorkerEnv.from_environ()`` keeps giving the
    current rank, world size, round and fencing generation.
    """
    out = to_environ(ctx)
    del out[AGENT_PID]  # the worker's own pid here: the one the agent set stays
    out.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        GROUP_RANK=str(group_rank),
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=str(world_size),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        TORCHELASTIC_RESTART_COUNT=str(ctx.restart_count),
    )
    return out


def _float(environ: Mapping[str, str], name: str) -> float:
    raw = environ.get(name, "")
    try:
        value = float(raw)
    except ValueError:
        raise WorkerEnvError(f"{name}={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise WorkerEnvError(f"{name}={raw!r} must be > 0 seconds")
    return value


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise WorkerEnvError(
                f"{name} is not set: start this script with elastrain-run (or torchrun), or set the variable yourself"
            )
        return default
    try:
        return int(raw)
    except ValueError:
        raise WorkerEnvError(f"{name}={raw!r} is not an integer") from None


@dataclass(frozen=True)
class WorkerEnv:
    """Everything a worker is told about itself and about why it was started."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    group_rank: int
    restart_count: int
    failure_count: int
    start_reason: StartReason
    previous_world_size: int | None
    run_id: str
    round: int
    checkpoint_dir: str | None
    control_dir: str | None
    events_file: str | None
    collective_timeout_s: float | None
    under_elastrain: bool
    # The job generation this world claimed in the checkpoint root (the fencing token every commit carries);
    # None when the launcher claimed none (plain torchrun, or no --checkpoint-dir).
    generation: int | None = None
    # Timeout of the collectives that wait on storage (checkpoint writes, verification, loads), --io-timeout.
    io_timeout_s: float = DEFAULT_IO_TIMEOUT_S
    # elastrain-run --live true: membership changes regroup this worker in place (elastrain.live).
    live: bool = False
    # How long a live worker whose collective broke waits for the agent's regroup notice before it fails.
    regroup_timeout_s: float = DEFAULT_REGROUP_TIMEOUT_S
    # --first-step-timeout: how long a new world's first step's collectives may wait (None: see TrainingGroup).
    first_step_timeout_s: float | None = None
    # --live: started before its node joined a round; rank, world size and MASTER_* come with the first
    # regroup notice (the values above are placeholders until a Session has started).
    warm: bool = False
    # --live: this worker's round is the job's first, whose every member runs its script from the top (a warm
    # worker: from its first regroup notice).
    first_round: bool = False

    @property
    def is_restart(self) -> bool:
        return self.start_reason is not StartReason.FIRST_START

    @property
    def world_size_changed(self) -> bool:
        return self.previous_world_size is not None and self.previous_world_size != self.world_size

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> WorkerEnv:
        """Read the worker's environment; without a launcher, a single-process world."""
        e = os.environ if environ is None else environ
        world_size = _int(e, "WORLD_SIZE", 1)
        rank = _int(e, "RANK", 0)
        if not 0 <= rank < world_size:
            raise WorkerEnvError(f"RANK={rank} is outside WORLD_SIZE={world_size}")
        raw_reason = e.get(START_REASON, StartReason.FIRST_START.value)
        try:
            reason = StartReason(raw_reason)
        except ValueError:
            known = ", ".join(r.value for r in StartReason)
            raise WorkerEnvError(f"{START_REASON}={raw_reason!r} is not one of: {known}") from None
        torch_restarts = _int(e, "TORCHELASTIC_RESTART_COUNT", 0)
        prev = e.get(PREVIOUS_WORLD_SIZE)
        timeout = e.get(COLLECTIVE_TIMEOUT)
        generation = e.get(GENERATION)
        io_timeout = e.get(IO_TIMEOUT)
        regroup_timeout = e.get(REGROUP_TIMEOUT)
        first_step_timeout = e.get(FIRST_STEP_TIMEOUT)
        return cls(
            rank=rank,
            local_rank=_int(e, "LOCAL_RANK", 0),
            world_size=world_size,
            local_world_size=_int(e, "LOCAL_WORLD_SIZE", 1),
            group_rank=_int(e, "GROUP_RANK", 0),
            restart_count=_int(e, RESTART_COUNT, torch_restarts),
            failure_count=_int(e, FAILURE_COUNT, torch_restarts),
            start_reason=reason,
            previous_world_size=int(prev) if prev else None,
            run_id=e.get(RUN_ID) or e.get("TORCHELASTIC_RUN_ID") or "none",
            round=_int(e, ROUND, 0),
            checkpoint_dir=e.get(CHECKPOINT_DIR) or None,
            control_dir=e.get(CONTROL_DIR) or None,
            events_file=e.get(EVENTS_FILE) or None,
            collective_timeout_s=float(timeout) if timeout else None,
            under_elastrain=AGENT_PID in e,
            generation=_int(e, GENERATION) if generation else None,
            io_timeout_s=_float(e, IO_TIMEOUT) if io_timeout else DEFAULT_IO_TIMEOUT_S,
            live=e.get(LIVE, "") == "1",
            regroup_timeout_s=_float(e, REGROUP_TIMEOUT) if regroup_timeout else DEFAULT_REGROUP_TIMEOUT_S,
            first_step_timeout_s=_float(e, FIRST_STEP_TIMEOUT) if first_step_timeout else None,
            warm=e.get(WARM, "") == "1",
            first_round=e.get(FIRST_ROUND, "") == "1",
        )
