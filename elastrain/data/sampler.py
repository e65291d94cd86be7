"""ElasticSampler: a DataLoader batch sampler whose order does not depend on the world size.

Use it as ``DataLoader(dataset, batch_sampler=sampler, num_workers=..., pin_memory=...)``: it yields
this rank's micro-batches (lists of dataset indices), step after step, from the last committed
position to the end of the current epoch. Iterating does not move the saved position; call
:meth:`ElasticSampler.commit` once a step's optimizer update is done, so a checkpoint taken
between steps records exactly the samples already learnt from, and workers that prefetch ahead
lose nothing on a restart.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from elastrain.data.cursor import EpochEnd, Position, StepRange, check_fits, normalize, step_range
from elastrain.errors import DataStateError
from elastrain.scaling.policy import BatchPlan, split_batch

_STATE_VERSION = 1


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray[Any, np.dtype[np.int64]]:
    """The permutation of dataset indices for ``epoch``: a function of the seed and epoch only."""
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    return np.random.default_rng([seed, epoch]).permutation(num_samples).astype(np.int64)


@dataclass(frozen=True)
class RankStep:
    """One global step as this rank sees it."""

    range: StepRange
    micro_batches: tuple[tuple[int, ...], ...]
    """This rank's micro-batches (dataset indices)."""
    world_size: int

    @property
    def global_size(self) -> int:
        """Samples the whole step consumes over all ranks."""
        return self.range.size


class ElasticSampler(Sampler[list[int]]):
    """Batch sampler over a map-style dataset, resumable at any world size from a global cursor."""

    def __init__(
        self,
        dataset: Sized | int,
        plan: BatchPlan,
        rank: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        epoch_end: EpochEnd | str = EpochEnd.PARTIAL,
    ) -> None:
        if not isinstance(dataset, int) and not hasattr(dataset, "__len__"):
            raise DataStateError(
                f"ElasticSampler needs a map-style dataset with __len__, got a {type(dataset).__name__}: "
                "an IterableDataset has no global order to resume from"
            )
        self.num_samples = dataset if isinstance(dataset, int) else len(dataset)
        if not 0 <= rank < plan.world_size:
            raise DataStateError(f"rank {rank} is outside the plan's world size {plan.world_size}")
        self.plan = plan
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.epoch_end = EpochEnd(epoch_end)
        check_fits(self.num_samples, plan.global_batch, plan.world_size, self.epoch_end)
        self._position = Position(0, 0)
        self._orders: dict[int, np.ndarray[Any, np.dtype[np.int64]]] = {}

    # -- position ---------------------------------------------------------------------------------
    @property
    def position(self) -> Position:
        """The committed position, moved past a tail that will be skipped."""
        return normalize(self._position, self.num_samples, self.plan.global_batch, self.plan.world_size, self.epoch_end)

    @property
    def epoch(self) -> int:
        return self.position.epoch

    def commit(self, step: RankStep) -> None:
        """Record that ``step`` has been learnt from: the next iteration starts after it."""
        if step.range.start != self.position:
            raise DataStateError(
                f"commit of a step starting at {step.range.start} but the sampler stands at {self.position}: "
                "commit steps in order, once each"
            )
        self._position = step.range.end

    # -- steps ------------------------------------------------------------------------------------
    def _order(self, epoch: int) -> np.ndarray[Any, np.dtype[np.int64]]:
        if epoch not in self._orders:
            if len(self._orders) >= 2:
                self._orders.pop(min(self._orders))
            self._orders[epoch] = epoch_order(self.num_samples, self.seed, epoch, self.shuffle)
        return self._orders[epoch]

    def rank_step(self, rng: StepRange) -> RankStep:
        """This rank's micro-batches of the step ``rng``."""
        indices = np.concatenate([self._order(s.epoch)[s.start : s.stop] for s in rng.segments])
        sizes = split_batch(rng.size, self.plan.world_size, self.plan.micro_batch)
        offset = sum(sum(s) for s in sizes[: self.rank])
        micro: list[tuple[int, ...]] = []
        for n in sizes[self.rank]:
            micro.append(tuple(int(i) for i in indices[offset : offset + n]))
            offset += n
        return RankStep(range=rng, micro_batches=tuple(micro), world_size=self.plan.world_size)

    def steps(self, start: Position | None = None) -> Iterator[RankStep]:
        """Steps from ``start`` (default: the committed position) to the end of that epoch."""
        pos = self.position if start is None else start
        epoch = normalize(pos, self.num_samples, self.plan.global_batch, self.plan.world_size, self.epoch_end).epoch
        while True:
            rng = step_range(pos, self.num_samples, self.plan.global_batch, self.plan.world_size, self.epoch_end)
            if rng.start.epoch != epoch:
                return
            yield self.rank_step(rng)
            pos = rng.end

    def __iter__(self) -> Iterator[list[int]]:
        # The start is read now, not at the first ``next``: a DataLoader and ``steps()`` made
        # together agree even if a step is committed before the loader's first fetch.
        return self._micro_batches(self.steps(self.position))

    @staticmethod
    def _micro_batches(steps: Iterator[RankStep]) -> Iterator[list[int]]:
        for step in steps:
            for micro in step.micro_batches:
                yield list(micro)

    def __len__(self) -> int:
        """Micro-batches this rank yields in the rest of the current epoch."""
        return sum(len(s.micro_batches) for s in self.steps())

    # -- checkpoint -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        pos = self.position
        return {
            "version": _STATE_VERSION,
            "epoch": pos.epoch,
            "cursor": pos.cursor,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, mine in (("num_samples", self.num_samples), ("seed", self.seed), ("shuffle", self.shuffle)):
            if key in state and state[key] != mine:
                raise DataStateError(
                    f"the checkpoint's data position was saved with {key}={state[key]!r} but this run has "
                    f"{key}={mine!r}: resume with the same dataset and seed, or start a new checkpoint directory"
                )
        epoch, cursor = int(state["epoch"]), int(state["cursor"])
        if epoch < 0 or not 0 <= cursor <= self.num_samples:
            raise DataStateError(f"saved data position epoch={epoch} cursor={cursor} is out of range")
        self._position = Position(epoch, cursor)
