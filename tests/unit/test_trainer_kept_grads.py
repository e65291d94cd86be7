"""What a rank keeps of a step lost mid-way (elastrain.integrations.trainer.kept_grads): the bookkeeping alone, on a
real model's gradients, with the few Trainer attributes it reads (the runs: tests/e2e/test_trainer_preemption.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from elastrain.integrations.trainer.kept_grads import KeptWork
from elastrain.integrations.trainer.memory import DataPosition
from elastrain.integrations.trainer.stream import StreamBatches
from elastrain.scaling import ScalingConfig, plan

STEP, CURSOR, GLOBAL = 5, 60, 12
PLAN = plan(ScalingConfig(global_batch=GLOBAL, micro_batch=2), 3)


class Trainer(SimpleNamespace):
    """A Trainer's stand-in (elastrain refers to a Trainer weakly: a plain namespace cannot be)."""


def rank_zero_of_three() -> tuple[KeptWork, Any, torch.nn.Module]:
    model = torch.nn.Linear(3, 1)
    p = PLAN  # rank 0: positions 0-1, then 2-3
    trainer = Trainer(
        model=model,
        state=SimpleNamespace(global_step=STEP),
        accelerator=SimpleNamespace(gradient_state=SimpleNamespace(sync_gradients=False), num_processes=3),
        args=SimpleNamespace(n_gpu=0, fp16=False, average_tokens_across_devices=True),
        model_accepts_loss_kwargs=True,
        compute_loss_func=None,
        loss_is_scaled_for_ga=None,
        current_gradient_accumulation_steps=2,
    )
    loader: Any = SimpleNamespace(sampler=StreamBatches(100, p, 0, CURSOR, 9, 0), start_step=STEP, first_step=None)
    return KeptWork(trainer, loader), trainer, model


def micro_batch(work: KeptWork, trainer: Any, model: torch.nn.Module, sync: bool, end: str = "done") -> None:
    """One micro-batch's training_step: ``end`` "done", or stopped in its "forward" or "backward"."""
    trainer.accelerator.gradient_state.sync_gradients = sync
    work.starting(torch.tensor(24.0))
    if end == "forward":
        return
    loss = model(torch.ones(2, 3)).sum()
    work.computed(loss)
    loss.backward()
    if end == "done":
        work.finished(loss.detach())


def position() -> DataPosition:
    return DataPosition(step=STEP, cursor=CURSOR, global_batch=GLOBAL)


def test_the_micro_batches_finished_before_a_stopped_forward_are_kept() -> None:
    work, trainer, model = rank_zero_of_three()
    micro_batch(work, trainer, model, sync=False)
    micro_batch(work, trainer, model, sync=True, end="forward")
    work.keep(position())
    kept = work._kept
    assert kept is not None and kept.offer.offsets == (0, 1) and kept.offer.cursor == CURSOR
    assert kept.grads[0] is model.weight.grad


def test_nothing_is_kept_when_a_backward_touched_the_gradients_after_them() -> None:
    work, trainer, model = rank_zero_of_three()
    micro_batch(work, trainer, model, sync=False)
    micro_batch(work, trainer, model, sync=True, end="backward")  # the sync backward stopped part-way
    work.keep(position())
    assert work._kept is None


def test_the_whole_share_is_kept_when_every_bucket_went_out_and_none_came_back() -> None:
    work, trainer, model = rank_zero_of_three()
    micro_batch(work, trainer, model, sync=False)
    micro_batch(work, trainer, model, sync=True, end="backward")
    work.watch.usable, work.watch.last_launched = True, True
    work.keep(position())
    assert work._kept is not None and work._kept.offer.offsets == (0, 1, 2, 3)
    work.watch.reduced = True  # a bucket's all-reduce completed: DDP wrote the average back
    work.keep(position())
    assert work._kept is None


def test_a_step_with_a_micro_batch_not_from_the_stream_keeps_nothing() -> None:
    work, trainer, model = rank_zero_of_three()
    four = StreamBatches(100, plan(ScalingConfig(global_batch=GLOBAL, micro_batch=1), 3), 0, CURSOR, 9, 0)
    work.loader.sampler = None
    micro_batch(work, trainer, model, sync=False)  # its gradients are in .grad, its samples unknown
    work.loader.sampler = four
    micro_batch(work, trainer, model, sync=False)
    micro_batch(work, trainer, model, sync=False)
    micro_batch(work, trainer, model, sync=True, end="forward")
    work.keep(position())
    assert work._kept is None


def test_a_finished_step_keeps_nothing_and_fp16_keeps_nothing() -> None:
    work, trainer, model = rank_zero_of_three()
    micro_batch(work, trainer, model, sync=False)
    micro_batch(work, trainer, model, sync=True)
    work.keep(position())
    assert work._kept is None
    work, trainer, model = rank_zero_of_three()
    trainer.args.fp16 = True
    micro_batch(work, trainer, model, sync=False)
    work.keep(position())
    assert work._kept is None
