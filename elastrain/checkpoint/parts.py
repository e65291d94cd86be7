"""What every checkpointer is built of (DCP's :class:`~elastrain.checkpoint.Checkpointer`, DeepSpeed's):
the root and its storage, the two process groups, the save trigger and the commit.

One construction, from the :class:`~elastrain.env.WorkerEnv` the checkpointer is given: the root (the
argument, else ``--checkpoint-dir``), the group that agrees when to save (``--collective-timeout``) and
the one for everything that waits on storage (``--io-timeout``), the launcher's control channel, the
fencing generation or the identity to claim the root as. A checkpointer holds one and adds its format.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from elastrain import fence
from elastrain.checkpoint.commit import Commit
from elastrain.checkpoint.group import Group
from elastrain.checkpoint.schedule import SaveSchedule, SaveTrigger
from elastrain.checkpoint.settings import resolve_root
from elastrain.control import ControlChannel
from elastrain.env import WorkerEnv
from elastrain.errors import CheckpointError
from elastrain.log import lifecycle
from elastrain.storage import Storage


class CheckpointParts:
    """The parts of one checkpointer; ``rank`` and ``world_size`` are its saving group's."""

    def __init__(
        self,
        owner: str,
        directory: str | os.PathLike[str] | None,
        env: WorkerEnv,
        *,
        kind: str,
        keep_last: int,
        on_save_error: str,
        schedule: Callable[[], SaveSchedule],
        storage: Callable[[str], Storage],
        process_group: dist.ProcessGroup | None = None,
        absolute_root: bool = False,
    ) -> None:
        """``owner``: the class named in errors; ``schedule``: builds the save schedule (after the settings here
        are checked); ``storage``: the storage of a root; ``absolute_root``: the root as an absolute path."""
        root = resolve_root(directory, env.checkpoint_dir, owner)
        if keep_last < 1:
            raise CheckpointError(f"keep_last must be >= 1 (a complete checkpoint always remains), got {keep_last}")
        if on_save_error not in ("raise", "warn"):
            raise CheckpointError(f'on_save_error must be "raise" or "warn", got {on_save_error!r}')
        save_schedule = schedule()
        self.env = env
        self.root = os.path.abspath(root) if absolute_root else root
        self.storage = storage(self.root)
        self.storage.makedirs(self.root)
        # Agreeing when to save; and every collective that waits on storage (saving, restoring, the commit).
        self.sync = Group(process_group, env.collective_timeout_s)
        self.io = Group(process_group, env.io_timeout_s)
        self.rank, self.world_size = self.sync.rank, self.sync.world_size
        channel = ControlChannel(env.control_dir) if env.control_dir else None
        agree = self.sync.all_max if self.sync.distributed else None
        live_round = env.round if env.live else None  # a live regroup builds the next world's checkpointer
        self.trigger = SaveTrigger(
            save_schedule,
            channel,
            agree,
            is_local_leader=env.local_rank == 0,
            log=self.log,
            live_round=lambda: live_round,
        )
        self.commit = Commit(
            self.root,
            self.storage,
            self.io,
            kind=kind,
            generation=env.generation,
            keep_last=keep_last,
            log=self.log,
            claim_as=fence.worker_world(env, self.root),
        )

    def log(self, event: str, level: int = logging.INFO, **fields: Any) -> None:
        """A lifecycle line from rank 0 (every rank's warnings and errors), with the rank."""
        if self.rank == 0 or level >= logging.WARNING:
            lifecycle(event, level=level, rank=self.rank, **fields)
