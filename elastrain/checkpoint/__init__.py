"""Sharded, asynchronous, atomic checkpoints on torch.distributed.checkpoint, resharded on load.

:class:`Checkpointer` is what training scripts use. :mod:`elastrain.checkpoint.commit` is the one
commit protocol (prepare, report, commit, verify, agree) and :mod:`elastrain.checkpoint.schedule` the
one save schedule that every format uses (DCP here, DeepSpeed's and the Trainer's folders in
:mod:`elastrain.integrations`); :mod:`elastrain.checkpoint.layout` is the on-disk format (step
directories, commit markers, retention).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from elastrain.checkpoint.checkpointer import Checkpointer, RestoreInfo, SaveResult
    from elastrain.checkpoint.schedule import SaveSchedule

# Imported on first use: the launcher reads the fence (elastrain.checkpoint.fence) and must not pay for
# torch.distributed.checkpoint (about a second per agent) to do so.
_LAZY = {"Checkpointer": "checkpointer", "RestoreInfo": "checkpointer", "SaveResult": "checkpointer"}
_LAZY["SaveSchedule"] = "schedule"


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'elastrain.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(f"elastrain.checkpoint.{module}"), name)


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
