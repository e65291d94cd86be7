"""The session's data: the elastic sampler, and a DataLoader that always starts from its committed position.

The sampler (:class:`~elastrain.data.ElasticSampler`) holds the one global cursor; the loader and the
step plan are rebuilt from that cursor at every epoch and at every entry into a world, so after a
change of world size the next step takes the next unseen samples, split for the new world.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from elastrain.data import ElasticSampler, RankStep
from elastrain.scaling import BatchPlan, loss_scale
from elastrain.session.config import DataConfig
from elastrain.session.errors import SessionError
from elastrain.session.step import move_to


class Feed:
    """This rank's micro-batches, step by step, from the sampler's committed position."""

    def __init__(self, dataset: Dataset[Any], config: DataConfig, device: torch.device) -> None:
        self.dataset = dataset
        self.config = config
        self.device = device
        self.sampler: ElasticSampler | None = None
        self._loader: DataLoader[Any] | None = None
        self._steps: Iterator[RankStep] | None = None  # the current loader's epoch, step by step
        self._batches: Iterator[Any] | None = None
        self.idle = False
        """This rank takes no sample in the next step (it sits it out: :mod:`elastrain.session.catch_up`)."""

    def build(self, batch_plan: BatchPlan, rank: int) -> ElasticSampler:
        """The sampler, at the start of the data (a checkpoint or a peer then moves it to its position)."""
        self.sampler = ElasticSampler(
            self.dataset,  # type: ignore[arg-type]
            batch_plan,
            rank,
            seed=self.config.seed,
            shuffle=self.config.shuffle,
            epoch_end=self.config.epoch_end,
        )
        return self.sampler

    def require_sampler(self) -> ElasticSampler:
        if self.sampler is None:
            raise SessionError("the session is not started: use `with Session(...) as session:` or session.start()")
        return self.sampler

    def replan(self, batch_plan: BatchPlan, rank: int | None = None, idle: bool = False) -> None:
        """A new batch plan (and rank); the next step starts over from the committed position. ``idle``: this rank
        takes no sample of the steps (the plan's ranks are the others)."""
        sampler = self.require_sampler()
        sampler.plan = batch_plan
        if rank is not None:
            sampler.rank = rank
        self.idle = idle
        self.reset()

    def reset(self) -> None:
        """Drop the loader (its workers stop): the next step starts at the sampler's committed position."""
        self._loader = self._steps = self._batches = None

    def next(self) -> tuple[RankStep, list[Any]]:
        """The next step's plan for this rank and its micro-batches' data, on the device."""
        sampler = self.require_sampler()
        if self.idle:  # the step's range, to commit as the others do; no loader, no data
            planned = next(sampler.steps(sampler.position))
            return dataclasses.replace(planned, micro_batches=()), []
        rank_step = next(self._steps, None) if self._steps is not None else None
        if rank_step is None:
            # A new epoch (or the first step): the loader and the step plan start from the same committed position.
            self._loader = DataLoader(
                self.dataset,
                batch_sampler=sampler,
                collate_fn=self.config.collate_fn,
                num_workers=self.config.num_workers,
                pin_memory=self.config.pin_memory,
            )
            self._steps = sampler.steps(sampler.position)
            self._batches = iter(self._loader)
            rank_step = next(self._steps)
        if self._batches is None:
            raise SessionError("internal: no batch iterator")
        datas = [next(self._batches) for _ in rank_step.micro_batches]
        if self.device.type != "cpu":
            non_blocking = self.config.pin_memory and self.device.type == "cuda"
            datas = [move_to(d, self.device, non_blocking) for d in datas]
        return rank_step, datas

    def loss_scales(
        self, rank_step: RankStep, datas: list[Any], world_size: int, all_reduce: Callable[[torch.Tensor], None] | None
    ) -> list[float]:
        """Each micro-batch's loss scale: its share of the global batch's samples, or of its tokens with
        ``token_count`` (summed over the ranks by ``all_reduce``; ``None``: one process)."""
        token_count = self.config.token_count
        if token_count is None:
            return [loss_scale(len(idx), world_size, rank_step.global_size) for idx in rank_step.micro_batches]
        counts = [int(token_count(d)) for d in datas]
        total = torch.tensor([sum(counts)], dtype=torch.int64, device=self.device)
        if all_reduce is not None:
            all_reduce(total)
        return [loss_scale(c, world_size, int(total.item())) for c in counts]
