"""A survivor's finished micro-batches of a step lost to a SIGKILL: kept in memory, not computed again (live mode).

While a step runs, each micro-batch's samples (positions in the step's global batch) and loss are noted as it
finishes, with a fingerprint of the gradients it left (each ``.grad``'s identity and version). When the world breaks,
the regroup keeps the rank's own gradients of the step when they are intact:

- the micro-batches finished before the sync one, if nothing touched ``.grad`` since the last of them finished (the
  forward of the next stopped at a block, or its backward never began; one stopped half-way changed a version);
- all of them, the sync one too, when its backward handed every gradient bucket to the all-reduce and no bucket's
  all-reduce completed (the peer died before it: DDP writes nothing back into ``.grad``, :class:`BucketWatch`). A
  backward that meets the broken round runs to its end for this (each bucket's all-reduce fails at once), rather
  than stopping at its next bucket: its work is kept, not lost.

Entering the next world, after the members agreed on the state, every member says what it kept (one all-gather of a
few integers); those whose model is the agreed one and whose kept step is the one the world trains next keep theirs,
and the world splits that step so that each keeper's first micro-batch is its kept samples
(:mod:`~elastrain.integrations.trainer.kept_split`). That micro-batch's ``training_step`` puts the kept gradients
back, rescaled for the new world's loss scaling, and returns their loss: its forward and backward are not run again.
Every other member, and every later step, runs as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket
from torch.nn.parallel import DistributedDataParallel

from elastrain.integrations.trainer.dataloader import StreamLoader
from elastrain.integrations.trainer.kept_split import LossScale, Offer, StepSplit, rescale, split_step
from elastrain.integrations.trainer.memory import DataPosition
from elastrain.integrations.trainer.weak_trainer import WeakTrainer
from elastrain.live.group import GroupBrokenError, TrainingGroup
from elastrain.log import lifecycle
from elastrain.scaling import BatchPlan
from elastrain.step_flags import StepFlags


@dataclass
class Kept:
    """The gradients of a lost step's finished micro-batches, and what the new world needs to count them."""

    offer: Offer
    grads: list[torch.Tensor | None]
    loss: torch.Tensor
    scale: LossScale


def loss_scale(trainer: Any, num_items: Any) -> LossScale:
    """What ``Trainer.training_step`` does to a micro-batch's loss in the current world (transformers 5.23's rule)."""
    takes_items = num_items is not None and bool(trainer.model_accepts_loss_kwargs or trainer.compute_loss_func)
    scaled = trainer.loss_is_scaled_for_ga
    if scaled is None:
        scaled = (trainer.model_accepts_loss_kwargs and num_items is not None) or trainer.compute_loss_func is not None
    multiplied = takes_items and trainer.args.average_tokens_across_devices
    return LossScale(
        items=float(num_items) if takes_items else None,
        world=int(trainer.accelerator.num_processes) if multiplied else None,
        accumulation=None if scaled else int(trainer.current_gradient_accumulation_steps),
    )


def _marks(params: list[torch.Tensor]) -> list[tuple[int, int]]:
    return [(id(p.grad), p.grad._version) if p.grad is not None else (0, 0) for p in params]


class BucketWatch:
    """What the step's gradient sync did: whether its last bucket went to the all-reduce (the backward accumulated
    every gradient), and whether any bucket's all-reduce completed (DDP then writes the average into ``.grad``, in
    bucket order, and stops at the first that failed)."""

    def __init__(self) -> None:
        self.usable = False
        """DDP keeps ``.grad`` apart from its buckets (``gradient_as_bucket_view`` off, accelerate's default): a
        failed all-reduce leaves this rank's own gradients in ``.grad``."""
        self.last_launched = False
        self.reduced = False

    def attach(self, model: torch.nn.Module) -> None:
        self.usable = isinstance(model, DistributedDataParallel) and not model.gradient_as_bucket_view

    def reset(self) -> None:
        self.last_launched = self.reduced = False

    def hook(self, group: TrainingGroup, flags: StepFlags) -> Callable[[object, GradBucket], Any]:
        """DDP's comm hook for the live group (:meth:`TrainingGroup.comm_hook`, the step flags on its last bucket),
        each bucket seen. Once the round is broken, where ``.grad`` stays this rank's own, a bucket gets a failed
        future rather than stopping the backward: the backward accumulates this rank's whole gradient of the step,
        which the regroup keeps, and DDP raises the failure at its end."""

        # A lambda: DDP reads a comm hook's annotations, and the module's are strings.
        return lambda state, bucket: self._sync(group, flags, state, bucket)

    def _sync(self, group: TrainingGroup, flags: StepFlags, state: object, bucket: GradBucket) -> Any:
        try:
            fut = group.comm_hook(state, bucket, flags)
        except GroupBrokenError as exc:
            if not self.usable:
                raise
            failed: torch.futures.Future[Any] = torch.futures.Future()
            failed.set_exception(exc)
            fut = failed
        return self.launched(bucket, fut)

    def launched(self, bucket: GradBucket, fut: torch.futures.Future[Any]) -> Any:
        """``bucket`` went to the all-reduce as ``fut`` (failed at once when the round is broken)."""
        if bucket.is_last():
            self.last_launched = True
        fut.add_done_callback(self._settled)
        return fut

    def _settled(self, fut: torch.futures.Future[Any]) -> None:
        try:
            fut.value()
        except Exception as exc:  # the round broke: DDP raises it from the backward; nothing written back for it
            lifecycle("trainer_bucket_unreduced", level=logging.DEBUG, error=repr(exc)[:120])
            return
        self.reduced = True

    @property
    def local_whole(self) -> bool:
        """``.grad`` holds this rank's whole gradient of the step, none of it averaged with the other ranks'."""
        return self.usable and self.last_launched and not self.reduced


class KeptWork:
    """One Trainer's finished micro-batches of the step in flight, kept across a broken world."""

    trainer = WeakTrainer()

    def __init__(self, trainer: Any, loader: StreamLoader) -> None:
        self.trainer = trainer
        self.loader = loader
        self.watch = BucketWatch()
        self._step = -1
        """The optimizer step the noted micro-batches belong to (``global_step`` before it)."""
        self._index = 0
        self._current: tuple[int, ...] | None = None
        """The positions of the micro-batch in ``training_step`` (None: not from the stream)."""
        self._sync = False
        self._open = False
        self._forward: torch.Tensor | None = None
        """The loss of the micro-batch in ``training_step``, once its forward pass returned it."""
        self._done: list[int] | None = []
        """The positions of the step's finished micro-batches (None: one was not from the stream)."""
        self._loss: torch.Tensor | None = None
        self._num_items: Any = None
        self._marks: list[tuple[int, int]] = []
        self._kept: Kept | None = None
        self._armed: Kept | None = None
        """The kept micro-batch is this world's next ``training_step`` (the split gave it to this rank)."""

    def _params(self) -> list[torch.Tensor]:
        return list(self.trainer.model.parameters())

    # -- while a world trains ----------------------------------------------------------------------
    def starting(self, num_items: Any) -> None:
        """Before a micro-batch's ``training_step``: which of the step's positions it holds."""
        t = self.trainer
        step = int(t.state.global_step)
        if step != self._step:
            self._step, self._index, self._done, self._loss = step, 0, [], None
        sampler = self.loader.sampler
        self._current = None
        if sampler is not None:
            offsets = sampler.step_offsets(step - self.loader.start_step)
            if self._index < len(offsets):
                self._current = offsets[self._index]
        self._sync = bool(t.accelerator.gradient_state.sync_gradients)
        self._num_items = num_items
        self._forward = None
        self._open = True
        self.watch.reset()
        self._index += 1

    def computed(self, loss: Any) -> None:
        """The micro-batch's forward pass returned ``loss`` (``Trainer.compute_loss``)."""
        if self._open and isinstance(loss, torch.Tensor):
            self._forward = loss.detach()

    def finished(self, loss: Any) -> None:
        """After a micro-batch's ``training_step`` returned ``loss``: its gradients are in ``.grad``, or, after the
        step's sync one, all-reduced (nothing of the step can be kept any more)."""
        self._open = False
        if self._sync:
            self._done, self._loss = [], None
            return
        if self._done is None:
            return  # a micro-batch of this step was not from the stream: its gradients are in .grad, unaccounted
        if self._current is None or not isinstance(loss, torch.Tensor):
            self._done, self._loss = None, None
            return
        self._done.extend(self._current)
        self._loss = loss.detach() if self._loss is None else self._loss + loss.detach()
        self._marks = _marks(self._params())

    def restored(self, num_items: Any) -> torch.Tensor | None:
        """In the world's first step: when this ``training_step`` is the kept micro-batch, its gradients put back
        (rescaled for this world) and its loss, instead of a forward and backward; else None."""
        kept, self._armed = self._armed, None
        if kept is None:
            return None
        ratio = rescale(kept.scale, loss_scale(self.trainer, num_items))
        for p, g in zip(self._params(), kept.grads, strict=True):
            if g is None:
                continue
            if ratio != 1.0:
                g.mul_(ratio)
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)
        self.starting(num_items)  # the sampler's first micro-batch of this step: the kept samples
        return kept.loss * ratio

    # -- across a regroup --------------------------------------------------------------------------
    def keep(self, position: DataPosition) -> None:
        """The world broke (a peer died in the step): keep the gradients of the step's finished micro-batches if they
        are intact, before the leave drops every ``.grad``. Intact: the sync micro-batch's backward accumulated every
        gradient and no bucket's all-reduce completed (its all-reduce met the dead peer); or nothing touched them since
        the last no-sync micro-batch finished (the next one's forward stopped, or its backward never began)."""
        t = self.trainer
        self._kept = self._armed = None
        params = self._params()
        if self._done is None or self._step != int(t.state.global_step) or t.args.n_gpu > 1 or t.args.fp16:
            return  # fp16: the gradients carry the loss scaler's scale, which a new world's scaler may not have
        scale = loss_scale(t, self._num_items)
        offsets, loss = list(self._done), self._loss
        whole = self._open and self._sync and self.watch.local_whole
        if whole and self._current is not None and self._forward is not None:
            offsets.extend(self._current)
            last = self._forward / scale.accumulation if scale.accumulation else self._forward
            loss = last if loss is None else loss + last
        elif offsets and _marks(params) != self._marks:
            self._dropped(offsets, "a backward (or its gradient sync) stopped part-way after them")
            return
        if not offsets or loss is None:
            return
        offer = Offer(self._step, position.cursor_at(self._step), position.global_batch, tuple(offsets))
        self._kept = Kept(offer, [p.grad for p in params], loss, scale)
        lifecycle("trainer_micro_batches_kept", step=self._step + 1, samples=len(offsets), micro_batches=self._index)

    def _dropped(self, offsets: list[int], why: str) -> None:
        if offsets:
            lifecycle("trainer_micro_batches_dropped", step=self._step + 1, samples=len(offsets), why=why)

    def drop(self) -> None:
        self._kept = self._armed = None
        self.loader.first_step = None

    def agree(self, own_step: int, agreed_step: int, position: DataPosition, plan: BatchPlan, device: Any) -> None:
        """Collective, on every member entering a world that goes on from memory: the split of the world's next
        step, from what every member kept of it. Sets this rank's first step in the loader, and whether its first
        ``training_step`` is its kept micro-batch."""
        kept, self._armed = self._kept, None
        offer = kept.offer if kept is not None and own_step == agreed_step else None
        split = _exchange(offer, agreed_step, position, plan, device)
        self._kept = None  # kept until now: another regroup, if this world fails first, may use it
        rank = dist.get_rank()
        self.loader.first_step = split.micro_batches[rank] if split is not None else None
        if split is not None and split.kept[rank]:
            self._armed = kept
        if split is not None and rank == 0:
            lifecycle(
                "trainer_lost_step_kept",
                step=agreed_step + 1,
                members=sum(split.kept),
                samples=f"{split.kept_samples}/{position.global_batch}",
            )


def _exchange(offer: Offer | None, step: int, position: DataPosition, plan: BatchPlan, device: Any) -> StepSplit | None:
    """Every member's offer, gathered (collective), and the split they give."""
    size = position.global_batch
    mine = torch.full((5 + size,), -1, dtype=torch.int64, device=device)
    if offer is not None and len(offer.offsets) <= size:
        head = [1, offer.step, offer.cursor, offer.global_batch, len(offer.offsets)]
        mine[: 5 + len(offer.offsets)] = torch.tensor(head + list(offer.offsets), dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    offers: list[Offer | None] = []
    for row in (g.tolist() for g in gathered):
        if row[0] != 1:
            offers.append(None)
            continue
        n = max(0, min(int(row[4]), size))
        offers.append(Offer(int(row[1]), int(row[2]), int(row[3]), tuple(int(o) for o in row[5 : 5 + n])))
    if not any(offers):
        return None
    split = split_step(offers, step, position.cursor, size, plan.micro_batch, plan.accumulation)
    if split is None:
        lifecycle("trainer_lost_step_recomputed", level=logging.INFO, step=step + 1, why="no split fits the batch plan")
    return split
