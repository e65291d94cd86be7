"""One optimizer step of the session's loop: its micro-batches, the scaled backward, the commit."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch.nn.parallel import DistributedDataParallel

from elastrain.data import RankStep
from elastrain.live.group import GroupBrokenError
from elastrain.log import lifecycle
from elastrain.session.errors import SessionError
from elastrain.train_state import TrainState

LOSS_TOTAL = "loss"  # the step flags' total that carries the step's loss (StepFlags.add_total)


def move_to(data: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """``data`` with every tensor inside (dicts, lists, tuples) moved to ``device``."""
    if isinstance(data, torch.Tensor):
        return data.to(device, non_blocking=non_blocking)
    if isinstance(data, Mapping):
        moved_map = {k: move_to(v, device, non_blocking) for k, v in data.items()}
        try:
            return type(data)(moved_map)  # type: ignore[call-arg]
        except TypeError:  # a mapping type that cannot be built from a dict (defaultdict)
            return moved_map
    if isinstance(data, (list, tuple)):
        moved = [move_to(v, device, non_blocking) for v in data]
        return type(data)(moved) if not hasattr(data, "_fields") else type(data)(*moved)
    return data


class MicroBatch:
    """One forward/backward pass worth of this rank's data."""

    def __init__(self, data: Any, indices: Sequence[int], loss_scale: float) -> None:
        self.data = data
        self.indices = list(indices)
        """Dataset indices in this micro-batch."""
        self.loss_scale = loss_scale
        """Multiply the micro-batch's *mean* loss by this before ``backward`` (``Step.backward`` does)."""

    @property
    def size(self) -> int:
        return len(self.indices)


class StepHost(Protocol):
    """What a :class:`Step` needs from the loop that runs it (:class:`elastrain.session.Session` is one)."""

    @property
    def state(self) -> TrainState:
        """The train state; ``state.step`` is the last committed step."""

    @property
    def model(self) -> torch.nn.Module:
        """The model the loop calls (DDP-wrapped when distributed), looked up anew at each micro-batch."""

    @property
    def device(self) -> torch.device: ...

    @property
    def world_size(self) -> int: ...

    @property
    def distributed(self) -> bool: ...

    @property
    def segment(self) -> str:
        """The current world's segment: a step's world is gone when it changed."""

    def agreed_total(self, name: str) -> float | None:
        """The sum over all ranks of a total this step's gradient sync carried; ``None`` when none did."""

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """A sum over the current group; ``GroupBrokenError`` when the group broke (live mode)."""

    def collective_broke(self, exc: BaseException, step: Step | None, group_error: bool) -> None:
        """A collective failed: regroup (giving ``step`` up) or raise ``exc``."""

    def sit_out(self, step: Step) -> None:
        """A step without micro-batches on this rank: its part of the step's gradient sync (zeros), if it sits the
        step out; nothing otherwise."""

    def finish_step(self, step: Step) -> None:
        """Apply the optimizer and commit ``step``."""

    def log(self, step: int, **values: Any) -> None:
        """Record metrics at global step ``step``."""


class Step:
    """One optimizer step: iterate it for the micro-batches, then call :meth:`optimizer_step`."""

    def __init__(self, session: StepHost, rank_step: RankStep, micro: list[MicroBatch], lr: float | None) -> None:
        self._session = session
        self.rank_step = rank_step
        self.micro_batches = micro
        self.number = session.state.step + 1
        """The global step number this step gets once done (1-based, continuous across restarts)."""
        self.epoch = rank_step.range.start.epoch
        self.lr = lr
        """The learning rate of the first parameter group for this step (None: the session leaves LR alone)."""
        self.global_size = rank_step.global_size
        # The ranks that compute it (a regroup may come after its gradient sync): its plan's, which are the world's
        # but in a world's first step that new members sit out (elastrain.session.catch_up).
        self._world_size, self._segment = rank_step.world_size, session.segment
        self.loss_sum: torch.Tensor | float = 0.0
        """This rank's loss so far: the sum of its micro-batches' scaled losses (float64, on the device)."""
        self._loss_lost = False
        self._sat_out = False
        self._done = False
        self.abandoned = False
        """True when a membership change (live mode) gave this step up: the loop's remaining calls are no-ops."""

    def __iter__(self) -> Iterator[MicroBatch]:
        last = len(self.micro_batches) - 1
        for i, mb in enumerate(self.micro_batches):
            if self.abandoned:
                return
            # Gradients are all-reduced once per step, on the last micro-batch's backward. The model is
            # looked up each time, never held: a regroup replaces the DDP wrapper during the step.
            with self._sync_context(sync=i == last):
                yield mb
        self._sit_out()

    def _sit_out(self) -> None:
        """A rank with no micro-batches joins the step's gradient sync once (it sits the step out)."""
        if self.micro_batches or self._sat_out or self.abandoned:
            return
        self._sat_out = True
        self._session.sit_out(self)

    @property
    def done(self) -> bool:
        """Whether :meth:`optimizer_step` was called."""
        return self._done

    def _sync_context(self, sync: bool) -> contextlib.AbstractContextManager[Any]:
        model = self._session.model
        if sync or not isinstance(model, DistributedDataParallel):
            return contextlib.nullcontext()
        return model.no_sync()

    def backward(self, loss: torch.Tensor, mb: MicroBatch) -> None:
        """``(loss × mb.loss_scale).backward()`` for a loss that is the mean over ``mb``'s samples (or tokens)."""
        if self.abandoned:
            return
        scaled = loss * mb.loss_scale
        self.loss_sum = self.loss_sum + scaled.detach().to(torch.float64)  # no device sync per micro-batch
        try:
            scaled.backward()  # type: ignore[no-untyped-call]
        except (GroupBrokenError, RuntimeError) as exc:  # GroupBrokenError: the live comm hook's, round over
            self._session.collective_broke(exc, self, group_error=True)

    def mean_loss(self) -> float:
        """The step's loss averaged over all its samples on all ranks (call it on every rank).

        Its sum usually rode on the step's gradient sync (:meth:`StepFlags.add_total`): then no collective is
        made here, and a peer lost after the step cannot take the value with it. Otherwise (no such sync, or a
        half-precision one) it is an all-reduce of its own."""
        if self.abandoned or self._loss_lost:
            return math.nan
        session = self._session
        agreed = session.agreed_total(LOSS_TOTAL)
        if agreed is not None:
            return agreed / self._world_size
        if session.segment != self._segment:  # a regroup after the step: its ranks' shares are in no group now
            return self._loss_is_lost()
        # On the model's device: nccl reduces CUDA tensors only.
        total = torch.as_tensor(self.loss_sum, dtype=torch.float64, device=session.device).reshape(1)
        if session.distributed:
            try:
                session.all_reduce(total)
            except GroupBrokenError as exc:
                # Before optimizer_step() the step is given up; after it, the vote decides whether it stands.
                session.collective_broke(exc, None if self._done else self, group_error=True)
                self._rolled_back()
                return self._loss_is_lost()
        return float(total.item()) / self._world_size

    def _loss_is_lost(self) -> float:
        """NaN; a step that stands (not given up) logs no metrics, and says so."""
        if not self.abandoned:
            self._loss_lost = True
            lifecycle(
                "step_loss_lost",
                level=logging.WARNING,
                step=self.number,
                why="a member left before the step's mean loss was summed; the step's metrics are not logged",
            )
        return math.nan

    def optimizer_step(self) -> None:
        """Apply the optimizer, clear gradients, and commit the step (data cursor, state, checkpoint)."""
        if self._done:
            raise SessionError(f"optimizer_step() called twice for step {self.number}")
        self._sit_out()  # a loop that never iterated the step
        self._done = True
        if not self.abandoned:
            self._session.finish_step(self)
            self._rolled_back()

    def _rolled_back(self) -> None:
        """After a regroup inside this step's commit: if the world agreed on an earlier step, this one runs
        again, so it is given up here (its metrics are the re-run's to log)."""
        if self._done and self._session.state.step < self.number:
            self.abandoned = True

    def log(self, **values: Any) -> None:
        """Record metrics at this step's global number (rank 0 writes; tensors become floats)."""
        if not (self.abandoned or self._loss_lost):
            self._session.log(self.number, **values)
