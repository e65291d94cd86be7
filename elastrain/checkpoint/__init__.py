"""Sharded, asynchronous, atomic checkpoints on torch.distributed.checkpoint, resharded on load.

:class:`Checkpointer` is what training scripts use. :mod:`elastrain.checkpoint.layout` is the
format-independent part (step directories, commit markers, verification, retention) that other
checkpoint formats, such as DeepSpeed's, reuse.
"""

from elastrain.checkpoint.checkpointer import Checkpointer, RestoreInfo, SaveResult
from elastrain.checkpoint.layout import (
    CommitMarker,
    FileEntry,
    StepDir,
    list_step_dirs,
    manifest,
    newest_complete,
    purge,
    read_commit_marker,
    retention_plan,
    step_dir_name,
    verify_step,
    write_commit_marker,
)

__all__ = [
    "Checkpointer",
    "CommitMarker",
    "FileEntry",
    "RestoreInfo",
    "SaveResult",
    "StepDir",
    "list_step_dirs",
    "manifest",
    "newest_complete",
    "purge",
    "read_commit_marker",
    "retention_plan",
    "step_dir_name",
    "verify_step",
    "write_commit_marker",
]
