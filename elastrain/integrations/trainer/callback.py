"""The Trainer callback of the zero-code integration: step boundaries, saves, epoch, metrics.

Public extension points only: the callback sees each step's boundaries and saves. Before a step's first
forward it lets a live regroup happen (:mod:`~elastrain.integrations.trainer.boundaries`), after each
optimizer step it decides saves with the one save schedule
(:class:`~elastrain.checkpoint.schedule.SaveTrigger`: the launcher's requests, agreed by every rank through
the step's gradient sync), and after every save the Trainer made it commits the folder. What it needs of
the driver is :class:`TrainerDriver`.
"""

from __future__ import annotations

import math
import os
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from transformers import TrainerCallback

from elastrain.checkpoint.schedule import SaveReason, SaveSchedule, SaveTrigger
from elastrain.control import ControlChannel
from elastrain.env import WorkerEnv
from elastrain.integrations.trainer.boundaries import StepBoundaries
from elastrain.integrations.trainer.checkpoints import Resume, TrainerCheckpoints
from elastrain.integrations.trainer.collection import collect_at_exit
from elastrain.integrations.trainer.membership import TrainerMembership
from elastrain.integrations.trainer.memory import Held
from elastrain.metrics import METRICS_FILENAME, EventsFile, MetricsWriter
from elastrain.step_flags import StepFlags

# The launcher's save requests only: the Trainer's own save_steps decide the interval saves.
SCHEDULE = SaveSchedule(interval_seconds=math.inf, hold_after_request_s=5.0)


class TrainerDriver(Protocol):
    """What the callback needs of elastrain's side of its Trainer (the driver, which changes ``env`` at a regroup)."""

    @property
    def env(self) -> WorkerEnv: ...
    @property
    def membership(self) -> TrainerMembership | None: ...
    @property
    def live_ok(self) -> bool: ...
    @property
    def regroups(self) -> int: ...
    @property
    def resumed(self) -> Resume | None: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    def epoch_at(self, step: int, max_steps: int) -> tuple[float, bool] | None: ...
    @property
    def held(self) -> Held: ...
    @property
    def flags(self) -> StepFlags: ...
    @property
    def checkpoints(self) -> TrainerCheckpoints: ...
    @property
    def boundaries(self) -> StepBoundaries: ...
    @property
    def log(self) -> Callable[..., None]: ...
    def redo_lost_epilogue(self) -> None: ...


class ElasticTrainerCallback(TrainerCallback):
    def __init__(self, driver: TrainerDriver) -> None:
        self.driver = driver
        env = driver.env
        self._channel = ControlChannel(env.control_dir) if env.control_dir else None
        self._trigger: SaveTrigger | None = None
        self._metrics: MetricsWriter | None = None
        self._requested = False
        self._hold_after: int | None = None

    def trigger(self) -> SaveTrigger:
        if self._trigger is None:
            driver = self.driver
            self._trigger = SaveTrigger(
                SCHEDULE,
                self._channel,
                None,
                is_local_leader=driver.env.local_rank == 0,
                log=driver.log,
                live_round=lambda: driver.env.round if driver.env.live else None,  # a regroup changes driver.env
            )
            self._trigger.use_flags(self.driver.flags)
        return self._trigger

    def release(self) -> None:
        """train() is over: the save trigger leaves the worker's flags, which outlive this Trainer (the next
        train() makes a new trigger), and the Trainer is collected before the worker's exit hooks run."""
        collect_at_exit()
        if self._trigger is not None:
            self._trigger.release_flags()
            self._trigger = None

    def leave_world(self) -> None:
        """A regroup: the next world starts its own segment of metrics."""
        self._metrics = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        d = self.driver
        self.trigger().started(state.global_step)
        m = d.membership
        if m is not None and d.live_ok and m.member is not None and d.regroups == 0:
            m.member.ready()  # from now on a membership change regroups this worker in place
        if d.rank == 0 and self._metrics is None:
            self._metrics = MetricsWriter(
                os.path.join(d.checkpoints.root, METRICS_FILENAME), uuid.uuid4().hex[:12], state.global_step
            )
            resumed = d.resumed
            if resumed is not None and resumed.world_size != d.world_size and d.regroups == 0:
                EventsFile(d.env.events_file).record(
                    "world_size_changed", old=resumed.world_size, new=d.world_size, step=state.global_step
                )
        d.redo_lost_epilogue()  # last, once this world's metrics are written to

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        d = self.driver
        step, self._hold_after = self._hold_after, None
        if step is not None:
            self.trigger().hold(step)  # after a requested save: the change it announced comes now
        d.boundaries.boundary()
        d.held.progress.step_begins(state)
        d.flags.begin_step()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        d = self.driver
        d.boundaries.agree_flags()
        epoch = d.epoch_at(int(state.global_step), int(state.max_steps))
        if epoch is not None:
            state.epoch, ends = epoch
            if ends:
                control.should_epoch_stop = True  # the Trainer's epoch ends with the stream's (stream.py)
        if self._channel is not None and self.trigger().check(state.global_step) is SaveReason.REQUEST:
            self.trigger().claim()
            self._requested = True
            control.should_save = True
        if state.max_steps and state.global_step >= state.max_steps and args.save_strategy != "no":
            control.should_save = True  # the last step is committed: a crash after training redoes nothing

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        d = self.driver
        step = state.global_step
        position = d.held.position
        cursor = position.cursor_at(step)
        path = d.checkpoints.commit(step, cursor, position.global_batch, d.held.stream.mark_at(cursor))
        trigger = self.trigger()
        trigger.started(step)
        # The Trainer saves synchronously. A requested save's answer waits for the step's own log and evaluation.
        # Its own scheduled save answers only the requests read when the ranks agreed on this step: a request made
        # since is answered by the next step's save, after which they hold, or when training ends (on_train_end).
        requested, self._requested = self._requested, False
        bound = trigger.bound(SaveReason.REQUEST.value if requested else SaveReason.INTERVAL.value)
        trigger.committed(step, path, time.time(), bound=bound, defer_answer=requested)
        if requested:
            self._hold_after = step

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trigger().answer_at_end(state.global_step)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if self._metrics is not None and logs:
            values = {k: v for k, v in logs.items() if isinstance(v, (int, float))}
            self._metrics.log(state.global_step, world_size=self.driver.world_size, **values)
