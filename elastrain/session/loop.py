"""The Session: the elastic training loop, composed of the parts named after what they do.

- :mod:`~elastrain.session.config`: every setting, frozen and validated (:class:`SessionConfig`);
- :mod:`~elastrain.session.runtime`: device, process group (or the live round's), DDP;
- :mod:`~elastrain.session.feed`: the elastic sampler and the loader at its committed position;
- :mod:`~elastrain.session.records`: rank 0's events, metrics and TensorBoard, a segment per world;
- :mod:`~elastrain.session.step`: one optimizer step (micro-batches, scaled backward, commit), against the
  small :class:`~elastrain.session.step.StepHost` seam the session implements;
- :mod:`~elastrain.session.world`: entering and leaving a world (checkpointer, agreed state, DDP, plan, records);
- :mod:`~elastrain.session.lr`: the learning rate (the plan's scale, ramped, times the schedule);
- :mod:`~elastrain.session.regroup`: when a live worker moves to the next round (pure rules).

The session itself owns the train state and the order of things: the start, each step's boundary,
the commit after ``optimizer_step``, a live regroup (leave this world, enter the next round's), the close.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any, Unpack

import torch
from torch.utils.data import Dataset

from elastrain.checkpoint import Checkpointer, RestoreInfo
from elastrain.collective_failure import note_if_collective_failure
from elastrain.control import announce_training
from elastrain.data import ElasticSampler
from elastrain.env import WorkerEnv
from elastrain.live.group import GroupBrokenError
from elastrain.live.member import LiveMember
from elastrain.live.transfer import TransferFailedError
from elastrain.log import configure
from elastrain.metrics import EventsFile
from elastrain.scaling import BatchPlan
from elastrain.session.config import SessionConfig, SessionSettings
from elastrain.session.errors import SessionConfigError, SessionError
from elastrain.session.feed import Feed
from elastrain.session.lr import LearningRate
from elastrain.session.move import LiveMoves
from elastrain.session.records import Records
from elastrain.session.regroup import REGROUP_FLAG, regroup_due
from elastrain.session.runtime import Runtime
from elastrain.session.step import LOSS_TOTAL, MicroBatch, Step
from elastrain.session.world import World
from elastrain.step_flags import StepFlags
from elastrain.train_state import TrainState


class Session:
    """Process group, DDP, elastic data, scaling policy, checkpoints and metrics for one training loop."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: Dataset[Any],
        config: SessionConfig | None = None,
        *,
        extra_state: Mapping[str, Any] | None = None,
        env: WorkerEnv | None = None,
        **settings: Unpack[SessionSettings],
    ) -> None:
        """``config``, or the same settings as keywords (see :class:`~elastrain.session.config.SessionSettings`).

        ``extra_state``: more objects saved with each checkpoint (``Stateful``: your LR scheduler, a
        custom RNG); in live mode the ``Stateful`` ones also travel with the model to joining members.
        ``env``: the worker's environment (default: read from the process's; tests pass their own).
        """
        if config is not None and settings:
            raise SessionConfigError("config", f"give config= or keyword settings, not both (got {sorted(settings)})")
        self.config = config if config is not None else SessionConfig.of(**settings)
        self.env = env or WorkerEnv.from_environ()
        self.optimizer = optimizer
        self.dataset = dataset
        self.lr = LearningRate(optimizer, self.config)
        checkpoint_dir = self.config.checkpoint.directory or self.env.checkpoint_dir

        self._flags = StepFlags()  # raised at each step's gradient sync, agreed by every rank
        self._flags.add_total(LOSS_TOTAL, self._loss_sum)  # the step's mean loss without a collective of its own
        self.runtime = Runtime(model, self.config.runtime, self.env, self._flags)
        self.feed = Feed(dataset, self.config.data, self.runtime.device)
        self.records = Records(self.config.output, checkpoint_dir)
        self.state = TrainState()
        self.world = World(
            self.config,
            optimizer,
            self.runtime,
            self.feed,
            self.records,
            self.state,
            self._flags,
            self.lr,
            dict(extra_state or {}),
            checkpoint_dir,
        )
        self.moves = LiveMoves(self.runtime, self.world, self.state, self._enter_round)
        self._current: Step | None = None
        self._started = False
        self._stop_requested = False

    # -- the parts' current values ----------------------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        """What to call in the loop: the model, in DDP over the current group when distributed."""
        return self.runtime.model

    @property
    def module(self) -> torch.nn.Module:
        """The script's model, never wrapped."""
        return self.runtime.module

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    @property
    def rank(self) -> int:
        """This worker's rank now (after a live regroup too)."""
        return self.runtime.rank

    @property
    def world_size(self) -> int:
        return self.runtime.world_size

    @property
    def distributed(self) -> bool:
        return self.runtime.distributed

    @property
    def live(self) -> LiveMember | None:
        """Under ``elastrain-run --live true``: this worker's membership of the current round."""
        return self.runtime.live

    @property
    def sampler(self) -> ElasticSampler | None:
        return self.feed.sampler

    @property
    def events(self) -> EventsFile:
        return self.records.events

    @property
    def checkpointer(self) -> Checkpointer | None:
        """This world's checkpointer (with a checkpoint directory)."""
        return self.world.checkpointer

    @property
    def plan(self) -> BatchPlan | None:
        """The batch plan in force in this world."""
        return self.world.plan

    @property
    def restored(self) -> RestoreInfo | None:
        """The checkpoint this world started from (``None``: none, or the state came from a member)."""
        return self.world.restored

    @property
    def caught_up(self) -> bool:
        """Whether this rank holds the world's whole state (False on a member whose catch-up state still arrives)."""
        return self.world.handover.intact

    @property
    def segment(self) -> str:
        """This world's segment of the records (one per entry into a world)."""
        return self.world.segment

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> Session:
        """Everything up to the first step; ``with Session(...)`` calls it."""
        if self._started:
            return self
        self._started = True
        configure()
        started = time.monotonic()
        if Runtime.live_mode(self.env):
            prepare = self.world.handover.prepare  # the memory to receive the state into, while it waits
            self.env = self.runtime.start_live(self.env, prepare=lambda: prepare(self.runtime, self.optimizer))
            live = self.runtime.live
            if live is not None:  # every rank moves at one agreed step boundary
                self._flags.add(REGROUP_FLAG, lambda: live.pending_notice() is not None)
        else:
            self.runtime.start(self.env)
        self.world.enter(self.env, has_state=False, started=started, regroup=False)
        if self.runtime.live is not None:
            self.runtime.live.ready()
        return self

    def _loss_sum(self) -> torch.Tensor | float:
        """This rank's share of the current step's loss, so far (read at the step's gradient sync)."""
        return self._current.loss_sum if self._current is not None else 0.0

    def close(self, save: bool = True) -> None:
        """Save the final step (unless ``save`` is false), then release checkpoint threads and the process group."""
        self.feed.reset()  # stops DataLoader workers
        if self._started:
            announce_training(self.env, over=True)
        self.world.close(save)  # raises CheckpointSaveError if the last save failed
        self.records.close_writers()
        if self.rank == 0 and self._started:
            self.events.record("finish" if save else "stop", step=self.state.step, samples_seen=self.state.samples_seen)
        self.runtime.close()

    def __enter__(self) -> Session:
        return self.start()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if isinstance(exc, BaseException):  # a peer's failure echoed here is not this node's own (the agent asks)
            note_if_collective_failure(self.env, exc)
        # After an exception the step in flight is half done: never save it.
        self.close(save=exc_type is None)

    # -- the loop --------------------------------------------------------------------------------
    @property
    def should_stop(self) -> bool:
        """True once max_steps or epochs are reached, or after :meth:`request_stop`."""
        if self._stop_requested:
            return True
        max_steps, epochs = self.config.max_steps, self.config.epochs
        if max_steps is not None and self.state.step >= max_steps:
            return True
        return epochs is not None and self.sampler is not None and self.sampler.epoch >= epochs

    def request_stop(self) -> None:
        self._stop_requested = True

    def __iter__(self) -> Iterator[Step]:
        self.start()
        while True:
            while not self.should_stop:
                step = self.next_step()
                yield step
                if not step.done:
                    raise SessionError(f"step {step.number} ended without step.optimizer_step()")
            if self.moves.land_state(self.env):  # a catch-up's phases left land: the script reads whole state
                return

    def next_step(self) -> Step:
        """The next step's micro-batches (already loaded) and LR; the loop calls it via ``for step in session``."""
        if self._current is not None and not self._current.done:
            raise SessionError(f"step {self._current.number} is not finished: call step.optimizer_step() first")
        if self.world.checkpointer is not None:
            self.world.checkpointer.hold_if_requested()  # for the restart a requested save announced
        live = self.live
        if live is not None:
            # A move since the last step (from inside its save, say): its sync's agreement was the left world's.
            agreed = None if self.moves.moved else self._flags.agreed()
            if regroup_due(agreed, live.pending_notice(), self.world_size):
                # An announced change (a node joins, or leaves before our collective broke).
                self.moves.regroup(self.env, None, wait=True)
            self.moves.collect_garbage()
            self.world.finish_catch_up()  # the step the new members sat out is done: all train from here
        self._flags.begin_step()
        rank_step, datas = self.feed.next()
        try:
            reduce = self.runtime.all_reduce if self.distributed else None
            scales = self.feed.loss_scales(rank_step, datas, rank_step.world_size, reduce)  # the ranks computing it
        except GroupBrokenError as exc:
            self.collective_broke(exc, None, group_error=True)
            return self.next_step()  # re-planned for the new world, from the agreed data position
        micro = [MicroBatch(d, idx, s) for d, idx, s in zip(datas, rank_step.micro_batches, scales, strict=True)]
        lr = self.lr.apply(self.plan, self.state)
        self._current = Step(self, rank_step, micro, lr)
        return self._current

    def agreed_total(self, name: str) -> float | None:
        """The sum over all ranks of the total ``name`` this step's gradient sync carried (``None``: not carried)."""
        return self._flags.total(name) if self.distributed else None

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """A sum over the current group (in live mode one the watchdog can give up: ``GroupBrokenError``)."""
        self.runtime.all_reduce(tensor)

    def finish_step(self, step: Step) -> None:
        """``step.optimizer_step()``: apply the optimizer, then commit the step (data cursor, state, checkpoint)."""
        if step is not self._current:
            raise SessionError(f"optimizer_step() of step {step.number}, but the current step is another one")
        sampler = self.feed.require_sampler()
        try:  # the optimizer's state sent or received in full before its step changes it
            if self.world.handover.settle():  # received: its parameter groups carry the sender's last LR
                self.lr.apply(self.plan, self.state)  # this step's, set again (nothing when the script sets it)
        except TransferFailedError as exc:
            self.collective_broke(exc, step, group_error=True)
            return
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        sampler.commit(step.rank_step)
        self.state.advance(step.global_size, sampler.epoch)
        if self.distributed:
            try:  # no gradient sync carried the step's flags (no DDP, or no micro-batch): agree them now
                self._flags.agree(self.runtime.all_reduce, self.device)
            except GroupBrokenError as exc:
                self.collective_broke(exc, None, group_error=True)  # the step stands or falls by the vote
                return
        if self.live is not None and self.runtime.catch_up is None:  # every member trained it (not a catch-up's)
            self.live.step_ended()
        self.world.save_step(
            lambda exc: self.moves.superseded(self.env, exc),
            # The step is applied on this rank; the regroup's vote decides whether the world keeps it.
            lambda exc: self.collective_broke(exc, None, group_error=False),
        )

    def log(self, step: int, **values: Any) -> None:
        """Record metrics at global step ``step`` (rank 0 writes, tensors become floats; the others keep them)."""
        self.records.log(step, values)

    # -- live mode (elastrain-run --live true) ------------------------------------------------------
    def collective_broke(self, exc: BaseException, step: Step | None, group_error: bool) -> None:
        """A collective failed: in live mode, regroup (giving ``step`` up), else raise ``exc``
        (:meth:`LiveMoves.collective_broke <elastrain.session.move.LiveMoves.collective_broke>`)."""
        self.moves.collective_broke(self.env, exc, step, group_error)

    def sit_out(self, step: Step) -> None:
        """This rank's part of the gradient sync of a step it sits out (:mod:`elastrain.session.catch_up`)."""
        try:
            self.runtime.sit_out()
        except (GroupBrokenError, RuntimeError) as exc:
            self.collective_broke(exc, step, group_error=True)

    def _enter_round(self, env: WorkerEnv, has_state: bool, started: float) -> None:
        """Into the new round's world (:meth:`World.enter`); the step in flight, if any, is gone with the last."""
        self.env = env
        self.world.enter(env, has_state, started, regroup=True)
        self._current = None
