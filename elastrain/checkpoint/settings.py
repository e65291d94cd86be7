"""Checks and defaults shared by every checkpointer (DCP and DeepSpeed): where, how many, how often."""

from __future__ import annotations

import os

from elastrain.env import CHECKPOINT_DIR
from elastrain.errors import CheckpointError


def resolve_root(directory: str | os.PathLike[str] | None, env_directory: str | None, owner: str) -> str:
    """The checkpoint directory: the argument, else the launcher's ``--checkpoint-dir``."""
    root = directory if directory is not None else env_directory
    if root is None:
        raise CheckpointError(
            "no checkpoint directory: launch with elastrain-run --checkpoint-dir DIR, set "
            f"{CHECKPOINT_DIR}, or pass {owner}(directory=...)"
        )
    return os.fspath(root)


def check_schedule(keep_last: int, interval_steps: int | None, interval_seconds: float | None = None) -> None:
    if keep_last < 1:
        raise CheckpointError(f"keep_last must be >= 1 (a complete checkpoint always remains), got {keep_last}")
    if interval_steps is not None and interval_steps < 1:
        raise CheckpointError(f"interval_steps must be >= 1, got {interval_steps}")
    if interval_seconds is not None and interval_seconds <= 0:
        raise CheckpointError(f"interval_seconds must be > 0, got {interval_seconds}")
