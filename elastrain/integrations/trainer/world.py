"""A Trainer worker's side of the round it trains in (live mode): joining, agreeing the state, moving on.

Between two ``Trainer.train()`` calls the worker leaves its world (the DDP wrapper, accelerate's wrappers
and its view of the world are dropped; the model, the optimizer's state, the scheduler's, the Trainer's
progress and the data position are kept, :class:`~elastrain.integrations.trainer.memory.Held`), moves its
process group to the agent's next round, makes accelerate see the new world, and agrees with the round's
members on the newest step every one of them holds (:mod:`elastrain.live.agreement`): one member sends it
to the members with none (joiners, restarted workers) and to those a step ahead
(:func:`elastrain.live.transfer.send_state`). No member holding state: the round loads the newest
committed checkpoint instead (the driver's restore).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
import weakref
from typing import Any

import torch.distributed as dist

from elastrain.collective_failure import is_collective_failure
from elastrain.control import RegroupNotice
from elastrain.env import WorkerEnv
from elastrain.errors import EX_CONFIG
from elastrain.integrations.trainer.collection import MoveCollection
from elastrain.integrations.trainer.forward_stop import forward_stops
from elastrain.integrations.trainer.membership import TrainerMembership, backend_for
from elastrain.integrations.trainer.memory import Held
from elastrain.integrations.trainer.weak_trainer import WeakTrainer
from elastrain.live import heap
from elastrain.live.agreement import Ballot, vote
from elastrain.live.group import is_compiled
from elastrain.live.receive_pool import ReceivePool
from elastrain.live.transfer import send_state
from elastrain.log import lifecycle


class TrainerWorld:
    """One Trainer's live membership: the process's round and group, and the state it keeps or receives."""

    trainer = WeakTrainer()

    def __init__(self, trainer: Any, membership: TrainerMembership, held: Held) -> None:
        self.trainer = trainer
        self.membership = membership
        self.held = held
        self._pool: ReceivePool | None = None
        self._alone_told = False
        self.collection = MoveCollection()
        """The collections at a move: the driver says when the next world's model is wrapped."""

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def backend(self) -> str:
        return backend_for(self.trainer.args)

    def join(self, first: bool, receive: bool = True) -> WorkerEnv:
        """Join this worker's round (a warm worker waits for its first one here); accelerate then sees it, made
        again over the round's group if the worker set up as one process (every worker before its first round).
        ``receive``: a warm worker makes memory ready for the state it may receive (not for an evaluation)."""
        m = self.membership
        provisional = not m.joined
        backend = self.backend
        compiles = bool(self.trainer.args.torch_compile) or is_compiled(self.trainer.model)
        m.join(backend, prepare=self._prepare_to_receive if backend == "gloo" and receive else None, compiles=compiles)
        if provisional or not first:
            self.reset_devices()
        return m.require().env

    def before_loop(self, loop: str) -> WorkerEnv | None:
        """``evaluate()`` or ``predict()`` (``loop``) before the first ``train()``, set up as one process: in the job's
        first round, whose members all run the script from the top, join the round (the new environment), so that
        the loop runs over it as under torchrun (sharded, one writer). A warm worker waits here to know
        (:meth:`TrainerMembership.in_first_round`). A worker that joins a job that trains on runs
        the loop alone (None): the members it joins are in ``train()`` and never run it."""
        m = self.membership
        if m.joined:
            return None
        if m.in_first_round(self.backend):
            return self.join(first=True, receive=False)
        if not self._alone_told:
            self._alone_told = True
            lifecycle("trainer_loop_alone", loop=loop, why="before train(), in a job that trains on: as one process")
        return None

    def _prepare_to_receive(self) -> ReceivePool:
        """A warm worker, before it waits: memory for the optimizer state it will receive, being touched (the
        optimizer itself is made when the state arrives, as the Trainer would make it), and the heap its first steps
        allocate from (:mod:`elastrain.live.heap`)."""
        t = self.trainer
        if t.optimizer is not None:
            self._pool = ReceivePool.for_optimizer(unwrapped(t.optimizer))
        else:
            optimizer_class, _ = t.get_optimizer_cls_and_kwargs(t.args, t.model)
            self._pool = ReceivePool.for_parameters(list(t.model.parameters()), optimizer_class)
        heap.grow_for(t.model.parameters())  # meanwhile, on this thread: what its first steps allocate from
        return self._pool

    def reset_devices(self) -> None:
        """accelerate's view of the world, made again for the current process group (rank, size, device)."""
        t = self.trainer
        args = t.args
        vars(args).pop("_setup_devices", None)  # transformers caches it (functools.cached_property)
        args.distributed_state = None
        _ = args.device  # a PartialState over the current group
        t.create_accelerator_and_postprocess()
        # What the callbacks read (who prints and reports): set when the Trainer was built, as one process.
        t.state.is_local_process_zero = t.is_local_process_zero()
        t.state.is_world_process_zero = t.is_world_process_zero()

    def agree_state(self) -> int | None:
        """Collective: the members' agreed state in this worker's memory; its step, or None when no member holds
        any (the world loads the newest committed checkpoint)."""
        t, held = self.trainer, self.held
        step = int(t.state.global_step) if held.holds_state else 0
        device = t.args.device
        mine = self.membership.trainings  # which of the script's train() calls (it may train one model, then another)
        agreement = vote(Ballot(held.holds_state, step, training=mine), device)
        if agreement.training and mine and agreement.training != mine:
            _another_training(t.args.output_dir, mine, agreement.training)
        pool, self._pool = self._pool, None
        if agreement.from_checkpoint:
            if pool is not None:
                pool.close()  # before the checkpoint's state takes its place in memory
            return None
        source = int(agreement.source or 0)
        if t.optimizer is None:
            t.create_optimizer()  # a new member: an optimizer to receive the state into
        held.progress.track(t.state, t.callback_handler.callbacks)
        if held.holds_state:
            held.position.rebase(step)
        started = time.monotonic()
        sent = send_state(  # whole before the step: the Trainer's optimizer steps inside train()
            source,
            t.model,
            unwrapped(t.optimizer),
            {"progress": held.progress, "scheduler": held.scheduler, "data": held.position, "stream": held.stream},
            device,
            receivers=agreement.ahead + agreement.receivers,
            pool=pool,
            helpers=agreement.holders(dist.get_world_size()),
        ).sent
        if self.rank == source:
            held.progress.snapshot()
            held.scheduler.snapshot()
        held.memory_resume = held.holds_state = True
        lifecycle(
            "trainer_state_agreed",
            rank=self.rank,
            step=agreement.step,
            source=source,
            receivers=len(agreement.receivers),
            rolled_back=",".join(map(str, agreement.ahead)) or None,
            bytes=sent,
            took_s=round(time.monotonic() - started, 3),
        )
        return agreement.step if agreement.step is not None else step  # None only with no source

    def forward_stops(self) -> contextlib.AbstractContextManager[None]:
        """While ``train()`` runs: the forward pass of a step lost to a broken round stops at its next block
        (:mod:`~elastrain.integrations.trainer.forward_stop`; not under ``torch.compile``)."""
        member = self.membership.member
        if member is None or self.trainer.args.torch_compile:
            return contextlib.nullcontext()
        return forward_stops(self.trainer.model, member.group.broken.is_set)

    def broken_by(self, exc: BaseException) -> bool:
        """Whether ``exc`` is this world breaking (a collective failed for want of a peer): a regroup, not a crash."""
        member = self.membership.member
        return member is not None and (member.group.broken.is_set() or is_collective_failure(exc))

    def notice_for(self, cause: BaseException | None) -> RegroupNotice:
        """The agent's notice of the next round: at hand, or awaited (bounded) after a collective broke. Without
        one, ``cause`` is re-raised: no regroup can help."""
        member = self.membership.require()
        timeout = member.env.regroup_timeout_s
        notice = member.pending_notice()
        if notice is None and cause is not None:
            member.report_broken()  # the agent probes its peers at once
            notice = member.wait_notice(member.round, timeout)
        if notice is None:
            lifecycle("regroup_notice_missing", level=logging.WARNING, waited_s=timeout, error=repr(cause)[:200])
            if cause is not None:
                raise cause
            raise RuntimeError("internal: left train() for a regroup without a notice")
        lifecycle(
            "regroup_started",
            round=f"{member.round}->{notice.round}",
            step=self.trainer.state.global_step,
            cause=type(cause).__name__ if cause is not None else "notice",
            state="dropped: the job trained on without this node" if notice.superseded else "kept",
        )
        return notice

    def next_notice(self, failed: RegroupNotice) -> RegroupNotice | None:
        """After a member of ``failed``'s round failed too: the round after it, if the agent announces one."""
        member = self.membership.require()
        return member.wait_notice(failed.round, member.env.regroup_timeout_s)

    def move_to(self, notice: RegroupNotice) -> WorkerEnv:
        return self.membership.require().move_to(notice)

    def leave(self, kept: bool) -> None:
        """Drop what belongs to the current group (the DDP wrapper, accelerate's wrappers); keep the state
        (``kept``), or forget it (this node was left behind: the job trained on without it)."""
        t, held = self.trainer, self.held
        if kept and held.holds_state:
            held.progress.track(t.state, t.callback_handler.callbacks)
            held.progress.snapshot()
            held.scheduler.target = t.lr_scheduler
            held.scheduler.snapshot()
        else:
            held.holds_state = False
        t.optimizer = unwrapped(t.optimizer)
        if t.optimizer is not None:
            t.optimizer.zero_grad(set_to_none=True)
        t.model.zero_grad(set_to_none=True)
        wrapper = weakref.ref(t.model_wrapped) if t.model_wrapped is not t.model else None
        t.model_wrapped = t.model
        if t._created_lr_scheduler:
            t.lr_scheduler = None  # the Trainer makes its own again, whose state the kept one replaces
        # The old DDP wrapper's reducer (and its autograd hooks) must be gone before a backward.
        self.collection.leave(t.accelerator, wrapper)


def unwrapped(optimizer: Any) -> Any:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (itself if not wrapped)."""
    from accelerate.optimizer import AcceleratedOptimizer

    return optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer


def _another_training(output_dir: str, mine: int, theirs: int) -> None:
    """This worker's ``train()`` is not the one its world is in: the script trains one model after another and this
    worker, which joined the job (and so ran the script from the top), is at another one. It cannot take their state,
    nor they its: its node leaves (EX_CONFIG: no restart can help; the others train on without it)."""
    lifecycle(
        "trainer_other_training",
        level=logging.ERROR,
        output_dir=output_dir,
        train_call=mine,
        job_train_call=theirs,
        why="the job is in another of the script's train() calls: this node leaves",
    )
    sys.stderr.write(
        f"elastrain-run: this node joined a job that is in the script's train() call {theirs}, this worker in its "
        f"call {mine} (output_dir {output_dir}): a script that trains one model after another takes joining nodes "
        "only with --live false\n"
    )
    sys.stderr.flush()
    raise SystemExit(EX_CONFIG)
