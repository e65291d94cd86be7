"""Defaults shared by every checkpointer (DCP and DeepSpeed): where checkpoints go."""

from __future__ import annotations

import os

from elastrain.env import CHECKPOINT_DIR
from elastrain.errors import CheckpointError
from elastrain.storage import local_path


def resolve_root(directory: str | os.PathLike[str] | None, env_directory: str | None, owner: str) -> str:
    """The checkpoint directory: the argument, else the launcher's ``--checkpoint-dir``; a ``file://`` URL as a path."""
    root = directory if directory is not None else env_directory
    if root is None:
        raise CheckpointError(
            "no checkpoint directory: launch with elastrain-run --checkpoint-dir DIR, set "
            f"{CHECKPOINT_DIR}, or pass {owner}(directory=...)"
        )
    return local_path(root)
