"""Sharded, asynchronous, atomic checkpoints on torch.distributed.checkpoint, resharded on load.

:class:`Checkpointer` is what training scripts use. :mod:`elastrain.checkpoint.commit` is the one
commit protocol (prepare, report, commit, verify, agree) and :mod:`elastrain.checkpoint.schedule` the
one save schedule that every format uses (DCP here, DeepSpeed's and the Trainer's folders in
:mod:`elastrain.integrations`); :mod:`elastrain.checkpoint.layout` is the on-disk format (step
directories, commit markers, retention).
"""

from __future__ import annotations

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
from elastrain.checkpoint.schedule import SaveSchedule

__all__ = [
    "Checkpointer",
    "CommitMarker",
    "FileEntry",
    "RestoreInfo",
    "SaveResult",
    "SaveSchedule",
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
