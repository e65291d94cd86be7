"""Every exception elastrain raises, in one hierarchy.

Messages say what to change: the flag, file or key to fix.
"""

from __future__ import annotations


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


class CheckpointCorruptError(CheckpointError):
    """A checkpoint on disk is incomplete or damaged; it is skipped, never loaded."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint does not fit the model or optimizer being restored (missing or mis-shaped keys)."""


class ScalingError(ElastrainError, ValueError):
    """A scaling policy cannot satisfy the requested batch sizes at this world size."""
