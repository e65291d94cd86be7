"""The Trainer's training data as elastrain's world-size independent stream: this rank's micro-batches.

The stream is a seeded permutation of the dataset per epoch, read front to back; position ``p`` is
sample ``epoch_order(n, seed, p // n)[p % n]``, epochs follow each other without a gap, and every
optimizer step takes the next ``global_batch`` positions whoever the workers are (epoch end ``wrap``
in :mod:`elastrain.data.cursor`). So the data position is one number, the samples consumed, and a
job that resumes at any world size, from a checkpoint or from a peer's memory, reads exactly the next
unseen sample: every sample once per epoch.

:class:`StreamBatches` is a batch sampler for one rank: each step's samples are split among the
ranks by the batch plan (:func:`elastrain.scaling.plan`: shares that differ by at most one sample,
the same number of micro-batches on every rank), and it yields this rank's micro-batches for the
steps left in the run. The Trainer's DataLoader takes it as its ``batch_sampler``; accelerate's own
sharding is turned off for it (it is already this rank's).

The Trainer still sees the stream's epochs: its loop runs one of its epochs per epoch of the stream
(:func:`epochs_left`), the step in which the stream reaches the end of an epoch ends the Trainer's
(:func:`ends_epoch`: its evaluation, save and log by ``"epoch"``, and the callbacks' ``on_epoch_end``, come
after it, as without elastrain), and each of the Trainer's epochs reads the sampler again from the step it
has reached (``progress``).

An iterable training set (no length) is a stream of positions of its own order (:mod:`~elastrain.
integrations.trainer.iterable`): ``num_samples=None``, and the indices are the positions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from elastrain.data import epoch_order
from elastrain.errors import DataStateError
from elastrain.scaling import BatchPlan


class StreamBatches(Sampler[list[int]]):
    """This rank's micro-batches for ``steps`` optimizer steps of the stream, starting at position ``start``."""

    def __init__(
        self,
        num_samples: int | None,
        plan: BatchPlan,
        rank: int,
        start: int,
        steps: int,
        seed: int,
        shuffle: bool = True,
        first: tuple[tuple[int, ...], ...] | None = None,
        progress: Callable[[], int] | None = None,
    ) -> None:
        if num_samples is not None and num_samples < 1:
            raise DataStateError("the training dataset is empty")
        if not 0 <= rank < plan.world_size:
            raise DataStateError(f"rank {rank} is outside the plan's world size {plan.world_size}")
        if not plan.uniform:
            raise DataStateError(
                f"a global batch of {plan.global_batch} over {plan.world_size} workers with micro-batches of "
                f"{plan.micro_batch} gives the workers different numbers of micro-batches, which the Trainer cannot "
                "run: raise per_device_train_batch_size or the global batch"
            )
        self.num_samples = num_samples
        """None: an iterable set, whose stream positions are the indices (it has its own order)."""
        self.plan = plan
        self.rank = rank
        self.start = start
        self.steps = max(0, steps)
        self.seed = seed
        self.shuffle = shuffle
        if first is not None and len(first) != plan.accumulation:
            raise DataStateError(f"the first step's split gives {len(first)} micro-batches, not {plan.accumulation}")
        self.first = first
        self.progress = progress
        """How many of its steps the Trainer has completed: where reading it again goes on (None: from the start)."""
        """This rank's micro-batches of the first step, as positions in its global batch, when the world split that
        step itself (a lost step's kept micro-batches: :mod:`~elastrain.integrations.trainer.kept_split`)."""
        self._orders: dict[int, np.ndarray[Any, np.dtype[np.int64]]] = {}

    def _order(self, epoch: int) -> np.ndarray[Any, np.dtype[np.int64]]:
        assert self.num_samples is not None
        if epoch not in self._orders:
            if len(self._orders) >= 2:
                self._orders.pop(min(self._orders))
            self._orders[epoch] = epoch_order(self.num_samples, self.seed, epoch, self.shuffle)
        return self._orders[epoch]

    def indices(self, first: int, count: int) -> list[int]:
        """Dataset indices at stream positions ``first .. first + count - 1`` (the positions: an iterable set)."""
        if self.num_samples is None:
            return list(range(first, first + count))
        out: list[int] = []
        pos, end = first, first + count
        while pos < end:
            epoch, offset = divmod(pos, self.num_samples)
            take = min(end - pos, self.num_samples - offset)
            out.extend(int(i) for i in self._order(epoch)[offset : offset + take])
            pos += take
        return out

    def step_offsets(self, step_index: int) -> tuple[tuple[int, ...], ...]:
        """This rank's micro-batches of the ``step_index``-th step from :attr:`start`, as positions in its global
        batch (0 .. global_batch - 1)."""
        if step_index == 0 and self.first is not None:
            return self.first
        sizes = self.plan.micro_sizes
        offset = sum(sum(s) for s in sizes[: self.rank])
        out = []
        for n in sizes[self.rank]:
            out.append(tuple(range(offset, offset + n)))
            offset += n
        return tuple(out)

    def step_micro_batches(self, step_index: int) -> list[list[int]]:
        """This rank's micro-batches of the ``step_index``-th step from :attr:`start` (dataset indices)."""
        global_batch = self.plan.global_batch
        samples = self.indices(self.start + step_index * global_batch, global_batch)
        return [[samples[o] for o in micro] for micro in self.step_offsets(step_index)]

    def __iter__(self) -> Iterator[list[int]]:
        done = self.progress() if self.progress is not None else 0
        for k in range(max(0, done), self.steps):
            yield from self.step_micro_batches(k)

    def __len__(self) -> int:
        return self.steps * self.plan.accumulation


def epochs_left(next_cursor: int, end_cursor: int, num_samples: int) -> tuple[int, int]:
    """Pure: the stream's epochs that the steps from stream position ``next_cursor`` to ``end_cursor`` read, as
    ``range(first, stop)``: the Trainer's ``epochs_trained`` and ``num_train_epochs``."""
    first = next_cursor // num_samples
    if end_cursor <= next_cursor:
        return first, first  # no step left (a world entered after the last step): no epoch, and no epoch's end
    return first, max(first, -(-end_cursor // num_samples))


def ends_epoch(cursor_before: int, cursor_after: int, num_samples: int) -> bool:
    """Pure: whether the step that reads stream positions ``cursor_before`` to ``cursor_after`` (exclusive) reaches
    the end of an epoch: the last step of that epoch, whose end the Trainer marks after it."""
    return cursor_after // num_samples > cursor_before // num_samples
