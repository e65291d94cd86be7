"""An unmodified ``transformers.Trainer`` under elastrain-run: one :class:`ElasticTrainer` per Trainer.

elastrain-run installs it into every Trainer a worker builds (:mod:`elastrain.integrations.trainer.hook`);
the script imports nothing from elastrain. What it gives the script:

* **Global batch.** ``per_device_train_batch_size × gradient_accumulation_steps × world size`` at the
  first world size is the run's global batch (recorded with every checkpoint); at every other world size
  the batch plan (:func:`elastrain.scaling.plan`) splits it among the ranks, and the per-device batch and
  the accumulation are set from it (:mod:`~elastrain.integrations.trainer.rescale`). The learning rate is
  left alone (the global batch does not change).
* **Exact data position.** The training set is read as elastrain's stream
  (:mod:`~elastrain.integrations.trainer.dataloader`) from the position of the step the run resumes from;
  the Trainer's own skip-ahead (transformers#40245) is off.
* **Committed checkpoints.** Every ``checkpoint-N`` the Trainer writes is committed by the commit protocol
  (:mod:`~elastrain.integrations.trainer.checkpoints`); the launcher's save requests (SIGTERM, a cloud
  notice) are saved at the next step boundary; the last step is saved.
* **Resume.** ``trainer.train()`` resumes from the newest committed checkpoint when the script asks for
  none, and never from a folder that was not committed (a newer committed one, or a fresh start, instead).
* **Live regroup** (``--live``, the default): a membership change does not restart the worker.
  ``trainer.train()`` is left at a step boundary every rank agrees on (an announced change: a node joins
  or leaves) or where a collective broke (a peer died: the step in flight is given up), the worker moves
  to the next round's process group, the members agree on the newest step every one of them holds, the
  model, optimizer, scheduler and Trainer state travel from one member to those that need them, and
  ``train()`` is entered again with the batch re-planned and the data at the agreed position. The step
  flags that carry the change are agreed at every step (:mod:`~elastrain.integrations.trainer.boundaries`).

The driver composes these parts and runs ``train()``'s loop: resume, regroups, the run's end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from elastrain.collective_failure import note_if_collective_failure
from elastrain.control import announce_training
from elastrain.env import WorkerEnv
from elastrain.integrations.trainer.batch import TrainerSettings
from elastrain.integrations.trainer.boundaries import RegroupNow, StepBoundaries
from elastrain.integrations.trainer.checkpoints import (
    Resume,
    TrainerCheckpoints,
    choose,
    rank_zero_log,
)
from elastrain.integrations.trainer.dataloader import StreamLoader
from elastrain.integrations.trainer.ddp_args import tune_ddp
from elastrain.integrations.trainer.errors import TrainerIntegrationError
from elastrain.integrations.trainer.kept_grads import KeptWork
from elastrain.integrations.trainer.lost_epilogue import LostEpilogue
from elastrain.integrations.trainer.lost_log import LostLog
from elastrain.integrations.trainer.membership import TrainerMembership, restart_only
from elastrain.integrations.trainer.memory import DataPosition, Held
from elastrain.integrations.trainer.placement import canonical_cpu_device
from elastrain.integrations.trainer.rescale import TrainerBatch
from elastrain.integrations.trainer.weak_trainer import WeakTrainer
from elastrain.integrations.trainer.world import TrainerWorld
from elastrain.log import lifecycle
from elastrain.step_flags import StepFlags

REGROUP_ATTEMPTS = 10
NO_LIMIT = 1 << 30

__all__ = ["ElasticTrainer", "RegroupNow", "TrainerIntegrationError", "driver_of"]


def driver_of(trainer: Any) -> ElasticTrainer | None:
    """The driver elastrain attached to ``trainer`` (None: not under elastrain-run, or turned off)."""
    found = vars(trainer).get("_elastrain")
    return found if isinstance(found, ElasticTrainer) else None


class ElasticTrainer:
    """elastrain's side of one Trainer: batch plan, data stream, checkpoints, resume and live regroup."""

    trainer = WeakTrainer()

    def __init__(self, trainer: Any, membership: TrainerMembership | None) -> None:
        args = trainer.args
        self.trainer = trainer
        self.membership = membership
        self.env = membership.env if membership is not None else WorkerEnv.from_environ()
        settings = _explicit_settings(trainer)
        limit = settings.keep_last if settings else args.save_total_limit
        self.checkpoints = TrainerCheckpoints(
            args.output_dir,
            self.env,
            int(limit) if limit else NO_LIMIT,
            best=lambda: self.trainer.state.best_model_checkpoint,  # the state of the current train() call
        )
        # The Trainer's rotation may delete the last complete checkpoint before the new one is committed, and its
        # skip-ahead replays the old world's per-rank batches: elastrain does both (see the module docstring).
        args.save_total_limit = None
        args.ignore_data_skip = True
        self.flags = membership.flags if membership is not None else StepFlags()
        self.held = Held()
        self.batch = TrainerBatch(trainer, settings, self.held)
        """The batch plan at this world size (from an ElasticTrainerRun's settings, or the arguments)."""
        self.loader = StreamLoader(trainer, self.batch, self.held)
        self.kept = KeptWork(trainer, self.loader)
        """A lost step's finished micro-batches, kept across a broken world (live mode)."""
        self.resumed: Resume | None = None
        self.live_ok = membership is not None and self._live_supported()
        self.world = TrainerWorld(trainer, membership, self.held) if membership is not None and self.live_ok else None
        """Live mode: this Trainer's side of the round it trains in (None: restart mode)."""
        self.boundaries = StepBoundaries(trainer, membership, self.flags, self.live_ok)
        self.regroups = 0
        self.lost_log = LostLog()
        self.epilogue = LostEpilogue()
        """A step's evaluation and save cut short by a broken world, run again in the next."""
        self._eval_args: tuple[Any, Any] = (None, None)
        """``train()``'s ``trial`` and ``ignore_keys_for_eval``: what an evaluation run again is given."""
        from elastrain.integrations.trainer.callback import ElasticTrainerCallback

        self.callback = ElasticTrainerCallback(self)
        # Right after the Trainer's own flow callback (it decides the interval saves first), before the script's:
        # they see the true epoch and the committed checkpoints.
        handler = trainer.callback_handler
        handler.callbacks.insert(min(1, len(handler.callbacks)), self.callback)
        vars(trainer)["_elastrain"] = self
        if self.env.local_rank == 0:
            lifecycle("trainer_integrated", live=self.live_ok, output_dir=self.checkpoints.root, keep_last=limit)

    # -- settings --------------------------------------------------------------------------------
    def _live_supported(self) -> bool:
        t = self.trainer
        why = restart_only(t.args)
        if why is None and (t.is_deepspeed_enabled or t.is_fsdp_enabled):
            why = "DeepSpeed" if t.is_deepspeed_enabled else "FSDP"
        if why is None:
            return True
        if self.membership is not None and not self.membership.joined:  # set up as one process, for a live Trainer
            raise TrainerIntegrationError(
                f"--live: the Trainer uses {why} (from accelerate's configuration), which cannot regroup in place, "
                "but its arguments did not say so when it set up; run elastrain-run with --live false"
            )
        lifecycle("trainer_restart_mode", level=logging.WARNING, why=f"{why}: membership changes restart the workers")
        return False

    @property
    def log(self) -> Callable[..., None]:
        return rank_zero_log

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    def epoch_at(self, step: int, max_steps: int) -> tuple[float, bool] | None:
        """The Trainer's epoch after ``step``, and whether the step ends one of the stream's epochs."""
        return self.loader.epoch_at(step, max_steps)

    # -- train() ---------------------------------------------------------------------------------
    def train(self, original: Callable[..., Any], resume_from_checkpoint: Any, kwargs: dict[str, Any]) -> Any:
        """``Trainer.train``, entered again after every live regroup until the run ends."""
        asked = self._asked_checkpoint(resume_from_checkpoint)
        self._eval_args = (kwargs.get("trial"), kwargs.get("ignore_keys_for_eval"))
        args = self.trainer.args
        eval_on_start = args.eval_on_start
        announce_training(self.env, over=False)  # a Trainer before this one may have said its training was over
        if self.membership is not None:
            self.membership.trainings += 1
        try:
            path = self._enter_world(first=True, asked=asked)
        except Exception as exc:  # a peer lost as the world is entered: a joiner's, or a script's next train()
            path = self._regroup(self._regroup_cause(exc))
        try:
            while True:
                cause: BaseException | None = None
                stops = self.world.forward_stops() if self.world is not None else contextlib.nullcontext()
                try:
                    with stops:
                        result = original(self.trainer, resume_from_checkpoint=path, **kwargs)
                except RegroupNow:
                    pass
                except Exception as exc:
                    cause = self._regroup_cause(exc)
                else:  # a change now waits for this worker to end, unless the script trains again
                    announce_training(self.env, over=True)
                    return result
                path = self._regroup(cause)
                args.eval_on_start = False  # the run evaluated as it started, not as each world does
        finally:
            args.eval_on_start = eval_on_start
            self.callback.release()

    def before_evaluation(self, loop: str) -> None:
        """``evaluate()`` or ``predict()`` (``loop``): before the first ``train()``, in the job's first round, the
        worker joins its round (:meth:`~elastrain.integrations.trainer.world.TrainerWorld.before_loop`)."""
        if self.world is not None and (env := self.world.before_loop(loop)) is not None:
            self.env = env

    def _asked_checkpoint(self, asked: Any) -> str | None:
        """The checkpoint the script asked for, or the newest committed one; never an uncommitted folder."""
        choice = choose(asked, self.checkpoints.root)
        if choice.replaced is not None:
            lifecycle(
                "trainer_resume_replaced",
                level=logging.WARNING,
                asked=choice.replaced,
                instead=choice.path or "a fresh start",
                why=choice.why,
            )
        elif asked is None and choice.path is not None:
            self.log("trainer_resume_found", path=choice.path, why="the script asked for none: " + choice.why)
        return choice.path

    def _regroup_cause(self, exc: Exception) -> Exception:
        """``exc`` when it is this world breaking (a regroup follows), else raised again. The finished frames of its
        traceback let go of what they held (the old DDP wrapper, so the move collects it at once); the traceback
        keeps its lines for a re-raise."""
        if self.world is None or not self.world.broken_by(exc):
            raise exc
        traceback.clear_frames(exc.__traceback__)
        return exc

    # -- entering and leaving a world --------------------------------------------------------------
    def _enter_world(self, first: bool, asked: str | None = None) -> str | None:
        """Everything before ``Trainer.train`` runs in a world: devices, batch plan, agreed state. Returns the
        checkpoint the Trainer loads (None: a fresh start, or the state in memory). Collective."""
        world = self.world
        if world is not None:
            self.env = world.join(first)
        self.checkpoints.leave_world()
        self.checkpoints.env = self.env
        self.flags.begin_step()  # what the last world agreed (a regroup, say) is not this world's
        if world is None:
            return self._restore(asked, first)
        own_step = int(self.trainer.state.global_step) if self.held.holds_state else -1
        agreed_step = world.agree_state()
        _one_flos_type(self.trainer)
        self.lost_log.relog(self.trainer, self.trainer.args.device, own_step, agreed_step)
        self.epilogue.agree(self.trainer, self.checkpoints.committed, self.trainer.args.device, own_step, agreed_step)
        tune_ddp(self.trainer.accelerator, in_sync=agreed_step is not None)  # the DDP train() builds for this world
        canonical_cpu_device(self.trainer.accelerator)  # prepare() moves no state already in place
        if agreed_step is None:
            self.kept.drop()
            return self._restore(asked, first)
        plan = self.batch.replan(self.held.position.global_batch)
        self.kept.agree(own_step, agreed_step, self.held.position, plan, self.trainer.args.device)
        return None

    def _restore(self, asked: str | None, first: bool) -> str | None:
        """A checkpoint resume (restart mode, or a live world where no member holds state)."""
        resume = self.checkpoints.restore() if (first or asked is None) else None
        if asked is not None and resume is not None and os.path.abspath(asked) != resume.path and first:
            self.log("trainer_resume_newer", asked=asked, path=resume.path)
        self.resumed = resume
        held = self.held
        if resume is not None:
            batch = resume.global_batch or self.batch.first_global_batch()
            held.position = DataPosition(resume.step, resume.cursor, batch)
            held.stream.received = resume.stream  # an iterable set's place there, if it keeps one
        else:
            held.position = DataPosition(0, 0, self.batch.first_global_batch())
        self.batch.replan(held.position.global_batch)
        held.memory_resume = False
        held.holds_state = True
        self.log(
            "checkpoint_restored",
            step=resume.step if resume else None,
            path=resume.path if resume else self.checkpoints.root,
            world_size=f"{resume.world_size if resume else 'none'}->{self.world_size}",
            cursor=held.position.cursor,
            global_batch=held.position.global_batch,
            **({} if resume else {"why": "no committed checkpoint; starting fresh"}),
        )
        return resume.path if resume else None

    def _regroup(self, cause: BaseException | None) -> str | None:
        """Leave the current world and enter the next round's; the checkpoint path for train() (None: memory)."""
        world = self.world
        if world is None:
            raise RuntimeError("internal: a regroup without live membership")
        notice = world.notice_for(cause)
        started = time.monotonic()
        if cause is not None and not notice.superseded:
            self.kept.keep(self.held.position)  # before the leave drops the gradients
        for attempt in range(1, REGROUP_ATTEMPTS + 1):
            world.leave(kept=not notice.superseded)
            self.checkpoints.leave_world()
            self.callback.leave_world()
            try:
                self.env = world.move_to(notice)
                path = self._enter_world(first=False)
            except (RuntimeError, dist.DistError, TimeoutError) as exc:
                lifecycle(
                    "regroup_failed", level=logging.WARNING, round=notice.round, attempt=attempt, error=repr(exc)[:200]
                )
                nxt = world.next_notice(notice)
                if nxt is None:
                    raise
                notice = nxt
                continue
            self.regroups += 1
            if self.rank == 0:
                lifecycle(
                    "regrouped",
                    round=notice.round,
                    world_size=self.world_size,
                    step=self.trainer.state.global_step,
                    took_s=round(time.monotonic() - started, 3),
                )
            return path
        raise TrainerIntegrationError(f"no regroup succeeded in {REGROUP_ATTEMPTS} rounds in a row")

    # -- the Trainer's hooks -----------------------------------------------------------------------
    def init_training_state(self, result: tuple[int, int], max_steps: int, per_epoch: int) -> tuple[int, int]:
        """After the Trainer built a fresh ``TrainerState``: the state in memory, when resuming from it; the epoch
        the Trainer's loop starts in (the stream's, or its own)."""
        state, held = self.trainer.state, self.held
        if held.memory_resume:
            held.progress.apply(state, self.trainer.callback_handler.callbacks)
            result = (int(state.global_step) // max(per_epoch, 1), 0)
            self.lost_log.emit(self.trainer)
        epochs = self.loader.epochs(max_steps)
        if epochs is not None:
            result = (epochs[0], 0)  # the stream's position is the data position: nothing skipped in the epoch
        self.lost_log.begin(int(state.global_step))  # a checkpoint's step too
        if held.position.step != state.global_step:
            raise TrainerIntegrationError(
                f"the Trainer resumed at step {state.global_step} but elastrain's data position is at step "
                f"{held.position.step}: resume_from_checkpoint must name a checkpoint elastrain committed"
            )
        return result

    def prepared(self, model: Any) -> None:
        """After accelerate wrapped the model: the step flags ride on DDP's gradient sync; a kept scheduler state."""
        held = self.held
        if held.memory_resume:
            held.scheduler.apply(self.trainer.lr_scheduler)
        held.scheduler.target = self.trainer.lr_scheduler
        self.boundaries.sync_on(model, self.kept.watch)
        if self.world is not None:
            self.world.collection.wrapped()

    def redo_lost_epilogue(self) -> None:
        """``Trainer.train`` set up its state and is about to train (``on_train_begin``): the agreed step's evaluation
        and save, if its world cut them short (collective; live mode)."""
        if self.world is not None:
            self.epilogue.redo(self.trainer, *self._eval_args)

    def note_failure(self, exc: BaseException) -> None:
        note_if_collective_failure(self.env, exc)


def _one_flos_type(trainer: Any) -> None:
    """Every save all-gathers the flos counter as a tensor of its Python type (``Trainer.store_flos``): an int 0
    where no step ran since the last save (a cold joiner), a float where one did (a live member whose save or
    evaluation broke after its step). Different types are a collective mismatch, which aborts gloo's process: one
    type on every member of a new world."""
    trainer.current_flos = float(trainer.current_flos)


def _explicit_settings(trainer: Any) -> TrainerSettings | None:
    """The settings of an ``ElasticTrainerRun`` whose callback the Trainer was given, if any."""
    from elastrain.integrations.trainer.settings import SettingsCallback

    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, SettingsCallback):
            return callback.settings
    return None
