"""The Trainer's training DataLoader, read as elastrain's stream from the data position it resumes at.

The training set is read as :class:`~elastrain.integrations.trainer.stream.StreamBatches`: this rank's
micro-batches of each step's global batch, from the agreed position, for the steps left in the run;
accelerate is told not to shard them again. A map-style set (one with a length) is read by index; an
iterable set (``datasets.IterableDataset``, ``--streaming``) by position in its own order, through
:class:`~elastrain.integrations.trainer.iterable.IterableStream`, in the main process.
"""

from __future__ import annotations

import logging
from typing import Any

from elastrain.integrations.trainer.errors import TrainerIntegrationError
from elastrain.integrations.trainer.iterable import IterableStream
from elastrain.integrations.trainer.memory import Held
from elastrain.integrations.trainer.rescale import TrainerBatch
from elastrain.integrations.trainer.stream import StreamBatches, ends_epoch, epochs_left
from elastrain.integrations.trainer.weak_trainer import WeakTrainer
from elastrain.log import lifecycle


class StreamLoader:
    """Builds the DataLoader the Trainer trains on, for the batch plan and data position of this world."""

    trainer = WeakTrainer()

    def __init__(self, trainer: Any, batch: TrainerBatch, held: Held) -> None:
        self.trainer = trainer
        self.batch = batch
        self.held = held
        self.num_samples = 0
        """The training set's size (known once the Trainer asks for its dataloader; 0: an iterable set)."""
        self.iterable: IterableStream | None = None
        """An iterable set's stream, kept across this process's worlds (it is read forward)."""
        self._warned_stream = False
        self._warned_workers = False
        self._warned_sampling = False
        self._warned_sampler = False
        self.sampler: StreamBatches | None = None
        """This train() call's batches (None: not built yet, or the Trainer's own DataLoader)."""
        self.start_step = 0
        """The optimizer step the sampler's first step follows."""
        self.first_step: tuple[tuple[int, ...], ...] | None = None
        """This rank's split of the next train() call's first step, when the world made one
        (:mod:`~elastrain.integrations.trainer.kept_grads`); None: the batch plan's."""

    def stream_ok(self) -> bool:
        """Whether the training set can be read as the stream: a map-style set with a length, or an iterable set."""
        from collections.abc import Sized

        ok = self._is_iterable() or isinstance(self.trainer.train_dataset, Sized)
        if not ok and not self._warned_stream:
            self._warned_stream = True
            lifecycle(
                "trainer_data_unordered",
                level=logging.WARNING,
                why="the training set has no length and is not iterable: its position is not kept across world sizes",
            )
        return ok

    def _is_iterable(self) -> bool:
        """Whether the training set is read by iterating it (a torch IterableDataset, or an iterable with no length:
        ``datasets.IterableDataset``), as the Trainer reads it."""
        from collections.abc import Iterable, Sized

        from torch.utils.data import IterableDataset

        dataset = self.trainer.train_dataset
        return isinstance(dataset, IterableDataset) or (
            isinstance(dataset, Iterable) and not isinstance(dataset, Sized)
        )

    def check_own(self) -> None:
        """Once the Trainer built its training DataLoader: said once when that is not the stream (a Trainer subclass
        whose ``get_train_dataloader`` builds its own, without the Trainer's)."""
        if self.sampler is not None or self._warned_stream:
            return
        self._warned_stream = True
        lifecycle(
            "trainer_dataloader_own",
            level=logging.WARNING,
            trainer=type(self.trainer).__name__,
            why="its get_train_dataloader builds a DataLoader of its own, not the Trainer's: its position is not kept "
            "across world sizes (samples may be trained twice or skipped after a membership change)",
        )

    def _warn_sampler(self) -> None:
        """A Trainer subclass's own ``_get_train_sampler``, which the stream never calls: said once."""
        from transformers import Trainer

        cls = type(self.trainer)
        if self._warned_sampler or cls._get_train_sampler is Trainer._get_train_sampler:
            return
        self._warned_sampler = True
        lifecycle(
            "trainer_sampler_unused",
            level=logging.WARNING,
            trainer=cls.__name__,
            why="its _get_train_sampler is not called: elastrain reads the training set in its own seeded order, "
            "the same at every world size",
        )

    def _warn_sampling(self, strategy: str) -> None:
        """A sampling strategy the stream does not follow (it orders by a seeded permutation): said once."""
        if strategy in ("random", "sequential") or self._warned_sampling:
            return
        self._warned_sampling = True
        lifecycle(
            "trainer_sampling_replaced",
            level=logging.WARNING,
            train_sampling_strategy=strategy,
            instead="random",
            why="elastrain reads the training set as a seeded permutation per epoch, the same at every world size "
            "(every sample once per epoch); it does not group samples by length",
        )

    def epochs(self, max_steps: int) -> tuple[int, int] | None:
        """The Trainer's ``(epochs_trained, num_train_epochs)`` for this train() call: the stream's epochs its steps
        read (None: the Trainer's own DataLoader, and its own epochs)."""
        if self.sampler is None:
            return None
        position = self.held.position
        if self.sampler.num_samples is None:  # an iterable set's passes are not known ahead: one epoch to the end
            return (0, 0) if max_steps <= self.start_step else (0, 1)
        return epochs_left(position.cursor_at(self.start_step), position.cursor_at(max_steps), self.num_samples)

    def epoch_at(self, step: int, max_steps: int) -> tuple[float, bool] | None:
        """The Trainer's ``state.epoch`` after ``step``, and whether that step ends one of the stream's epochs (None:
        the Trainer's own DataLoader, and its own epochs). An iterable set's epoch is ``step / max_steps``, as
        transformers counts it for a set with no length."""
        if self.sampler is None:
            return None
        if self.sampler.num_samples is None:
            return step / max(max_steps, 1), False
        position, n = self.held.position, self.num_samples
        ends = step < max_steps and ends_epoch(position.cursor_at(step - 1), position.cursor_at(step), n)
        return position.cursor_at(step) / n, ends

    def train_dataloader(self) -> Any:
        """The DataLoader of this rank's micro-batches of the stream, for the steps left in the run."""
        from functools import partial

        from torch.utils.data import DataLoader
        from transformers.trainer_utils import seed_worker

        t = self.trainer
        dataset = t.train_dataset
        collator = t.data_collator
        try:
            import datasets

            is_hf_dataset = isinstance(dataset, datasets.Dataset)
        except ImportError:
            is_hf_dataset = False
        if is_hf_dataset:
            dataset = t._remove_unused_columns(dataset, description="training")
        else:
            collator = t._get_collator_with_removed_columns(collator, description="training")
        batch = self.batch
        if batch.plan is None:
            raise RuntimeError("internal: the train dataloader is built before the batch plan")
        args = t.args
        iterable = self._is_iterable()
        if iterable and args.max_steps <= 0:
            raise TrainerIntegrationError(
                "the training set is iterable (no length): set --max_steps (max_steps), the run's length in steps"
            )
        num_samples = self.num_samples = 0 if iterable else len(dataset)
        total = batch.total_steps(num_samples)
        args.max_steps = total  # epochs asked: their steps at the global batch, the same at every world size
        remaining = total - int(self.held.position.step)
        start = self.held.position.cursor
        if batch.settings is not None:
            seed, shuffle = batch.settings.seed, batch.settings.shuffle
        else:
            seed = args.data_seed if args.data_seed is not None else args.seed
            shuffle = args.train_sampling_strategy != "sequential"
            if not iterable:  # an iterable set is read in its own order, as the Trainer reads it
                self._warn_sampling(str(args.train_sampling_strategy))
        self._warn_sampler()
        first, self.first_step = self.first_step, None
        start_step = int(self.held.position.step)
        sampler = StreamBatches(
            None if iterable else num_samples,
            batch.plan,
            batch.rank,
            start,
            remaining,
            seed=seed,
            shuffle=shuffle,
            first=first,
            progress=lambda: int(self.trainer.state.global_step) - start_step,  # the Trainer weakly: see weak_trainer
        )
        self.sampler, self.start_step = sampler, start_step
        workers = int(args.dataloader_num_workers)
        if iterable:
            dataset, workers = self._iterable_stream(dataset, batch.plan.global_batch, start), 0
        loader = DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=collator,
            num_workers=workers,
            pin_memory=args.dataloader_pin_memory,
            persistent_workers=args.dataloader_persistent_workers and workers > 0,
            prefetch_factor=args.dataloader_prefetch_factor if workers > 0 else None,
            multiprocessing_context=args.dataloader_multiprocessing_context if workers > 0 else None,
            worker_init_fn=partial(seed_worker, num_workers=workers, rank=args.process_index),
        )
        prepared = t.accelerator.prepare(loader)
        from accelerate.data_loader import BatchSamplerShard

        shard = prepared.batch_sampler
        if isinstance(shard, BatchSamplerShard) and shard.batch_sampler is sampler:
            shard.num_processes = 1  # already this rank's batches: accelerate must not shard them again
            shard.process_index = 0
        return prepared

    def _iterable_stream(self, source: Any, global_batch: int, start: int) -> IterableStream:
        """The iterable set's stream, read up to ``start`` (kept across this process's worlds: read forward, with a
        few global batches kept for what was read ahead before a regroup), or resumed there from the place in the
        set a peer sent (a joiner)."""
        if self.iterable is None or self.iterable.source is not source:
            self.iterable = IterableStream(source, lookback=4 * global_batch, mark_every=global_batch)
            held = self.held
            held.stream.attach(self.iterable.mark, lambda: held.position.cursor)
        self.iterable.set_lookback(4 * global_batch)
        mark = self.held.stream.take()
        if mark is not None and mark.get("position") == start and not self.iterable.near(start):
            self.iterable.resume(mark)  # a peer's or a checkpoint's place in the set: nothing before it read
        if int(self.trainer.args.dataloader_num_workers) > 0 and not self._warned_workers:
            self._warned_workers = True
            lifecycle(
                "trainer_stream_workers_unused",
                level=logging.WARNING,
                dataloader_num_workers=self.trainer.args.dataloader_num_workers,
                why="an iterable training set is read in order in the main process (each DataLoader worker would "
                "read its own part of it)",
            )
        self.iterable.seek(start)
        return self.iterable
