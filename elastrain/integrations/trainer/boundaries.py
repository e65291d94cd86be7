"""The step flags of a Trainer's steps: carried by the gradient sync, agreed by every rank, and the live
regroup they call for, taken at the next step boundary.

Under DDP the flags ride on the gradient sync's comm hook (the live member's group, or an all-reduce in
restart mode); with one rank or no DDP they are agreed by an all-reduce after the step. Before a step's first
forward, a regroup every rank agreed to (or one a broken world needs) leaves ``Trainer.train`` by
:class:`RegroupNow`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from elastrain.control import RegroupNotice
from elastrain.integrations.trainer.kept_grads import BucketWatch
from elastrain.integrations.trainer.membership import TrainerMembership
from elastrain.integrations.trainer.weak_trainer import WeakTrainer
from elastrain.log import lifecycle
from elastrain.session.regroup import regroup_due
from elastrain.step_flags import StepFlags, flagged_allreduce


def ddp_of(model: Any) -> torch.nn.parallel.DistributedDataParallel | None:
    """The DDP module accelerate prepared: ``model`` itself, or what ``torch.compile`` wrapped (``--torch_compile``:
    accelerate compiles DDP's module; DDP's reducer, and so its comm hook, still runs each bucket's all-reduce)."""
    from accelerate.utils import is_compiled_module

    if is_compiled_module(model):
        model = model._orig_mod
    return model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None


class RegroupNow(Exception):
    """Raised at a step boundary to leave ``Trainer.train`` for the next round (caught by the driver)."""


class StepBoundaries:
    """Agrees one Trainer's step flags and decides, at each step boundary, whether to regroup now."""

    trainer = WeakTrainer()

    def __init__(self, trainer: Any, membership: TrainerMembership | None, flags: StepFlags, live_ok: bool) -> None:
        self.trainer = trainer
        self.membership = membership
        self.flags = flags
        self.live_ok = live_ok

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    def sync_on(self, model: Any, watch: BucketWatch) -> None:
        """After accelerate wrapped the model: the step flags ride on DDP's gradient sync; in live mode through
        ``watch`` (:class:`~elastrain.integrations.trainer.kept_grads.BucketWatch`), which sees each bucket."""
        model = ddp_of(model)
        if model is None:
            return
        flags = self.flags
        m = self.membership
        try:
            if m is not None and self.live_ok and m.member is not None:
                watch.attach(model)
                model.register_comm_hook(None, watch.hook(m.member.group, flags))
            else:
                hook = flagged_allreduce(flags)
                model.register_comm_hook(None, lambda state, bucket: hook(state, bucket))
        except RuntimeError as exc:  # the script registered its own comm hook: the flags agree by an all-reduce
            lifecycle("trainer_flags_own_sync", level=logging.WARNING, why=str(exc)[:200])

    def boundary(self) -> None:
        """Before a step's first forward: move to the next round now if every rank agreed to (or must)."""
        m = self.membership
        if m is None or not self.live_ok or m.member is None:
            return
        notice: RegroupNotice | None = m.member.pending_notice()
        if regroup_due(self.flags.agreed(), notice, self.world_size):
            raise RegroupNow()

    def agree_flags(self) -> None:
        """After a step: agree the flags by an all-reduce when no gradient sync carried them (one rank, no DDP)."""
        if not dist.is_initialized():
            return
        m = self.membership
        if m is not None and self.live_ok and m.member is not None:
            self.flags.agree(m.member.group.all_reduce, self.trainer.args.device)
            m.member.step_ended()  # the world's first step is over: --collective-timeout from here
        else:
            self.flags.agree(lambda t: dist.all_reduce(t), self.trainer.args.device)
