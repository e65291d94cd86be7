"""The Session: the elastic training loop, composed of the parts named after what they do.

- :mod:`~elastrain.session.config`: every setting, frozen and validated (:class:`SessionConfig`);
- :mod:`~elastrain.session.runtime`: device, process group (or the live round's), DDP;
- :mod:`~elastrain.session.feed`: the elastic sampler and the loader at its committed position;
- :mod:`~elastrain.session.records`: rank 0's events, metrics and TensorBoard, a segment per world;
- :mod:`~elastrain.session.step`: one optimizer step (micro-batches, scaled backward, commit);
- :mod:`~elastrain.session.regroup`: when a live worker moves to the next round (pure rules).

The session itself owns the train state, the checkpointer and the order of things: entering a world
(a start, or a live regroup), each step's boundary, the commit after ``optimizer_step``, the close.
"""

from __future__ import annotations

import gc
import logging
import os
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any, Unpack

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from elastrain import wire
from elastrain.checkpoint import Checkpointer, RestoreInfo
from elastrain.collective_failure import is_collective_failure, note_if_collective_failure
from elastrain.control import ControlChannel, RegroupChannel, SaveCause
from elastrain.data import ElasticSampler, RankStep
from elastrain.env import WorkerEnv
from elastrain.errors import CheckpointSaveError, ElastrainError, StaleGenerationError
from elastrain.live.agreement import Ballot, vote
from elastrain.live.group import GroupBrokenError
from elastrain.live.member import LiveMember
from elastrain.live.transfer import broadcast_state
from elastrain.log import configure, lifecycle
from elastrain.metrics import EventsFile
from elastrain.scaling import BatchPlan, Policy, loss_scale, plan, ramped_scale
from elastrain.session.config import SessionConfig, SessionSettings
from elastrain.session.errors import SessionConfigError, SessionError
from elastrain.session.feed import Feed
from elastrain.session.records import Records
from elastrain.session.regroup import REGROUP_FLAG, regroup_due, supersedes
from elastrain.session.runtime import Runtime
from elastrain.session.step import LOSS_TOTAL, MicroBatch, Step
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
        self._extra_state = dict(extra_state or {})
        self._base_lrs = [float(g.get("initial_lr", g["lr"])) for g in optimizer.param_groups]
        self._checkpoint_dir = self.config.checkpoint.directory or self.env.checkpoint_dir

        self._flags = StepFlags()  # raised at each step's gradient sync, agreed by every rank
        self._flags.add_total(LOSS_TOTAL, self._loss_sum)  # the step's mean loss without a collective of its own
        self.runtime = Runtime(model, self.config.runtime, self.env, self._flags)
        self.feed = Feed(dataset, self.config.data, self.runtime.device)
        self.records = Records(self.config.output, self._checkpoint_dir)
        self.state = TrainState()
        self.plan: BatchPlan | None = None
        self.checkpointer: Checkpointer | None = None
        self.restored: RestoreInfo | None = None
        self.segment = ""
        self._current: Step | None = None
        self._started = False
        self._stop_requested = False
        # Rank 0 watches the launcher's save requests only to record them as events; the checkpointer acts on them.
        self._control: ControlChannel | None = None
        self._collect_garbage = False

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
        """This worker's rank now (after a live regroup too; the RANK variable is the first round's)."""
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

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> Session:
        """Everything up to the first step; ``with Session(...)`` calls it."""
        if self._started:
            return self
        self._started = True
        configure()
        started = time.monotonic()
        if Runtime.live_mode(self.env):
            self.env = self.runtime.start_live(self.env)
            live = self.runtime.live
            if live is not None:  # every rank moves at one agreed step boundary
                self._flags.add(REGROUP_FLAG, lambda: live.pending_notice() is not None)
        else:
            self.runtime.start(self.env)
        self._enter_world(has_state=False, started=started, regroup=False)
        if self.runtime.live is not None:
            self.runtime.live.ready()
        return self

    def _enter_world(self, has_state: bool, started: float, regroup: bool) -> None:
        """Everything a worker does once it is in a world's group (a start, or a live ``regroup``): checkpointer,
        agreed state (``has_state``: this worker's counts), DDP, batch plan, records. Collective, in this order,
        on every member."""
        runtime = self.runtime
        runtime.refresh()
        rank, world_size = runtime.rank, runtime.world_size
        self._control = ControlChannel(self.env.control_dir) if self.env.control_dir and rank == 0 else None
        # Batch sizes do not depend on the LR reference, so the sampler is planned before the state arrives.
        first_plan = plan(self.config.scaling, world_size)
        if self.feed.sampler is None:
            sampler = self.feed.build(first_plan, rank)
        else:
            sampler = self.feed.require_sampler()
            self.feed.replan(first_plan, rank)
        sharded = runtime.sharded is not None
        runtime.shard(self.optimizer)  # a sharded model: this world's, before the checkpointer registers it
        self._build_checkpointer(sampler)
        held = self.state.step
        self.restored = None
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
            agreement = vote(Ballot(has_state and not sharded, held), runtime.device)
            source, agreed_step, ahead, stale = agreement.source, agreement.step, agreement.ahead, agreement.stale
            receivers = len(agreement.receivers)
            if agreement.from_checkpoint:
                self.restored = self._restore()
                if sharded and has_state and self.restored is None:
                    # The module was rebuilt for this world: without a checkpoint its state is gone.
                    raise SessionError(
                        f"the sharded model's state at step {held} is lost: a member holding shards of it left "
                        "before any checkpoint was committed (save_every_steps= keeps what a departure costs small)"
                    )
            elif source is not None:
                needy = agreement.ahead + agreement.receivers  # the others hold the agreed state already
                sent = broadcast_state(
                    source, runtime.module, self.optimizer, self._statefuls(), runtime.device, receivers=needy
                )
        runtime.wrap(agree_saves=self.checkpointer is not None, in_sync=source is not None)
        self.plan = plan(self.config.scaling, world_size, self.state.reference_world_size or world_size)
        self.feed.replan(self.plan)  # the next step starts at the agreed position
        self._current = None
        previous = self.state.world_size
        changed = self.state.start(world_size, lr_scale=self.plan.lr_scale)
        self.segment = self._agree_on_segment()
        restored_step = agreed_step if agreed_step is not None else (self.restored.step if self.restored else 0)
        self.records.reopen(rank, self.env, self.segment, restored_step)
        if rank != 0:
            return
        if regroup:
            fields: dict[str, Any] = {
                "round": self.env.round,
                "world_size": f"{previous if previous is not None else 'none'}->{world_size}",
                "step": self.state.step,
                "source": source,
                "rolled_back": held - self.state.step if has_state and rank not in stale else 0,
                "ranks_ahead": ",".join(map(str, ahead)) or None,
                "ranks_stale": ",".join(map(str, stale)) or None,  # held a superseded world's state: dropped
                "receivers": receivers,
                "bytes": sent,
                "checkpoint": self.restored.path if self.restored else None,  # no member held state (sharded)
                "took_s": round(time.monotonic() - started, 3),
            }
            lifecycle("regrouped", **fields)
            self.events.record("regroup", **fields)
        else:
            extra = {} if runtime.live is None else {"state_from": None if source is None else f"rank {source}"}
            self.records.record_start(self.env, world_size, self.restored, self.state, sampler, **extra)
        self._log_plan(previous, changed)

    def _restore(self) -> RestoreInfo | None:
        """The newest checkpoint that loads, into the registered state (``None``: none, or no checkpointer)."""
        if self.checkpointer is None:
            lifecycle("checkpoints_disabled", level=logging.WARNING, why="no checkpoint_dir and no --checkpoint-dir")
            return None
        return self.checkpointer.restore()

    def _build_checkpointer(self, sampler: ElasticSampler) -> None:
        """The checkpointer of this world (with a checkpoint directory), over the session's state."""
        if not self._checkpoint_dir:
            return
        ckpt = self.config.checkpoint
        self.checkpointer = Checkpointer(
            directory=self._checkpoint_dir,
            keep_last=ckpt.keep_last,
            interval_steps=ckpt.save_every_steps,
            interval_seconds=ckpt.save_every_seconds,
            async_save=ckpt.async_save,
            on_save_error=ckpt.on_save_error,
        )
        self.checkpointer.agree_through(self._flags)  # no all-reduce of its own per step
        self.checkpointer.register(
            model=self.module,
            optimizer=self.optimizer,
            train_state=self.state,
            sampler=sampler,
            **self._extra_state,
        )

    def _loss_sum(self) -> torch.Tensor | float:
        """This rank's share of the current step's loss, so far (read at the step's gradient sync)."""
        return self._current.loss_sum if self._current is not None else 0.0

    def _statefuls(self) -> dict[str, Any]:
        """The small state that travels with the model and optimizer in live mode: train state, data position,
        and the script's own ``Stateful`` extras."""
        out: dict[str, Any] = {"train_state": self.state, "sampler": self.feed.require_sampler()}
        for name, obj in self._extra_state.items():
            if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
                out[name] = obj
        return out

    def _log_plan(self, previous: int | None, changed: int | None) -> None:
        """Rank 0: the batch plan in force, and the world-size change and rescale events."""
        if self.plan is None:
            return
        lr = self._lr_for_next_step()
        self.records.plan_in_force(
            self.plan,
            world_size=f"{previous if previous is not None else 'none'}->{self.world_size}",
            # With no LR policy or schedule the script's own LR (or scheduler) stands.
            lr=lr if lr is not None else float(self.optimizer.param_groups[0]["lr"]),
            step=self.state.step,
            changed=changed,
            new_size=self.world_size,
        )

    def _agree_on_segment(self) -> str:
        token = uuid.uuid4().hex[:12]
        if self.distributed:  # plain data (elastrain.wire): a peer's message is parsed, never unpickled
            token = wire.broadcast(token, src=0, device=self.device)
        return str(token)

    def close(self, save: bool = True) -> None:
        """Save the final step (unless ``save`` is false), then release checkpoint threads and the process group."""
        self.feed.reset()  # stops DataLoader workers
        self._announce_finishing()
        if self.checkpointer is not None:
            checkpointer, self.checkpointer = self.checkpointer, None
            try:
                final = save and self.state.step > 0
                if final and checkpointer.save(self.state.step, blocking=True, reason="final"):
                    self.events.record("checkpoint", step=self.state.step, reason="final")
            finally:
                checkpointer.close()  # raises CheckpointSaveError if the last save failed
        self.records.close_writers()
        if self.rank == 0 and self._started:
            self.events.record("finish" if save else "stop", step=self.state.step, samples_seen=self.state.samples_seen)
        self.runtime.close()

    def _announce_finishing(self) -> None:
        """Tell the agent this worker's training is over: a node joining now waits for the job to end
        rather than have the agent ask a closing worker for a save or a regroup it will never answer."""
        if not (self.env.under_elastrain and self.env.control_dir and self._started):
            return
        try:
            RegroupChannel(self.env.control_dir).announce_finishing(self.env.local_rank, os.getpid())
        except OSError as exc:
            lifecycle("finishing_unannounced", level=logging.WARNING, error=repr(exc)[:200])

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
        while not self.should_stop:
            step = self.next_step()
            yield step
            if not step._done:
                raise SessionError(f"step {step.number} ended without step.optimizer_step()")

    def next_step(self) -> Step:
        """The next step's micro-batches (already loaded) and LR; the loop calls it via ``for step in session``."""
        if self._current is not None and not self._current._done:
            raise SessionError(f"step {self._current.number} is not finished: call step.optimizer_step() first")
        if self.checkpointer is not None:
            self.checkpointer.hold_if_requested()  # for the restart a requested save announced
        live = self.live
        if live is not None:
            if regroup_due(self._flags.agreed(), live.pending_notice(), self.world_size):
                # An announced change (a node joins, or leaves before our collective broke).
                self._regroup(None, wait=True)
            if self._collect_garbage:
                # The replaced DDP wrapper's reducer must be gone (its autograd hooks with it) before a backward.
                self._collect_garbage = False
                gc.collect()
        self._flags.begin_step()
        rank_step, datas = self.feed.next()
        try:
            scales = self._loss_scales(rank_step, datas)
        except GroupBrokenError as exc:
            self._collective_broke(exc, None, group_error=True)
            return self.next_step()  # re-planned for the new world, from the agreed data position
        micro = [MicroBatch(d, idx, s) for d, idx, s in zip(datas, rank_step.micro_batches, scales, strict=True)]
        lr = self._apply_lr()
        self._current = Step(self, rank_step, micro, lr)
        return self._current

    def _loss_scales(self, rank_step: RankStep, datas: list[Any]) -> list[float]:
        token_count = self.config.data.token_count
        if token_count is None:
            return [loss_scale(len(idx), self.world_size, rank_step.global_size) for idx in rank_step.micro_batches]
        counts = [int(token_count(d)) for d in datas]
        total = torch.tensor([sum(counts)], dtype=torch.int64, device=self.device)
        if self.distributed:
            self.runtime.all_reduce(total)
        return [loss_scale(c, self.world_size, int(total.item())) for c in counts]

    def _lr_for_next_step(self) -> float | None:
        mult = self._lr_multiplier()
        return None if mult is None else self._base_lrs[0] * mult

    def _lr_multiplier(self) -> float | None:
        schedule = self.config.lr_schedule
        if self.plan is None or (schedule is None and self.plan.policy is Policy.CONSTANT):
            return None
        scale = ramped_scale(
            self.state.previous_lr_scale(),
            self.plan.lr_scale,
            self.state.steps_since_change,
            self.config.scaling.rescale_warmup_steps,
        )
        return scale * (schedule(self.state.samples_seen) if schedule is not None else 1.0)

    def _apply_lr(self) -> float | None:
        mult = self._lr_multiplier()
        if mult is None:
            return None
        for group, base in zip(self.optimizer.param_groups, self._base_lrs, strict=True):
            group["lr"] = base * mult
        return float(self.optimizer.param_groups[0]["lr"])

    def _finish(self, step: Step) -> None:
        if step is not self._current:
            raise SessionError(f"optimizer_step() of step {step.number}, but the current step is another one")
        sampler = self.feed.require_sampler()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        sampler.commit(step.rank_step)
        self.state.advance(step.global_size, sampler.epoch)
        if self.distributed:
            try:  # no gradient sync carried the step's flags (no DDP, or no micro-batch): agree them now
                self._flags.agree(self.runtime.all_reduce, self.device)
            except GroupBrokenError as exc:
                self._collective_broke(exc, None, group_error=True)  # the step stands or falls by the vote
                return
        request = self._control.pending() if self._control is not None else None
        try:
            # A requested save's hold waits for the next step boundary, after the script's step.log().
            saved = self.checkpointer is not None and self.checkpointer.maybe_save(self.state.step, hold=False)
        except StaleGenerationError as exc:
            if not self._superseded_by_own_round(exc):
                raise  # another world took the checkpoint root over: this one stops
            return  # the regroup moves this world on (every rank got the same verdict at this save)
        except (RuntimeError, dist.DistError, CheckpointSaveError) as exc:
            # The step is applied on this rank; the regroup's vote decides whether the world keeps it.
            self._collective_broke(exc, None, group_error=False)
            return
        if self.checkpointer is not None and saved:
            self.records.checkpointed(self.state.step)
            # A save the launcher asked for announces a membership change: a preemption notice, a node leaving.
            self.events.record("checkpoint", step=self.state.step, requested=request.reason if request else None)
            if request is not None and self._control is not None:
                self._control.mark_handled(request.request_id)
                # The agent asks with "leave: <why>" when its node goes (SIGTERM, a preemption notice).
                kind = "preemption" if request.cause is SaveCause.LEAVE else "membership_change"
                self.events.record(kind, step=self.state.step, reason=request.reason)

    def log(self, step: int, **values: Any) -> None:
        """Record metrics at global step ``step`` (rank 0 writes; tensors become floats)."""
        if self.rank != 0:
            return
        self.records.log(step, {k: float(v.item()) if isinstance(v, torch.Tensor) else v for k, v in values.items()})

    # -- live mode (elastrain-run --live true) ------------------------------------------------------
    def _collective_broke(self, exc: BaseException, step: Step | None, group_error: bool) -> None:
        """A collective failed: in live mode, regroup (giving ``step`` up), else raise ``exc``.

        ``group_error``: the error came from the training group, so it is known to be a broken group; any
        other error is taken for one only if the agent announces a regroup within the regroup timeout.
        """
        live = self.live
        if live is None:
            raise exc
        if group_error and not live.group.broken.is_set() and not is_collective_failure(exc):
            raise exc  # not a collective that broke (the script's own error): no regroup can help
        self._regroup(exc)
        if step is not None:
            step.abandoned = True

    def _superseded_by_own_round(self, exc: StaleGenerationError) -> bool:
        """Live mode: whether a save was refused because this node's agent formed the next round (its claim of a
        newer fencing generation came before the save's commit), not because another world took over: the
        agent's notice of that round says so (it follows the claim at once; bounded wait). The save is given up
        (the state is in memory and moves with the regroup); the next save is the new world's."""
        live = self.live
        if live is None:
            return False
        notice = live.pending_notice() or live.wait_notice(live.round, self.env.regroup_timeout_s)
        ours = self.env.generation
        if notice is None or not supersedes(notice, ours):
            return False
        lifecycle(
            "checkpoint_superseded",
            level=logging.WARNING,
            step=self.state.step,
            generation=f"{ours}->{notice.generation}",
            why="the save's commit came after this node's next round claimed the checkpoint root; given up",
            error=str(exc)[:200],
        )
        return True

    def _regroup(self, cause: BaseException | None, wait: bool = False) -> None:
        """Move to the agent's next round (waiting, bounded, for its notice when ``cause`` broke a collective,
        or when ``wait``: a peer's agent announced it first)."""
        live = self.live
        if live is None:
            raise SessionError("internal: regroup outside live mode")
        timeout = self.env.regroup_timeout_s if cause is not None or wait else 0.0
        notice = live.pending_notice()
        if notice is None and cause is not None:
            live.report_broken()  # the agent probes its peers at once
        if notice is None and timeout > 0:
            notice = live.wait_notice(live.round, timeout)
        if notice is None:
            lifecycle("regroup_notice_missing", level=logging.WARNING, waited_s=timeout, error=repr(cause)[:200])
            if cause is not None:
                raise cause
            return
        started = time.monotonic()
        lifecycle(
            "regroup_started",
            round=f"{live.round}->{notice.round}",
            step=self.state.step,
            cause=type(cause).__name__ if cause is not None else "notice",
            state="dropped: the job trained on without this node" if notice.superseded else "kept",
        )
        if notice.no_departure and cause is None:
            self._save_shards(notice.generation)
        self._leave_world()
        for attempt in range(1, 11):
            try:
                self.env = live.move_to(notice)
                # Left behind (cut off while the job trained on): this state is a superseded world's; receive.
                self._enter_world(has_state=not notice.superseded, started=started, regroup=True)
                self._collect_garbage = True
                return
            except (RuntimeError, dist.DistError, TimeoutError) as exc:
                # A member of the announced round failed too: wait for the round after it.
                lifecycle(
                    "regroup_failed", level=logging.WARNING, round=notice.round, attempt=attempt, error=repr(exc)[:200]
                )
                self._leave_world()
                nxt = live.wait_notice(notice.round, self.env.regroup_timeout_s)
                if nxt is None:
                    raise
                notice = nxt
        raise SessionError("no regroup succeeded in 10 rounds in a row")

    def _save_shards(self, generation: int | None) -> None:
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
            self.events.record("checkpoint", step=self.state.step, reason="regroup")

    def _leave_world(self) -> None:
        """Drop everything bound to the current group: checkpointer (its save in flight is given up), DDP."""
        started = time.monotonic()
        if self.checkpointer is not None:
            checkpointer, self.checkpointer = self.checkpointer, None
            try:
                checkpointer.close()
            except (ElastrainError, RuntimeError, dist.DistError) as exc:
                lifecycle("checkpoint_abandoned", level=logging.WARNING, error=repr(exc)[:200])
        checkpointer_s = time.monotonic() - started
        self.runtime.unwrap()
        self.optimizer.zero_grad(set_to_none=True)
        if self.live is not None:
            self.live.group.leave()
        lifecycle(
            "world_left",
            checkpointer_s=round(checkpointer_s, 3),
            took_s=round(time.monotonic() - started, 3),
        )
