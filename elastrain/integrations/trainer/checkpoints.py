"""The Trainer's ``checkpoint-N`` folders under elastrain's one commit protocol.

The Trainer writes its folders itself (model weights, optimizer, scheduler, RNG, ``trainer_state.json``);
:meth:`TrainerCheckpoints.commit` then commits each one through :mod:`elastrain.checkpoint.commit`:
every rank fsyncs and checksums the files it wrote, rank 0 adds ``elastrain-state.json`` (the data
position and the global batch) and writes the commit marker once every file is reported. A folder
without a marker (a save cut short by a kill) is never resumed from: :meth:`TrainerCheckpoints.restore`
takes the newest folder every rank verifies, and :func:`newest_committed` (no collective) is what
``transformers.trainer_utils.get_last_checkpoint`` answers under elastrain-run. Retention keeps the
newest ``keep_last`` committed folders (the Trainer's own rotation, which may delete the last complete
folder before the new one is complete, is turned off).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elastrain import fence
from elastrain.checkpoint import layout
from elastrain.checkpoint.commit import PROTOCOL_FILES, Commit, entry_of, fsync_and_checksum
from elastrain.checkpoint.dcp_io import check_crc
from elastrain.checkpoint.group import Group
from elastrain.env import WorkerEnv
from elastrain.errors import CheckpointError
from elastrain.storage import LocalStorage, fsync_dir, local_path

KIND = "hf-trainer"
STATE_FILE = "elastrain-state.json"
NAMING = layout.Naming("checkpoint-", 0)
_RNG_FILE = re.compile(r"^rng_state_(\d+)\.pth$")


@dataclass(frozen=True)
class Resume:
    """A committed checkpoint to resume from, and the data position and batch it was saved with."""

    path: str
    step: int
    cursor: int
    """Samples of the stream consumed up to and including ``step``."""
    world_size: int
    global_batch: int | None
    """The global batch of the run that saved it (None: a checkpoint from before it was recorded)."""
    stream: dict[str, Any] | None = None
    """An iterable training set's own place at ``cursor`` (:class:`~elastrain.integrations.trainer.memory.
    StreamPlace`), when the set keeps one."""


def newest_committed(root: str) -> str | None:
    """The newest committed ``checkpoint-N`` folder in ``root`` (no collective; a local listing)."""
    storage = LocalStorage()
    dirs = [d for d in layout.list_step_dirs(root, storage, NAMING) if d.committed]
    return dirs[-1].path if dirs else None


def is_committed(path: str) -> bool:
    """Whether ``path`` is a folder the commit protocol committed (its marker is there)."""
    return os.path.isfile(os.path.join(path, layout.MARKER))


@dataclass(frozen=True)
class Choice:
    """Which checkpoint ``trainer.train()`` resumes from, and why (for the log line)."""

    path: str | None
    why: str
    replaced: str | None = None
    """The folder the script asked for and that is not loaded (never committed)."""


def choose(asked: object, root: str) -> Choice:
    """The checkpoint to resume from for ``resume_from_checkpoint=asked``: the newest committed one in ``root``
    when the script asks for none (``None``) or for the last (``True``), the one it names if committed, and
    never a folder that was not committed (a save a restart cut short): the newest committed one instead."""
    if asked is False:
        return Choice(None, "the script asked for a fresh start")
    found = newest_committed(root)
    if asked is None or asked is True:
        return Choice(found, "the newest committed checkpoint" if found else "no committed checkpoint: a fresh start")
    path = os.path.abspath(str(asked))
    if is_committed(path):
        return Choice(path, "the committed checkpoint the script asked for")
    return Choice(found, "the folder asked for was never committed (a save cut short): not loaded", replaced=path)


def rank_zero_log(event: str, level: int = logging.INFO, **fields: Any) -> None:
    """A lifecycle line from the current rank 0 (any rank's warnings too), marked as the Trainer's."""
    import torch.distributed as dist

    from elastrain.log import lifecycle

    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0 or level >= logging.WARNING:
        lifecycle(event, level=level, rank=rank, format=KIND, **fields)


class TrainerCheckpoints:
    """Commit and restore of one root's Trainer folders over the current process group (every rank builds it)."""

    def __init__(
        self,
        root: str,
        env: WorkerEnv,
        keep_last: int,
        log: Callable[..., None] = rank_zero_log,
        best: Callable[[], str | None] = lambda: None,
    ) -> None:
        if keep_last < 1:
            raise CheckpointError(f"save_total_limit must be >= 1 under elastrain-run, got {keep_last}")
        self.root = os.path.abspath(local_path(root))
        self.env = env
        """The worker's environment in the current world (a live regroup gives a new one)."""
        self.keep_last = keep_last
        self.storage = LocalStorage()
        self.storage.makedirs(self.root)  # made durable in its parent before anything is committed into it
        self._log = log
        self._best = best
        """The Trainer's best checkpoint (``TrainerState.best_model_checkpoint``): retention keeps it, as the
        Trainer's own rotation does, so that ``load_best_model_at_end`` finds it."""
        self._commit: Commit | None = None
        self._committed_before: int | None = None
        """The step :meth:`prepare` found committed: its save and commit are skipped."""

    def protocol(self) -> Commit:
        """The commit protocol over an I/O group of the current world (``--io-timeout``); collective when built."""
        if self._commit is None:
            self._commit = Commit(
                self.root,
                self.storage,
                Group(None, self.env.io_timeout_s),
                kind=KIND,
                generation=self.env.generation,
                naming=NAMING,
                keep_last=self.keep_last,
                log=self._log,
                claim_as=fence.worker_world(self.env, self.root),  # the workers fence a root the launcher did not
                protect=self._protected,
            )
        return self._commit

    def prepare(self, step: int) -> bool:
        """Collective, before the Trainer writes ``checkpoint-<step>``: a world that lost the root stops here, before
        it writes anything there (the commit checks again); the leftover of a save of that step cut short (files of
        ranks the world no longer has among them) is removed. False: the step is committed already, and a committed
        folder is never written again (the Trainer's save and the commit are skipped)."""
        fresh = self.protocol().prepare(step) is not None
        self._committed_before = None if fresh else step
        return fresh

    def _protected(self) -> tuple[int, ...]:
        best = self._best()
        step = NAMING.parse(os.path.basename(os.path.normpath(best))) if best else None
        return () if step is None else (step,)

    def leave_world(self) -> None:
        """The group the protocol runs on is gone with its world; the next world builds its own."""
        self._commit = None

    def restore(self) -> Resume | None:
        """Collective: the newest committed checkpoint every rank verified (its state file read), or None."""
        proto = self.protocol()

        def load(d: layout.StepDir, marker: layout.CommitMarker) -> Resume | None:
            problem: str | None = None
            state: dict[str, Any] = {}
            try:
                data = self.storage.read_bytes(os.path.join(d.path, STATE_FILE))
                check_crc(data, marker.files.get(STATE_FILE), f"{d.path}/{STATE_FILE}")
                state = json.loads(data)
                int(state["cursor"])
            except (OSError, ValueError, KeyError, TypeError, CheckpointError) as e:
                problem = f"{d.path}: {type(e).__name__}: {e}"
            problem = proto.agree(problem)
            if problem is not None:
                proto.reject(d, problem)
                return None
            batch, stream = state.get("global_batch"), state.get("stream")
            return Resume(
                d.path,
                marker.step,
                int(state["cursor"]),
                marker.world_size,
                int(batch) if batch else None,
                stream if isinstance(stream, dict) else None,
            )

        return proto.restore(load)

    def commit(self, step: int, cursor: int, global_batch: int, stream: dict[str, Any] | None = None) -> str:
        """Collective: commit ``checkpoint-<step>`` after the Trainer wrote it; its path. ``stream``: an iterable
        training set's place at ``cursor`` (rank 0's), written with the data position.

        Raises :class:`~elastrain.errors.CheckpointSaveError` naming the path and the cause if any rank could
        not make its files durable or the marker could not be written."""
        proto = self.protocol()
        path = os.path.join(self.root, NAMING.name(step))
        if self._committed_before == step:
            self._committed_before = None
            return path  # committed before this save (prepare said so on every rank alike)
        rank, world = proto.rank, proto.world_size
        report: dict[str, layout.FileEntry] = {}
        error: str | None = None
        expected: list[str] | None = None
        try:
            names = [n for n in self.storage.walk_files(path) if n not in PROTOCOL_FILES and n != STATE_FILE]
            for name in names:
                m = _RNG_FILE.match(os.path.basename(name))
                if (int(m.group(1)) == rank) if m else rank == 0:
                    report[name] = fsync_and_checksum(os.path.join(path, name))
            if rank == 0:
                state: dict[str, Any] = {
                    "format": 2,
                    "step": step,
                    "cursor": cursor,
                    "global_batch": global_batch,
                    "world_size": world,
                }
                if stream:
                    state["stream"] = stream
                data = json.dumps(state).encode()
                self.storage.write_atomic(os.path.join(path, STATE_FILE), data)
                report[STATE_FILE] = entry_of(data)
                fsync_dir(path)
                expected = [*names, STATE_FILE]
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
        proto.commit(step, path, report, error, expected=expected)
        self._log("checkpoint_committed", step=step, path=path, cursor=cursor)
        return path

    def committed(self, step: int) -> bool:
        """Whether ``checkpoint-<step>`` is committed in this root (no collective; a local look)."""
        return is_committed(os.path.join(self.root, NAMING.name(step)))

    def committed_paths(self) -> list[str]:
        return [d.path for d in layout.list_step_dirs(self.root, self.storage, NAMING) if d.committed]

    def uncommitted(self, path: str) -> bool:
        return os.path.isdir(path) and not is_committed(path)
