"""Entering and leaving a world: what a session's worker does when it joins a world's group, and before it goes.

A world is one process group and its members: the first one at a start, the next round's after a live
regroup (``elastrain-run --live true``). :class:`World` holds what is bound to it (the checkpointer,
rank 0's view of the launcher's save requests, the batch plan in force, the checkpoint restored, the
segment of the records) and is the one place that builds and drops them, in the same order on every member.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from elastrain import wire
from elastrain.checkpoint import Checkpointer, RestoreInfo
from elastrain.checkpoint.schedule import FINAL
from elastrain.control import SaveCause
from elastrain.data import ElasticSampler
from elastrain.env import WorkerEnv
from elastrain.errors import CheckpointSaveError, ElastrainError, StaleGenerationError
from elastrain.live.agreement import Ballot, vote
from elastrain.log import lifecycle
from elastrain.scaling import BatchPlan, plan
from elastrain.session.catch_up import CatchUp
from elastrain.session.config import SessionConfig
from elastrain.session.errors import SessionError
from elastrain.session.feed import Feed
from elastrain.session.handover import Handover
from elastrain.session.lr import LearningRate
from elastrain.session.records import Records
from elastrain.session.runtime import Runtime
from elastrain.step_flags import StepFlags
from elastrain.train_state import TrainState

GIVE_UP_SAVE_AFTER_S = 1.0
"""How long a live worker leaving a broken world waits for its save in flight: the save can no longer commit (a
member is gone), and gloo may hold one of its collectives until the I/O timeout (see ``Checkpointer.close``)."""


class World:
    """The world-bound parts of one session, built by :meth:`enter` and dropped by :meth:`leave`."""

    def __init__(
        self,
        config: SessionConfig,
        optimizer: torch.optim.Optimizer,
        runtime: Runtime,
        feed: Feed,
        records: Records,
        state: TrainState,
        flags: StepFlags,
        lr: LearningRate,
        extra_state: Mapping[str, Any],
        checkpoint_dir: str | None,
    ) -> None:
        self.config = config
        self.optimizer = optimizer
        self.runtime = runtime
        self.feed = feed
        self.records = records
        self.state = state
        self.flags = flags
        self.lr = lr
        self.extra_state = extra_state
        self.checkpoint_dir = checkpoint_dir
        self.checkpointer: Checkpointer | None = None
        self.plan: BatchPlan | None = None
        self.restored: RestoreInfo | None = None
        self.segment = ""
        self.handover = Handover()
        """This world's state transfer, whose optimizer state may still be on the wire (``settle()`` first)."""

    def enter(self, env: WorkerEnv, has_state: bool, started: float, regroup: bool) -> None:
        """Everything a worker does once it is in a world's group (a start, or a live ``regroup``): checkpointer,
        agreed state (``has_state``: this worker's counts), DDP, batch plan, records. Collective, in this order,
        on every member."""
        runtime = self.runtime
        runtime.refresh()
        rank, world_size = runtime.rank, runtime.world_size
        # Batch sizes do not depend on the LR reference, so the sampler is planned before the state arrives.
        first_plan = plan(self.config.scaling, world_size)
        if self.feed.sampler is None:
            sampler = self.feed.build(first_plan, rank)
        else:
            sampler = self.feed.require_sampler()
            self.feed.replan(first_plan, rank)
        sharded = runtime.sharded is not None
        runtime.shard(self.optimizer)  # a sharded model: this world's, before the checkpointer registers it
        self._build_checkpointer(env, sampler)
        held = self.state.step
        self.restored = None
        self.handover.reset()
        catch_up: CatchUp | None = None
        source: int | None = None
        agreed_step: int | None = None
        sent = 0
        ahead: tuple[int, ...] = ()
        stale: tuple[int, ...] = ()
        receivers = 0
        if runtime.live is None:
            self.restored = self._restore()
        else:
            # Sharded state never travels by broadcast: a member's shards die with it (the checkpoint holds all).
            ballot = Ballot(has_state and not sharded, held, self.state.world_size or 0)
            agreement = vote(ballot, runtime.device)
            source, agreed_step, ahead, stale = agreement.source, agreement.step, agreement.ahead, agreement.stale
            receivers = len(agreement.receivers)
            if agreement.from_checkpoint:
                self.handover.drop_pool()  # before the checkpoint's state takes its place in memory
                self.restored = self._restore()
                if sharded and has_state and self.restored is None:
                    # The module was rebuilt for this world: without a checkpoint its state is gone.
                    raise SessionError(
                        f"the sharded model's state at step {held} is lost: a member holding shards of it left "
                        "before any checkpoint was committed (save_every_steps= keeps what a departure costs small)"
                    )
            elif source is not None:
                statefuls = _statefuls(self.state, self.feed, self.extra_state)
                sent, catch_up = self.handover.start(agreement, runtime, self.optimizer, statefuls, env)
            self.handover.drop_pool()
        runtime.wrap(agree_saves=self.checkpointer is not None, in_sync=source is not None)
        runtime.catch_up = catch_up
        previous = self.state.world_size
        if catch_up is None:
            size, changed = world_size, self._plan_for(world_size, rank)  # from the agreed position
        else:  # the first step's workers: the holders alone, while the needy sit it out
            size, changed = catch_up.contributors, self._plan_for(catch_up.contributors, catch_up.index, catch_up.idle)
        self.segment = _agree_on_segment(runtime)
        restored_step = agreed_step if agreed_step is not None else (self.restored.step if self.restored else 0)
        self.records.reopen(rank, env, self.segment, restored_step, source if agreed_step is not None else None)
        if rank != 0:
            return
        if regroup:
            fields: dict[str, Any] = {
                "round": env.round,
                "world_size": f"{previous if previous is not None else 'none'}->{world_size}",
                "step": self.state.step,
                "source": source,
                "rolled_back": held - self.state.step if has_state and rank not in stale else 0,
                "ranks_ahead": ",".join(map(str, ahead)) or None,
                "ranks_stale": ",".join(map(str, stale)) or None,  # held a superseded world's state: dropped
                "receivers": receivers,
                "sitting_out": None if catch_up is None else world_size - catch_up.contributors,  # as state streams
                "bytes": sent,
                "checkpoint": self.restored.path if self.restored else None,  # no member held state (sharded)
                "took_s": round(time.monotonic() - started, 3),
            }
            lifecycle("regrouped", **fields)
            self.records.events.record("regroup", **fields)
        else:
            extra = {} if runtime.live is None else {"state_from": None if source is None else f"rank {source}"}
            self.records.record_start(env, world_size, self.restored, self.state, sampler, **extra)
        self._log_plan(previous, changed, size)

    def finish_catch_up(self) -> None:
        """At each step boundary of a catch-up (:mod:`elastrain.session.catch_up`): the transfer's next phase starts,
        and after its last step every member trains from here on, on the full world's plan. Nothing otherwise, or
        while its first step is not committed."""
        catch_up = self.runtime.catch_up
        self.handover.advance()  # the transfer's next phase, once the last one has landed (on every member)
        if catch_up is None or self.state.step < catch_up.after + catch_up.steps:
            return
        self.runtime.catch_up = None
        world_size, previous = self.runtime.world_size, self.state.world_size
        changed = self._plan_for(world_size, self.runtime.rank)
        if self.runtime.rank != 0:
            return
        sat_out = world_size - catch_up.contributors
        fields = {"step": self.state.step, "sat_out": sat_out, "steps": catch_up.steps, "world_size": world_size}
        lifecycle("caught_up", **fields)
        self.records.events.record("caught_up", **fields)
        self._log_plan(previous, changed, world_size)

    def _plan_for(self, size: int, rank: int, idle: bool = False) -> int | None:
        """The batch plan of ``size`` workers from the next step on (this rank's part of it: ``rank``; none when
        ``idle``), and the train state's start at that size: the previous size when it changed."""
        self.plan = plan(self.config.scaling, size, self.state.reference_world_size or self.runtime.world_size)
        self.feed.replan(self.plan, rank, idle=idle)
        return self.state.start(size, lr_scale=self.plan.lr_scale)

    def _restore(self) -> RestoreInfo | None:
        """The newest checkpoint that loads, into the registered state (``None``: none, or no checkpointer)."""
        if self.checkpointer is None:
            lifecycle("checkpoints_disabled", level=logging.WARNING, why="no checkpoint_dir and no --checkpoint-dir")
            return None
        return self.checkpointer.restore()

    def _build_checkpointer(self, env: WorkerEnv, sampler: ElasticSampler) -> None:
        """The checkpointer of this world (with a checkpoint directory), over the session's state."""
        if not self.checkpoint_dir:
            return
        ckpt = self.config.checkpoint
        # Live: its process groups' connections are the round's, severed with it when a member is gone (a save in
        # flight then fails at once instead of holding the move up until --io-timeout).
        with self.runtime.live.group.owning_new_connections() if self.runtime.live else contextlib.nullcontext():
            self.checkpointer = Checkpointer(
                directory=self.checkpoint_dir,
                keep_last=ckpt.keep_last,
                interval_steps=ckpt.save_every_steps,
                interval_seconds=ckpt.save_every_seconds,
                async_save=ckpt.async_save,
                on_save_error=ckpt.on_save_error,
                env=env,  # this world's (a live regroup's is the new round's)
            )
        self.checkpointer.agree_through(self.flags)  # no all-reduce of its own per step
        self.checkpointer.before_save(self.handover.flush)  # a catch-up's phases left: the whole state first
        statefuls = {"train_state": self.state, "sampler": sampler, **self.extra_state}
        self.checkpointer.register(model=self.runtime.module, optimizer=self.optimizer, **statefuls)

    def _log_plan(self, previous: int | None, changed: int | None, world_size: int) -> None:
        """Rank 0: the batch plan of ``world_size`` workers in force, and the world-size change and rescale events."""
        if self.plan is None:
            return
        lr = self.lr.for_next_step(self.plan, self.state)
        self.records.plan_in_force(
            self.plan,
            world_size=f"{previous if previous is not None else 'none'}->{world_size}",
            # With no LR policy or schedule the script's own LR (or scheduler) stands.
            lr=lr if lr is not None else float(self.optimizer.param_groups[0]["lr"]),
            step=self.state.step,
            changed=changed,
            new_size=world_size,
        )

    def save_step(
        self, superseded: Callable[[StaleGenerationError], bool], broke: Callable[[BaseException], None]
    ) -> None:
        """After a step's commit: save when due or asked (the hold of a requested save waits for the next step
        boundary, after the script's step.log()), and record it. A save refused as stale stops this world unless
        ``superseded`` says this node's own next round claimed the root; a collective that broke goes to ``broke``."""
        step = self.state.step
        try:
            saved = self.checkpointer is not None and self.checkpointer.maybe_save(step, hold=False)
        except StaleGenerationError as exc:
            if not superseded(exc):
                raise  # another world took the checkpoint root over: this one stops
            return  # the regroup moves this world on (every rank got the same verdict at this save)
        except (RuntimeError, dist.DistError, CheckpointSaveError) as exc:
            broke(exc)
            return
        if self.checkpointer is not None and saved:
            self.records.checkpointed(step)
            # A save the launcher asked for announces a membership change: a preemption notice, a node leaving.
            request = self.checkpointer.last_request
            self.records.events.record("checkpoint", step=step, requested=request.reason if request else None)
            if request is not None:
                # The agent asks with "leave: <why>" when its node goes (SIGTERM, a preemption notice).
                kind = "preemption" if request.cause is SaveCause.LEAVE else "membership_change"
                self.records.events.record(kind, step=step, reason=request.reason)

    def save_shards(self, generation: int | None) -> None:
        """A sharded model before an announced move (nodes joined, every member at this agreed boundary): commit
        the step, since the next world builds its model from the checkpoint. The new round's leader has claimed
        ``generation`` already; every member of this world is in it, so the save is that generation's."""
        if self.runtime.sharded is None or self.checkpointer is None or self.state.step == 0:
            return
        try:
            self.checkpointer.wait()  # an interval save in flight whose commit may come after the new claim
        except StaleGenerationError as exc:
            lifecycle(
                "checkpoint_superseded",
                level=logging.WARNING,
                step=self.state.step,
                why="this world's save came after its next round's claim; it is saved again as that round's",
                error=str(exc)[:200],
            )
        if generation is not None:
            self.checkpointer.continue_as(generation)
        if self.checkpointer.save(self.state.step, blocking=True, reason="regroup"):
            self.records.checkpointed(self.state.step)
            self.records.events.record("checkpoint", step=self.state.step, reason="regroup")

    def leave(self) -> None:
        """Drop everything bound to the current group: checkpointer (a broken world's save: given up after 1 s), DDP."""
        started = time.monotonic()
        live = self.runtime.live
        broken = live is not None and live.group.broken.is_set()
        if self.checkpointer is not None:
            checkpointer, self.checkpointer = self.checkpointer, None
            try:
                checkpointer.close(give_up_after_s=GIVE_UP_SAVE_AFTER_S if broken else None, ended=False)
            except (ElastrainError, RuntimeError, dist.DistError) as exc:
                lifecycle("checkpoint_abandoned", level=logging.WARNING, error=repr(exc)[:200])
        checkpointer_s = time.monotonic() - started
        self.runtime.unwrap()
        self.optimizer.zero_grad(set_to_none=True)
        if live is not None:
            live.group.leave()
        self.handover.give_up()
        lifecycle(
            "world_left",
            checkpointer_s=round(checkpointer_s, 3),
            took_s=round(time.monotonic() - started, 3),
        )

    def close(self, save: bool) -> None:
        """At the session's close: save the final step (unless ``save`` is false), then close the checkpointer
        (raises :class:`~elastrain.errors.CheckpointSaveError` if the last save failed)."""
        if save:  # every phase of a catch-up's transfer left: the state is whole for the save and the script
            self.handover.flush()
        if self.checkpointer is None:
            return
        self.handover.settle()  # a save reads the optimizer's state
        checkpointer, self.checkpointer = self.checkpointer, None
        try:
            final = save and self.state.step > 0
            if final and checkpointer.save(self.state.step, blocking=True, reason=FINAL):
                self.records.events.record("checkpoint", step=self.state.step, reason=FINAL)
        finally:
            checkpointer.close()


def _statefuls(state: TrainState, feed: Feed, extra_state: Mapping[str, Any]) -> dict[str, Any]:
    """The small state that travels with the model and optimizer in live mode: train state, data position,
    and the script's own ``Stateful`` extras."""
    out: dict[str, Any] = {"train_state": state, "sampler": feed.require_sampler()}
    for name, obj in extra_state.items():
        if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
            out[name] = obj
    return out


def _agree_on_segment(runtime: Runtime) -> str:
    token = uuid.uuid4().hex[:12]
    if runtime.distributed:  # plain data (elastrain.wire): a peer's message is parsed, never unpickled
        token = wire.broadcast(token, src=0, device=runtime.device)
    return str(token)
