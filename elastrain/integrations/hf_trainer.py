"""A Hugging Face ``Trainer`` that survives changes of world size under elastrain-run.

Four lines around an ordinary ``Trainer`` script::

    from elastrain.integrations.hf_trainer import ElasticTrainerRun

    elastic = ElasticTrainerRun(global_batch=32, micro_batch=8, max_steps=200)
    args = TrainingArguments(**elastic.training_args(), learning_rate=3e-4, save_steps=20)
    trainer = Trainer(model=model, args=args, train_dataset=elastic.dataset(train_set),
                      data_collator=collate, callbacks=[elastic.callback])
    trainer.train(resume_from_checkpoint=elastic.resume_from())

What each part does:

* **Global batch.** ``training_args()`` sets ``per_device_train_batch_size`` and
  ``gradient_accumulation_steps`` so that ``micro × accumulation × world`` is exactly the global batch
  at the current world size (:func:`trainer_batch`), and ``max_steps``, the output directory
  (``--checkpoint-dir``) and ``ignore_data_skip``.
* **Exact data position.** The Trainer's own skip-ahead replays the *per-rank* batches of the old
  world size, which is wrong once the world size changes (transformers#40245). Here the training set
  is wrapped in a :class:`StreamView`: a world-size independent stream (a seeded permutation per
  epoch, :func:`elastrain.data.epoch_order`) that starts at the checkpoint's global sample cursor and
  is read sequentially; accelerate deals consecutive batches to the ranks, so each optimizer step
  consumes the next ``global_batch`` positions of the stream whoever the workers are, and the
  Trainer's skip is turned off.
* **Complete checkpoints.** The callback commits every ``checkpoint-N`` folder the Trainer writes
  with an elastrain commit marker (:mod:`elastrain.checkpoint.layout`) once every rank's files are
  on disk, and keeps the newest ``keep_last`` committed ones (the Trainer's own rotation, which may
  delete the last complete checkpoint before the new one is complete, is turned off).
  ``resume_from()`` returns the newest checkpoint every rank verified, or ``None``.
* **Continuous metrics.** The global step continues from the checkpoint; the callback writes the
  Trainer's logs to ``metrics.jsonl`` (:mod:`elastrain.metrics`) keyed by global step, and keeps
  ``state.epoch`` the true dataset epoch.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import uuid
from collections.abc import Sized
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import TrainerCallback

from elastrain.checkpoint import layout
from elastrain.checkpoint.storage import LocalStorage, fsync_dir
from elastrain.control import ControlChannel
from elastrain.data import epoch_order
from elastrain.env import WorkerEnv
from elastrain.errors import CheckpointCorruptError, CheckpointError, ScalingError
from elastrain.integrations.trainer_batch import trainer_batch
from elastrain.log import configure, lifecycle
from elastrain.metrics import METRICS_FILENAME, EventsFile, MetricsWriter

KIND = "hf-trainer"
STATE_FILE = "elastrain-state.json"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
_RNG_FILE = re.compile(r"^rng_state_(\d+)\.pth$")


class StreamView(Dataset[Any]):
    """Positions ``start, start+1, ...`` of the world-size independent sample stream over ``dataset``.

    Stream position ``p`` is sample ``epoch_order(len(dataset), seed, p // len)[p % len]``: every epoch
    is a fresh seeded permutation, and epochs follow each other without a gap.
    """

    def __init__(self, dataset: Any, length: int, start: int = 0, seed: int = 0, shuffle: bool = True) -> None:
        if not isinstance(dataset, Sized) or len(dataset) < 1:
            raise ScalingError("the training dataset must be a non-empty map-style dataset (with __len__)")
        self.dataset: Any = dataset
        self.num_samples = len(dataset)
        self.length = length
        self.start = start
        self.seed = seed
        self.shuffle = shuffle
        self._orders: dict[int, Any] = {}

    def __len__(self) -> int:
        return self.length

    def index(self, i: int) -> int:
        """The dataset index at position ``i`` of this view."""
        if not 0 <= i < self.length:
            raise IndexError(f"position {i} outside a view of {self.length}")
        epoch, offset = divmod(self.start + i, self.num_samples)
        if epoch not in self._orders:
            if len(self._orders) >= 2:
                self._orders.pop(min(self._orders))
            self._orders[epoch] = epoch_order(self.num_samples, self.seed, epoch, self.shuffle)
        return int(self._orders[epoch][offset])

    def __getitem__(self, i: int) -> Any:
        return self.dataset[self.index(i)]


@dataclass(frozen=True)
class Resume:
    """The checkpoint a run resumes from."""

    path: str
    step: int
    cursor: int
    world_size: int


class ElasticTrainerRun:
    """Everything the Trainer needs to be elastic; build it before the ``TrainingArguments``."""

    def __init__(
        self,
        global_batch: int,
        micro_batch: int,
        max_steps: int | None = None,
        *,
        num_train_epochs: float | None = None,
        output_dir: str | os.PathLike[str] | None = None,
        keep_last: int = 2,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        configure()
        self.env = WorkerEnv.from_environ()
        root = output_dir if output_dir is not None else self.env.checkpoint_dir
        if root is None:
            raise CheckpointError(
                "no output directory: launch with elastrain-run --checkpoint-dir DIR or pass output_dir=..."
            )
        if max_steps is None and num_train_epochs is None:
            raise ScalingError("give max_steps or num_train_epochs (the run's length must not depend on world size)")
        if keep_last < 1:
            raise CheckpointError(f"keep_last must be >= 1, got {keep_last}")
        self.root = os.path.abspath(os.fspath(root))
        self.global_batch = global_batch
        self.micro_batch, self.accumulation = trainer_batch(global_batch, micro_batch, self.env.world_size)
        self.max_steps = max_steps
        self.num_train_epochs = num_train_epochs
        self.keep_last = keep_last
        self.seed = seed
        self.shuffle = shuffle
        self.storage = LocalStorage()
        self._resume: Resume | None = None
        self._resolved = False
        self._view: StreamView | None = None
        self.callback = ElasticCallback(self)

    # -- setup -------------------------------------------------------------------------------------
    def training_args(self) -> dict[str, Any]:
        """Keyword arguments for ``TrainingArguments`` (pass the rest yourself)."""
        out: dict[str, Any] = {
            "output_dir": self.root,
            "per_device_train_batch_size": self.micro_batch,
            "gradient_accumulation_steps": self.accumulation,
            "ignore_data_skip": True,
            "train_sampling_strategy": "sequential",
            "save_total_limit": None,
            "dataloader_drop_last": False,
        }
        if self.max_steps is not None:
            out["max_steps"] = self.max_steps
        return out

    def total_steps(self, num_samples: int) -> int:
        if self.max_steps is not None:
            return self.max_steps
        return math.ceil(float(self.num_train_epochs or 0) * num_samples / self.global_batch)

    def dataset(self, train_dataset: Any) -> StreamView:
        """The training set as the stream view the Trainer reads; its start is fixed by :meth:`resume_from`."""
        self._view = _LazyStreamView(self, train_dataset)
        return self._view

    # -- resuming ----------------------------------------------------------------------------------
    def checkpoints(self) -> list[layout.StepDir]:
        """The Trainer's ``checkpoint-N`` folders, oldest first; ``committed`` means elastrain's marker exists."""
        out = []
        for name in self.storage.listdir(self.root):
            m = _CHECKPOINT_RE.match(name)
            path = os.path.join(self.root, name)
            if m and os.path.isdir(path):
                committed = os.path.exists(os.path.join(path, layout.MARKER))
                out.append(layout.StepDir(step=int(m.group(1)), path=path, committed=committed))
        return sorted(out, key=lambda d: d.step)

    def resume_from(self) -> str | None:
        """The newest checkpoint every rank verified (pass it to ``trainer.train``); ``None`` to start fresh.

        Collective once torch.distributed is up (``TrainingArguments`` brings it up): call it on every rank.
        """
        if self._resolved:
            return self._resume.path if self._resume else None
        rank, world = _rank_world()
        for d in reversed(self.checkpoints()):
            if not d.committed:
                if rank == 0:
                    lifecycle("checkpoint_skipped", path=d.path, why="no commit marker (a save that never finished)")
                continue
            problem: str | None = None
            try:
                marker = layout.verify_step(d.path, True, rank, world, self.storage)
            except CheckpointCorruptError as e:
                problem = str(e)
            problems = [p for p in _all_gather(problem) if p is not None]
            if problems:
                if rank == 0:
                    lifecycle("checkpoint_fallback", logging.WARNING, bad=d.path, reason=problems[0])
                continue
            state = json.loads(self.storage.read_bytes(os.path.join(d.path, STATE_FILE)))
            self._resume = Resume(d.path, marker.step, int(state["cursor"]), marker.world_size)
            break
        self._resolved = True
        if rank == 0:
            r = self._resume
            lifecycle(
                "checkpoint_restored",
                step=r.step if r else None,
                path=r.path if r else self.root,
                world_size=f"{r.world_size if r else 'none'}->{world}",
                cursor=r.cursor if r else 0,
                global_batch=self.global_batch,
                micro_batch=self.micro_batch,
                accumulation=self.accumulation,
                format=KIND,
            )
        return self._resume.path if self._resume else None

    @property
    def start_step(self) -> int:
        return self._resume.step if self._resume else 0

    @property
    def start_cursor(self) -> int:
        return self._resume.cursor if self._resume else 0

    def cursor_at(self, step: int) -> int:
        """The stream position after optimizer step ``step`` of this run."""
        return self.start_cursor + (step - self.start_step) * self.global_batch

    # -- committing --------------------------------------------------------------------------------
    def commit(self, step: int, trainer_epoch: float | None = None) -> str:
        """Commit ``checkpoint-<step>`` after the Trainer wrote it (collective); its path."""
        path = os.path.join(self.root, f"checkpoint-{step}")
        rank, world = _rank_world()
        for name in self.storage.walk_files(path) if os.path.isdir(path) else []:
            m = _RNG_FILE.match(os.path.basename(name))
            mine = int(m.group(1)) == rank if m else rank == 0
            if mine and name != layout.MARKER:
                _fsync_file(os.path.join(path, name))
        _barrier()
        if rank == 0:
            cursor = self.cursor_at(step)
            state = {"format": 1, "step": step, "cursor": cursor, "global_batch": self.global_batch}
            state["world_size"] = world
            self.storage.write_atomic(os.path.join(path, STATE_FILE), json.dumps(state).encode())
            entries = layout.manifest(path, checksum=True, storage=self.storage)
            fsync_dir(path)
            layout.write_commit_marker(
                path, layout.CommitMarker(step=step, world_size=world, files=entries, kind=KIND), self.storage
            )
            lifecycle("checkpoint_committed", step=step, path=path, cursor=cursor, format=KIND)
            self._purge()
        _barrier()
        return path

    def _purge(self) -> None:
        for d in layout.retention_plan(self.checkpoints(), self.keep_last):
            layout.remove_step_dir(d.path, self.storage)
            lifecycle("checkpoint_purged", removed=d.path, why="retention" if d.committed else "incomplete")


class _LazyStreamView(StreamView):
    """A :class:`StreamView` whose start and length are read from the run when the Trainer first asks."""

    def __init__(self, run: ElasticTrainerRun, dataset: Any) -> None:
        super().__init__(dataset, length=0, seed=run.seed, shuffle=run.shuffle)
        self.run = run
        self._fixed = False

    def _fix(self) -> None:
        if not self._fixed:
            self.run.resume_from()
            self.start = self.run.start_cursor
            remaining = self.run.total_steps(self.num_samples) - self.run.start_step
            self.length = max(remaining, 0) * self.run.global_batch
            self._fixed = True

    def __len__(self) -> int:
        self._fix()
        return self.length

    def index(self, i: int) -> int:
        self._fix()
        return super().index(i)


class ElasticCallback(TrainerCallback):
    """Commits checkpoints, honours the launcher's save requests, keeps epoch and metrics continuous."""

    def __init__(self, run: ElasticTrainerRun) -> None:
        self.run = run
        self._metrics: MetricsWriter | None = None
        self._channel = ControlChannel(run.env.control_dir) if run.env.control_dir else None
        self._request_id: int | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        rank, world = _rank_world()
        if state.global_step != self.run.start_step:
            raise CheckpointError(
                f"the Trainer resumed at step {state.global_step} but elastrain's checkpoint is at step "
                f"{self.run.start_step}: pass resume_from_checkpoint=elastic.resume_from() to trainer.train"
            )
        if rank == 0:
            segment = uuid.uuid4().hex[:12]
            self._metrics = MetricsWriter(os.path.join(self.run.root, METRICS_FILENAME), segment, state.global_step)
            resumed = self.run._resume
            if resumed is not None and resumed.world_size != world:
                EventsFile(self.run.env.events_file).record(
                    "world_size_changed", old=resumed.world_size, new=world, step=state.global_step
                )

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        view = self.run._view
        if view is not None and view.num_samples:
            state.epoch = self.run.cursor_at(state.global_step) / view.num_samples
        if self._channel is not None:
            pending = self._channel.pending()
            asked = _all_max(int(pending is not None))
            if asked:
                request = self._channel.current_request()
                self._request_id = request.request_id if request else None
                control.should_save = True

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        path = self.run.commit(state.global_step)
        if self._channel is not None and self._request_id is not None:
            if self.run.env.local_rank == 0:
                self._channel.ack(self._request_id, state.global_step, path)
            else:
                self._channel.mark_handled(self._request_id)
            self._request_id = None

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if self._metrics is not None and logs:
            values = {k: v for k, v in logs.items() if isinstance(v, (int, float))}
            _, world = _rank_world()
            self._metrics.log(state.global_step, world_size=world, **values)


# -- small collectives that also work without torch.distributed ----------------------------------------
def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather(obj: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _all_max(value: int) -> int:
    return max(int(v) for v in _all_gather(value))


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
