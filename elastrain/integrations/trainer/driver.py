"""An unmodified ``transformers.Trainer`` under elastrain-run: one :class:`ElasticTrainer` per Trainer.

elastrain-run installs it into every Trainer a worker builds (:mod:`elastrain.integrations.trainer.hook`);
the script imports nothing from elastrain. What it gives the script:

* **Global batch.** ``per_device_train_batch_size × gradient_accumulation_steps × world size`` at the
  first world size is the run's global batch (recorded with every checkpoint); at every other world size
  the batch plan (:func:`elastrain.scaling.plan`) splits it among the ranks, and the per-device batch and
  the accumulation are set from it. The learning rate is left alone (the global batch does not change).
* **Exact data position.** The training set is read as elastrain's stream
  (:mod:`~elastrain.integrations.trainer.stream`) from the position of the step the run resumes from;
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
  ``train()`` is entered again with the batch re-planned and the data at the agreed position.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from elastrain.collective_failure import note_if_collective_failure
from elastrain.control import RegroupChannel, RegroupNotice
from elastrain.env import WorkerEnv
from elastrain.errors import ElastrainError, ScalingError
from elastrain.integrations.trainer.batch import TrainerSettings, device_batch, trainer_plan
from elastrain.integrations.trainer.checkpoints import (
    Resume,
    TrainerCheckpoints,
    choose,
    rank_zero_log,
)
from elastrain.integrations.trainer.membership import TrainerMembership
from elastrain.integrations.trainer.memory import DataPosition, Held
from elastrain.integrations.trainer.stream import StreamBatches
from elastrain.integrations.trainer.world import TrainerWorld
from elastrain.log import lifecycle
from elastrain.scaling import BatchPlan
from elastrain.session.regroup import regroup_due
from elastrain.step_flags import StepFlags, flagged_allreduce

REGROUP_ATTEMPTS = 10
NO_LIMIT = 1 << 30


class TrainerIntegrationError(ElastrainError):
    """The Trainer is set up in a way the zero-code integration cannot make elastic; names the setting."""


class RegroupNow(Exception):
    """Raised at a step boundary to leave ``Trainer.train`` for the next round (caught by the driver)."""


def driver_of(trainer: Any) -> ElasticTrainer | None:
    """The driver elastrain attached to ``trainer`` (None: not under elastrain-run, or turned off)."""
    found = vars(trainer).get("_elastrain")
    return found if isinstance(found, ElasticTrainer) else None


class ElasticTrainer:
    """elastrain's side of one Trainer: batch plan, data stream, checkpoints, resume and live regroup."""

    def __init__(self, trainer: Any, membership: TrainerMembership | None) -> None:
        args = trainer.args
        self.trainer = trainer
        self.membership = membership
        self.env = membership.env if membership is not None else WorkerEnv.from_environ()
        self.settings = _explicit_settings(trainer)
        """An ElasticTrainerRun's settings; None: inferred from the arguments at the first world size."""
        self.user_micro = self.settings.micro_batch if self.settings else int(args.per_device_train_batch_size)
        self.user_accumulation = int(args.gradient_accumulation_steps)
        limit = self.settings.keep_last if self.settings else args.save_total_limit
        self.checkpoints = TrainerCheckpoints(args.output_dir, self.env, int(limit) if limit else NO_LIMIT)
        # The Trainer's rotation may delete the last complete checkpoint before the new one is committed, and its
        # skip-ahead replays the old world's per-rank batches: elastrain does both (see the module docstring).
        args.save_total_limit = None
        args.ignore_data_skip = True
        self.flags = membership.flags if membership is not None else StepFlags()
        self.held = Held()
        self.num_samples = 0
        """The training set's size (known once the Trainer asks for its dataloader)."""
        self.plan: BatchPlan | None = None
        self.resumed: Resume | None = None
        self.live_ok = membership is not None and self._live_supported()
        self.world = TrainerWorld(trainer, membership, self.held) if membership is not None and self.live_ok else None
        """Live mode: this Trainer's side of the round it trains in (None: restart mode)."""
        self.regroups = 0
        self._warned_stream = False
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
        why = None
        if t.is_deepspeed_enabled or t.args.deepspeed:
            why = "DeepSpeed"
        elif t.is_fsdp_enabled or t.args.fsdp:
            why = "FSDP"
        elif t.args.auto_find_batch_size:
            why = "auto_find_batch_size"
        if why is not None:
            lifecycle(
                "trainer_restart_mode", level=logging.WARNING, why=f"{why}: membership changes restart the workers"
            )
        return why is None

    @property
    def log(self) -> Callable[..., None]:
        return rank_zero_log

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    def _first_global_batch(self) -> int:
        if self.settings is not None:
            return self.settings.global_batch
        return self.user_micro * self.user_accumulation * self.world_size

    def _replan(self, global_batch: int) -> BatchPlan:
        """Per-device batch and accumulation for this world size that keep ``global_batch`` exactly."""
        args = self.trainer.args
        try:
            p = trainer_plan(global_batch, self.user_micro, self.world_size)
        except ScalingError as e:
            raise TrainerIntegrationError(str(e)) from None
        args.per_device_train_batch_size, args.gradient_accumulation_steps = device_batch(p, self.rank)
        self.trainer._train_batch_size = args.per_device_train_batch_size
        if self.plan is None or self.plan.world_size != p.world_size:
            self.log(
                "rescale",
                world_size=p.world_size,
                global_batch=p.global_batch,
                micro_batch=args.per_device_train_batch_size,
                accumulation=p.accumulation,
                policy="constant",
            )
        self.plan = p
        self.held.position.global_batch = p.global_batch
        return p

    def total_steps(self, num_samples: int) -> int:
        """The run's length in optimizer steps, whatever the world size (``max_steps``, or the epochs asked)."""
        args = self.trainer.args
        if args.max_steps > 0:
            return int(args.max_steps)
        return max(1, math.ceil(float(args.num_train_epochs) * num_samples / self.held.position.global_batch))

    # -- train() ---------------------------------------------------------------------------------
    def train(self, original: Callable[..., Any], resume_from_checkpoint: Any, kwargs: dict[str, Any]) -> Any:
        """``Trainer.train``, entered again after every live regroup until the run ends."""
        asked = self._asked_checkpoint(resume_from_checkpoint)
        path = self._enter_world(first=True, asked=asked)
        while True:
            cause: BaseException | None = None
            try:
                result = original(self.trainer, resume_from_checkpoint=path, **kwargs)
            except RegroupNow:
                pass
            except Exception as exc:
                if not self._is_regroup_cause(exc):
                    raise
                cause = exc
            else:
                self._finished()
                return result
            path = self._regroup(cause)

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

    def _is_regroup_cause(self, exc: BaseException) -> bool:
        return self.world is not None and self.world.broken_by(exc)

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
        if world is None or not world.agree_state():
            return self._restore(asked, first)
        self._replan(self.held.position.global_batch)
        return None

    def _restore(self, asked: str | None, first: bool) -> str | None:
        """A checkpoint resume (restart mode, or a live world where no member holds state)."""
        resume = self.checkpoints.restore() if (first or asked is None) else None
        if asked is not None and resume is not None and os.path.abspath(asked) != resume.path and first:
            self.log("trainer_resume_newer", asked=asked, path=resume.path)
        self.resumed = resume
        held = self.held
        if resume is not None:
            batch = resume.global_batch or self._first_global_batch()
            held.position = DataPosition(resume.step, resume.cursor, batch)
        else:
            held.position = DataPosition(0, 0, self._first_global_batch())
        self._replan(held.position.global_batch)
        held.memory_resume = False
        held.holds_state = True
        self.log(
            "checkpoint_restored",
            step=resume.step if resume else None,
            path=resume.path if resume else self.checkpoints.root,
            world_size=f"{resume.world_size if resume else 'none'}->{self.world_size}",
            cursor=held.position.cursor,
            global_batch=held.position.global_batch,
        )
        return resume.path if resume else None

    def _regroup(self, cause: BaseException | None) -> str | None:
        """Leave the current world and enter the next round's; the checkpoint path for train() (None: memory)."""
        world = self.world
        if world is None:
            raise RuntimeError("internal: a regroup without live membership")
        notice = world.notice_for(cause)
        started = time.monotonic()
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

    def _finished(self) -> None:
        """train() returned: tell the agent this worker's training is over (a change now waits for it to end)."""
        env = self.env
        if env.under_elastrain and env.control_dir:
            try:
                RegroupChannel(env.control_dir).announce_finishing(env.local_rank, os.getpid())
            except OSError as exc:
                lifecycle("finishing_unannounced", level=logging.WARNING, error=repr(exc)[:200])

    # -- the Trainer's hooks -----------------------------------------------------------------------
    def stream_ok(self) -> bool:
        """Whether the training set can be read as the stream (a map-style dataset with a length)."""
        from collections.abc import Sized

        from torch.utils.data import IterableDataset

        dataset = self.trainer.train_dataset
        ok = isinstance(dataset, Sized) and not isinstance(dataset, IterableDataset)
        if not ok and not self._warned_stream:
            self._warned_stream = True
            lifecycle(
                "trainer_data_unordered",
                level=logging.WARNING,
                why="the training set is iterable (no length): its position is not kept across world sizes",
            )
        return ok

    def train_dataloader(self) -> Any:
        """The DataLoader of this rank's micro-batches of the stream, for the steps left in the run."""
        from torch.utils.data import DataLoader

        t = self.trainer
        dataset = t.train_dataset
        collator = t.data_collator
        try:
            import datasets

            is_hf_dataset = isinstance(dataset, datasets.Dataset)
        except ImportError:
            is_hf_dataset = False
        if is_hf_dataset:
            dataset = t._remove_unused_columns(dataset, description="training")
        else:
            collator = t._get_collator_with_removed_columns(collator, description="training")
        if self.plan is None:
            raise RuntimeError("internal: the train dataloader is built before the batch plan")
        args = t.args
        num_samples = self.num_samples = len(dataset)
        total = self.total_steps(num_samples)
        args.max_steps = total  # epochs asked: their steps at the global batch, the same at every world size
        remaining = total - int(self.held.position.step)
        start = self.held.position.cursor
        if self.settings is not None:
            seed, shuffle = self.settings.seed, self.settings.shuffle
        else:
            seed = args.data_seed if args.data_seed is not None else args.seed
            shuffle = args.train_sampling_strategy != "sequential"
        sampler = StreamBatches(num_samples, self.plan, self.rank, start, remaining, seed=seed, shuffle=shuffle)
        loader = DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=collator,
            num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory,
            persistent_workers=args.dataloader_persistent_workers and args.dataloader_num_workers > 0,
            prefetch_factor=args.dataloader_prefetch_factor if args.dataloader_num_workers > 0 else None,
        )
        prepared = t.accelerator.prepare(loader)
        from accelerate.data_loader import BatchSamplerShard

        shard = prepared.batch_sampler
        if isinstance(shard, BatchSamplerShard) and shard.batch_sampler is sampler:
            shard.num_processes = 1  # already this rank's batches: accelerate must not shard them again
            shard.process_index = 0
        return prepared

    def init_training_state(self, result: tuple[int, int], per_epoch: int) -> tuple[int, int]:
        """After the Trainer built a fresh ``TrainerState``: the state in memory, when resuming from it."""
        state, held = self.trainer.state, self.held
        if held.memory_resume:
            held.progress.apply(state)
            result = (int(state.global_step) // max(per_epoch, 1), 0)
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
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return
        flags = self.flags
        m = self.membership
        try:
            if m is not None and self.live_ok and m.member is not None:
                group = m.member.group
                model.register_comm_hook(None, lambda state, bucket: group.comm_hook(state, bucket, flags))
            else:
                hook = flagged_allreduce(flags)
                model.register_comm_hook(None, lambda state, bucket: hook(state, bucket))
        except RuntimeError as exc:  # the script registered its own comm hook: the flags agree by an all-reduce
            lifecycle("trainer_flags_own_sync", level=logging.WARNING, why=str(exc)[:200])

    # -- step boundaries (from the callback) ---------------------------------------------------------
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
        else:
            self.flags.agree(lambda t: dist.all_reduce(t), self.trainer.args.device)

    def note_failure(self, exc: BaseException) -> None:
        note_if_collective_failure(self.env, exc)


def _explicit_settings(trainer: Any) -> TrainerSettings | None:
    """The settings of an ``ElasticTrainerRun`` whose callback the Trainer was given, if any."""
    from elastrain.integrations.trainer.settings import SettingsCallback

    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, SettingsCallback):
            return callback.settings
    return None
