"""Every exception elastrain raises, in one hierarchy.

Messages say what to change: the flag, file or key to fix.
"""

from __future__ import annotations

# Exit codes (sysexits.h) by which a worker says that restarting it cannot help: its node leaves the job at
# once, without using --max-restarts or waiting for peers (see elastrain.launcher.agent).
EX_USAGE = 64
EX_CONFIG = 78
FATAL_EXIT_CODES = frozenset({EX_USAGE, EX_CONFIG})


class ElastrainError(Exception):
    """Base of every error elastrain raises on purpose."""


class UsageError(ElastrainError):
    """Bad command-line input or configuration; names the flag to fix."""

    def __init__(self, flag: str, message: str) -> None:
        self.flag = flag
        super().__init__(f"{flag}: {message}")


class WorkerEnvError(ElastrainError):
    """A worker was started without (or with a malformed) elastrain environment."""


class RendezvousError(ElastrainError):
    """The rendezvous could not complete or lost its backing store."""


class RendezvousClosedError(RendezvousError):
    """The job finished or was closed; no new round will form."""


class CheckpointError(ElastrainError):
    """A checkpoint could not be written or read."""


class CheckpointSaveError(CheckpointError):
    """A checkpoint save failed (in the background or not); names the path and the cause."""


class StaleGenerationError(CheckpointError):
    """A newer world of this run id claimed the checkpoint root: this world must stop and never commit again."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint on disk is incomplete or damaged; it is skipped, never loaded."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint does not fit the model or optimizer being restored (missing or mis-shaped keys)."""


class ScalingError(ElastrainError, ValueError):
    """A scaling policy cannot satisfy the requested batch sizes at this world size."""


class PreemptionWatcherError(ElastrainError):
    """A cloud metadata endpoint could not be reached, timed out, or answered something malformed."""


class LaunchSpecError(ElastrainError, ValueError):
    """A Kubernetes or AzureML launch spec cannot be built from these parameters; names the parameter to fix."""


class RendezvousStateCorruptError(RendezvousError):
    """The shared rendezvous state cannot be decoded (another launcher on the same --rdzv-id?)."""


class RendezvousStoreLostError(RendezvousError):
    """The store holding the rendezvous state stopped answering (for c10d: its host node died)."""


class NodeLeftError(ElastrainError):
    """This node left the job on purpose (SIGTERM, a preemption notice); the others go on without it."""


class DataStateError(ElastrainError):
    """The elastic sampler cannot form a step, or a saved data position does not fit this dataset."""


class TraceError(ElastrainError, ValueError):
    """A chaos preemption trace is malformed or impossible (a kill of a node that is down, ...); names the event."""


class ControlMessageError(ElastrainError):
    """A file of a node's control channel (``ELASTRAIN_CONTROL_DIR``) is not a message of the expected shape;
    names the file and the field. Readers log it and take it as no message."""


class CheckpointDurabilityError(CheckpointError, OSError):
    """Storage did not confirm that written data is durable (an fsync failed); an OSError, so a save reports it."""


class CheckpointTamperedError(CheckpointCorruptError):
    """A checkpoint file holds what elastrain never writes (a pickled reference to code, a path outside its step
    directory): it is refused, never loaded, and reported loudly, since someone may have written it on purpose."""


class WireFormatError(ElastrainError, ValueError):
    """A value cannot travel as plain data (see elastrain.wire), or what arrived is not a well-formed message."""


class WorldSupersededExit(SystemExit):
    """This process's world lost the checkpoint root to a newer world of the job (the workers' own fence, without
    the launcher's): the process exits with EX_CONFIG, so that elastrain-run ends its node instead of restarting
    workers that would claim the root back. The reason is logged (``event=world_superseded``) before it is raised."""

    def __init__(self, reason: str) -> None:
        super().__init__(EX_CONFIG)
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


class RendezvousForgeryError(RendezvousStateCorruptError):
    """A rendezvous value is not signed with the job's shared secret (``--rdzv-conf secret_file``): it is ignored.

    ``foreign`` is True when the value is signed with another secret (a node started with the wrong file, or a
    forgery that copies the envelope); False when it is unsigned or its signature does not match.
    """

    def __init__(self, message: str, foreign: bool = False) -> None:
        super().__init__(message)
        self.foreign = foreign


class RendezvousSecretError(UsageError):
    """This node cannot take part in the job's rendezvous: it lacks the job's shared secret, or has another one."""


class RendezvousValueCorruptError(RendezvousStateCorruptError):
    """A backend read a state value that elastrain did not write; ``token`` (the value's compare-and-set token)
    lets the handler write a good state over it."""

    def __init__(self, message: str, token: object) -> None:
        super().__init__(message)
        self.token = token
