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
  through elastrain's one commit protocol (:mod:`elastrain.checkpoint.commit`): every rank fsyncs and
  checksums the files it wrote, rank 0 writes the commit marker from their reports, and the newest
  ``keep_last`` committed ones are kept (the Trainer's own rotation, which may delete the last
  complete checkpoint before the new one is complete, is turned off). A commit that fails raises
  :class:`~elastrain.errors.CheckpointSaveError`. ``resume_from()`` returns the newest checkpoint
  every rank verified, or ``None``. The launcher's save requests go through the one save schedule
  (:mod:`elastrain.checkpoint.schedule`).
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
import time
import uuid
from collections.abc import Sized
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import TrainerCallback

from elastrain.checkpoint import fence, layout
from elastrain.checkpoint.commit import PROTOCOL_FILES, Commit, entry_of, fsync_and_checksum
from elastrain.checkpoint.dcp_io import check_crc
from elastrain.checkpoint.group import Group
from elastrain.checkpoint.schedule import SaveReason, SaveSchedule, SaveTrigger
from elastrain.checkpoint.storage import LocalStorage, fsync_dir, local_path
from elastrain.control import ControlChannel
from elastrain.data import epoch_order
from elastrain.env import WorkerEnv
from elastrain.errors import CheckpointError, ScalingError
from elastrain.integrations.trainer_batch import trainer_batch
from elastrain.log import configure, lifecycle
from elastrain.metrics import METRICS_FILENAME, EventsFile, MetricsWriter

KIND = "hf-trainer"
STATE_FILE = "elastrain-state.json"
TRAINER_NAMING = layout.Naming("checkpoint-", 0)
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
        hold_after_request_s: float = 5.0,
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
        self.root = os.path.abspath(local_path(root))
        self.global_batch = global_batch
        self.micro_batch, self.accumulation = trainer_batch(global_batch, micro_batch, self.env.world_size)
        self.max_steps = max_steps
        self.num_train_epochs = num_train_epochs
        self.keep_last = keep_last
        self.seed = seed
        self.shuffle = shuffle
        self.storage = LocalStorage()
        self.storage.makedirs(self.root)  # made durable in its parent before anything is committed into it
        self.schedule = SaveSchedule(hold_after_request_s=hold_after_request_s)  # the Trainer's save_steps rule
        self._commit: Commit | None = None
        self._sync: Group | None = None
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

    # -- the commit protocol (created once torch.distributed is up) -----------------------------------
    def protocol(self) -> Commit:
        """The commit protocol over an I/O group (``--io-timeout``); collective the first time."""
        if self._commit is None or (not self._commit.group.distributed and _distributed()):
            group = Group(None, self.env.io_timeout_s)
            self._commit = Commit(
                self.root,
                self.storage,
                group,
                kind=KIND,
                generation=self.env.generation,
                naming=TRAINER_NAMING,
                keep_last=self.keep_last,
                log=self._log,
                claim_as=fence.worker_world(self.env, self.root),
            )
        return self._commit

    def sync_group(self) -> Group:
        """The group on which ranks agree to honour a save request (``--collective-timeout``)."""
        if self._sync is None or (not self._sync.distributed and _distributed()):
            self._sync = Group(None, self.env.collective_timeout_s)
        return self._sync

    def _log(self, event: str, level: int = logging.INFO, **fields: Any) -> None:
        rank = self._commit.rank if self._commit is not None else self.env.rank
        if rank == 0 or level >= logging.WARNING:
            lifecycle(event, level=level, rank=rank, format=KIND, **fields)

    # -- resuming ----------------------------------------------------------------------------------
    def checkpoints(self) -> list[layout.StepDir]:
        """The Trainer's ``checkpoint-N`` folders, oldest first; ``committed`` means elastrain's marker exists."""
        return layout.list_step_dirs(self.root, self.storage, TRAINER_NAMING)

    def resume_from(self) -> str | None:
        """The newest checkpoint every rank verified (pass it to ``trainer.train``); ``None`` to start fresh.

        Collective once torch.distributed is up (``TrainingArguments`` brings it up): call it on every rank.
        """
        if self._resolved:
            return self._resume.path if self._resume else None
        proto = self.protocol()

        def load(d: layout.StepDir, marker: layout.CommitMarker) -> Resume | None:
            problem: str | None = None
            cursor = 0
            try:
                data = self.storage.read_bytes(os.path.join(d.path, STATE_FILE))
                check_crc(data, marker.files.get(STATE_FILE), f"{d.path}/{STATE_FILE}")
                cursor = int(json.loads(data)["cursor"])
            except (OSError, ValueError, KeyError, TypeError, CheckpointError) as e:
                problem = f"{d.path}: {type(e).__name__}: {e}"
            problem = proto.agree(problem)
            if problem is not None:
                proto.reject(d, problem)
                return None
            return Resume(d.path, marker.step, cursor, marker.world_size)

        self._resume = proto.restore(load)
        self._resolved = True
        r = self._resume
        self._log(
            "checkpoint_restored",
            step=r.step if r else None,
            path=r.path if r else self.root,
            world_size=f"{r.world_size if r else 'none'}->{proto.world_size}",
            cursor=r.cursor if r else 0,
            global_batch=self.global_batch,
            micro_batch=self.micro_batch,
            accumulation=self.accumulation,
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
        """Commit ``checkpoint-<step>`` after the Trainer wrote it (collective); its path.

        Raises :class:`~elastrain.errors.CheckpointSaveError` naming the path and the cause if any
        rank could not make its files durable or the marker could not be written.
        """
        proto = self.protocol()
        path = os.path.join(self.root, TRAINER_NAMING.name(step))
        rank, world = proto.rank, proto.world_size
        report: dict[str, layout.FileEntry] = {}
        error: str | None = None
        expected: list[str] | None = None
        cursor = self.cursor_at(step)
        try:
            names = [n for n in self.storage.walk_files(path) if n not in PROTOCOL_FILES and n != STATE_FILE]
            for name in names:
                m = _RNG_FILE.match(os.path.basename(name))
                if (int(m.group(1)) == rank) if m else rank == 0:
                    report[name] = fsync_and_checksum(os.path.join(path, name))
            if rank == 0:
                state = {"format": 1, "step": step, "cursor": cursor, "global_batch": self.global_batch}
                state["world_size"] = world
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
        self._trigger: SaveTrigger | None = None
        self._requested = False

    def trigger(self) -> SaveTrigger:
        if self._trigger is None:
            sync = self.run.sync_group()
            self._trigger = SaveTrigger(
                self.run.schedule,
                self._channel,
                sync.all_max if sync.distributed else None,
                is_local_leader=self.run.env.local_rank == 0,
                log=self.run._log,
            )
        return self._trigger

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        rank, world = _rank_world()
        if state.global_step != self.run.start_step:
            raise CheckpointError(
                f"the Trainer resumed at step {state.global_step} but elastrain's checkpoint is at step "
                f"{self.run.start_step}: pass resume_from_checkpoint=elastic.resume_from() to trainer.train"
            )
        self.trigger().started(state.global_step)
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
        # Interval saves are the Trainer's own (save_steps); the trigger adds the launcher's requests.
        if self._channel is not None and self.trigger().check(state.global_step) is SaveReason.REQUEST:
            self.trigger().claim()
            self._requested = True
            control.should_save = True
        self._before_save(control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._before_save(control)

    def _before_save(self, control: Any) -> None:
        """The Trainer writes ``checkpoint-N`` before the commit: a world that lost the root must stop before it
        writes there (collective: every rank decides ``should_save`` alike)."""
        if control.should_save:
            self.run.protocol().ensure_current()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = state.global_step
        path = self.run.commit(step)
        trigger = self.trigger()
        trigger.started(step)
        trigger.committed(step, path, time.time())  # the Trainer saves synchronously
        if self._requested:
            self._requested = False
            trigger.hold(step)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if self._metrics is not None and logs:
            values = {k: v for k, v in logs.items() if isinstance(v, (int, float))}
            _, world = _rank_world()
            self._metrics.log(state.global_step, world_size=world, **values)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_world() -> tuple[int, int]:
    if _distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
