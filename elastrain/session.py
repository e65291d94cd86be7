"""Session: a plain PyTorch loop made elastic with about ten added lines.

::

    from elastrain.session import Session

    with Session(model, optimizer, dataset, global_batch=64, micro_batch=8, collate_fn=collate,
                 max_steps=1000, save_every_steps=50) as session:
        for step in session:                      # until max_steps / epochs
            for mb in step:                       # this rank's micro-batches; DDP no_sync handled
                loss = session.model(**mb.data).loss
                step.backward(loss, mb)           # scaled: the gradient is the global batch's mean
            step.optimizer_step()                 # LR, optimizer, data cursor, checkpoint, metrics
            step.log(loss=loss.item())

The session initialises the process group (gloo on CPU, nccl on GPU, with the launcher's collective
timeout), wraps the model in DDP, plans the batch with a scaling policy, feeds a ``DataLoader``
through an :class:`~elastrain.data.ElasticSampler`, restores the newest checkpoint, and after every
optimizer step advances the train state, saves when due (or when the launcher asks) and writes the
events and metrics files. The model is yours: anything whose batches come out of a ``collate_fn``.

Under ``elastrain-run --live true`` a membership change does not restart the session's process: it
gives up the step in flight, joins the new round's process group, agrees with the other members on
one state (broadcast from a member, no checkpoint read) and goes on; see :mod:`elastrain.live`.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from elastrain.checkpoint import Checkpointer, RestoreInfo
from elastrain.checkpoint.storage import join_path
from elastrain.collective_failure import note_if_collective_failure
from elastrain.control import ControlChannel, RegroupChannel, SaveCause
from elastrain.data import ElasticSampler, EpochEnd, RankStep
from elastrain.env import WorkerEnv
from elastrain.errors import CheckpointSaveError, ElastrainError, StaleGenerationError
from elastrain.live.agreement import Ballot, vote
from elastrain.live.group import GroupBrokenError
from elastrain.live.member import LiveMember
from elastrain.live.transfer import broadcast_state
from elastrain.log import configure, lifecycle
from elastrain.metrics import (
    EVENTS_FILENAME,
    METRICS_FILENAME,
    EventsFile,
    MetricsWriter,
    TensorBoardWriter,
    read_metrics,
    tensorboard_available,
)
from elastrain.scaling import BatchPlan, Policy, ScalingConfig, Schedule, loss_scale, plan, ramped_scale
from elastrain.step_flags import StepFlags, flagged_allreduce
from elastrain.train_state import TrainState

_REGROUP = "regroup"  # the StepFlags flag: some rank's agent announced the next round


class SessionError(ElastrainError):
    """The training loop used the session out of order."""


def move_to(data: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """``data`` with every tensor inside (dicts, lists, tuples) moved to ``device``."""
    if isinstance(data, torch.Tensor):
        return data.to(device, non_blocking=non_blocking)
    if isinstance(data, Mapping):
        moved_map = {k: move_to(v, device, non_blocking) for k, v in data.items()}
        try:
            return type(data)(moved_map)  # type: ignore[call-arg]
        except TypeError:  # a mapping type that cannot be built from a dict (defaultdict)
            return moved_map
    if isinstance(data, (list, tuple)):
        moved = [move_to(v, device, non_blocking) for v in data]
        return type(data)(moved) if not hasattr(data, "_fields") else type(data)(*moved)
    return data


class MicroBatch:
    """One forward/backward pass worth of this rank's data."""

    def __init__(self, data: Any, indices: Sequence[int], loss_scale: float) -> None:
        self.data = data
        self.indices = list(indices)
        """Dataset indices in this micro-batch."""
        self.loss_scale = loss_scale
        """Multiply the micro-batch's *mean* loss by this before ``backward`` (``Step.backward`` does)."""

    @property
    def size(self) -> int:
        return len(self.indices)


class Step:
    """One optimizer step: iterate it for the micro-batches, then call :meth:`optimizer_step`."""

    def __init__(self, session: Session, rank_step: RankStep, micro: list[MicroBatch], lr: float | None) -> None:
        self._session = session
        self.rank_step = rank_step
        self.micro_batches = micro
        self.number = session.state.step + 1
        """The global step number this step gets once done (1-based, continuous across restarts)."""
        self.epoch = rank_step.range.start.epoch
        self.lr = lr
        """The learning rate of the first parameter group for this step (None: the session leaves LR alone)."""
        self.global_size = rank_step.global_size
        self._loss_sum: torch.Tensor | float = 0.0
        self._done = False
        self.abandoned = False
        """True when a membership change (live mode) gave this step up: the loop's remaining calls are no-ops."""

    def __iter__(self) -> Iterator[MicroBatch]:
        last = len(self.micro_batches) - 1
        for i, mb in enumerate(self.micro_batches):
            if self.abandoned:
                return
            # Gradients are all-reduced once per step, on the last micro-batch's backward. The model is
            # looked up each time, never held: a regroup replaces the DDP wrapper during the step.
            with self._sync_context(sync=i == last):
                yield mb

    def _sync_context(self, sync: bool) -> contextlib.AbstractContextManager[Any]:
        model = self._session.model
        if sync or not isinstance(model, DistributedDataParallel):
            return contextlib.nullcontext()
        return model.no_sync()

    def backward(self, loss: torch.Tensor, mb: MicroBatch) -> None:
        """``(loss × mb.loss_scale).backward()`` for a loss that is the mean over ``mb``'s samples (or tokens)."""
        if self.abandoned:
            return
        scaled = loss * mb.loss_scale
        self._loss_sum = self._loss_sum + scaled.detach().to(torch.float64)  # no device sync per micro-batch
        try:
            scaled.backward()  # type: ignore[no-untyped-call]
        except RuntimeError as exc:
            self._session._collective_broke(exc, self, group_error=True)

    def mean_loss(self) -> float:
        """The step's loss averaged over all its samples on all ranks (a collective: call it on every rank)."""
        # On the model's device: nccl reduces CUDA tensors only.
        if self.abandoned:
            return math.nan
        total = torch.as_tensor(self._loss_sum, dtype=torch.float64, device=self._session.device).reshape(1)
        if self._session.distributed:
            try:
                self._session._all_reduce(total)
            except GroupBrokenError as exc:
                # Before optimizer_step() the step is given up; after it, the vote decides whether it stands.
                self._session._collective_broke(exc, None if self._done else self, group_error=True)
                return math.nan
        return float(total.item()) / self._session.world_size

    def optimizer_step(self) -> None:
        """Apply the optimizer, clear gradients, and commit the step (data cursor, state, checkpoint)."""
        if self._done:
            raise SessionError(f"optimizer_step() called twice for step {self.number}")
        self._done = True
        if not self.abandoned:
            self._session._finish(self)

    def log(self, **values: Any) -> None:
        """Record metrics at this step's global number (rank 0 writes; tensors become floats)."""
        if not self.abandoned:
            self._session.log(self.number, **values)


class Session:
    """Process group, DDP, elastic data, scaling policy, checkpoints and metrics for one training loop."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: Dataset[Any],
        *,
        global_batch: int | None = None,
        micro_batch: int = 1,
        policy: Policy | str = Policy.CONSTANT,
        accumulation: int = 1,
        reference_world_size: int | None = None,
        rescale_warmup_steps: int = 0,
        lr_schedule: Schedule | None = None,
        max_steps: int | None = None,
        epochs: int | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        seed: int = 0,
        shuffle: bool = True,
        epoch_end: EpochEnd | str = EpochEnd.PARTIAL,
        token_count: Callable[[Any], int] | None = None,
        checkpoint_dir: str | None = None,
        save_every_steps: int | None = None,
        save_every_seconds: float | None = None,
        keep_last: int = 3,
        async_save: bool = True,
        on_save_error: Literal["raise", "warn"] = "raise",
        metrics_dir: str | None = None,
        tensorboard_dir: str | None = None,
        extra_state: Mapping[str, Any] | None = None,
        ddp: bool = True,
        ddp_kwargs: Mapping[str, Any] | None = None,
        device: torch.device | str | None = None,
        env: WorkerEnv | None = None,
    ) -> None:
        """See the module docstring; the batch settings are :class:`~elastrain.scaling.ScalingConfig`'s.

        ``lr_schedule`` maps samples consumed to a multiplier on each parameter group's initial LR.
        With neither a schedule nor an LR-scaling policy the session never touches the LR (use your
        own scheduler, registered through ``extra_state``). ``token_count(batch)`` switches loss
        normalisation from samples to tokens (one scalar all-reduce per step).
        """
        self.config = ScalingConfig(
            policy=Policy(policy),
            global_batch=global_batch,
            micro_batch=micro_batch,
            accumulation=accumulation,
            reference_world_size=reference_world_size,
            rescale_warmup_steps=rescale_warmup_steps,
        )
        if max_steps is None and epochs is None:
            raise SessionError("give max_steps or epochs: Session(..., max_steps=N) says when training ends")
        self.env = env or WorkerEnv.from_environ()
        self.module = model
        self.model: torch.nn.Module = model
        self.optimizer = optimizer
        self.dataset = dataset
        self.max_steps = max_steps
        self.epochs = epochs
        self.lr_schedule = lr_schedule
        self.token_count = token_count
        self._loader_kwargs: dict[str, Any] = {
            "collate_fn": collate_fn,
            "num_workers": num_workers,
            "pin_memory": pin_memory,
        }
        self._sampler_kwargs: dict[str, Any] = {"seed": seed, "shuffle": shuffle, "epoch_end": EpochEnd(epoch_end)}
        self._checkpoint_dir = checkpoint_dir or self.env.checkpoint_dir
        self._ckpt_kwargs: dict[str, Any] = {
            "keep_last": keep_last,
            "interval_steps": save_every_steps,
            "interval_seconds": save_every_seconds,
            "async_save": async_save,
            "on_save_error": on_save_error,  # a failed save stops the run (raise) or only logs (warn)
        }
        self._metrics_dir = metrics_dir or self._checkpoint_dir
        self._tensorboard_dir = tensorboard_dir
        self._extra_state = dict(extra_state or {})
        self._use_ddp = ddp
        self._ddp_kwargs = dict(ddp_kwargs or {})
        self.device = torch.device(device) if device is not None else self._default_device()
        self._base_lrs = [float(g.get("initial_lr", g["lr"])) for g in optimizer.param_groups]

        self.state = TrainState()
        self.world_size = self.env.world_size
        self.rank = self.env.rank
        self.distributed = False
        self._owns_group = False
        self.plan: BatchPlan | None = None
        self.sampler: ElasticSampler | None = None
        self.checkpointer: Checkpointer | None = None
        self.restored: RestoreInfo | None = None
        self.segment = ""
        self.events = EventsFile(None)
        self._metrics: MetricsWriter | None = None
        self._tensorboard: TensorBoardWriter | None = None
        self._loader: DataLoader[Any] | None = None
        self._steps: Iterator[RankStep] | None = None
        self._batches: Iterator[Any] | None = None
        self._current: Step | None = None
        self._started = False
        self._stop_requested = False
        self._steps_rerun = 0
        # Rank 0 watches the launcher's save requests only to record them as events; the checkpointer acts on them.
        self._control = ControlChannel(self.env.control_dir) if self.env.control_dir and self.rank == 0 else None
        self._step_flags = StepFlags()  # raised at each step's gradient sync, agreed by every rank
        # elastrain-run --live true: membership changes move this process to the next round (elastrain.live).
        self.live: LiveMember | None = None
        self._collect_garbage = False

    # -- lifecycle -------------------------------------------------------------------------------
    def _default_device(self) -> torch.device:
        if torch.cuda.is_available():
            return torch.device("cuda", self.env.local_rank)
        return torch.device("cpu")

    def _init_process_group(self) -> None:
        if dist.is_available() and dist.is_initialized():
            self.distributed = True
        elif self.env.world_size > 1 or self.env.under_elastrain:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            timeout = timedelta(seconds=self.env.collective_timeout_s) if self.env.collective_timeout_s else None
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            dist.init_process_group(backend=backend, timeout=timeout)
            self.distributed = self._owns_group = True
        if self.distributed:
            self.world_size, self.rank = dist.get_world_size(), dist.get_rank()

    def start(self) -> Session:
        """Everything up to the first step; ``with Session(...)`` calls it."""
        if self._started:
            return self
        self._started = True
        configure()
        if self._live_mode():
            return self._start_live()
        self._init_process_group()
        self.module.to(self.device)
        if self.distributed and self._use_ddp:
            self._wrap_ddp()
        # Batch sizes do not depend on the LR reference, so the sampler can be built before the restore.
        self.plan = plan(self.config, self.world_size)
        self.sampler = ElasticSampler(self.dataset, self.plan, self.rank, **self._sampler_kwargs)  # type: ignore[arg-type]
        self._build_checkpointer(self.sampler)
        self.restored = self._restore()
        self.plan = plan(self.config, self.world_size, self.state.reference_world_size or self.world_size)
        self.sampler.plan = self.plan
        previous = self.state.world_size
        changed = self.state.start(self.world_size, lr_scale=self.plan.lr_scale)
        self.segment = self._agree_on_segment()
        restored_step = self.restored.step if self.restored else 0
        if self.rank == 0:
            self._open_metrics(restored_step)
            self._record_start()
            self._log_plan(previous, changed)
        return self

    def _wrap_ddp(self) -> None:
        """``self.model``: the module in DDP over the current group (in live mode, through its comm hook)."""
        ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = DistributedDataParallel(self.module, device_ids=ids, **self._ddp_kwargs)
        flags = self._step_flags  # the save decision rides on the step's last gradient bucket
        # Lambdas: DDP rejects a hook whose annotations are strings (from __future__ import annotations).
        if self.live is not None:
            group = self.live.group
            ddp.register_comm_hook(None, lambda state, bucket: group.comm_hook(state, bucket, flags))
        elif self._checkpoint_dir:  # without a checkpointer there is nothing to agree: DDP's own all-reduce
            hook = flagged_allreduce(flags)
            ddp.register_comm_hook(None, lambda state, bucket: hook(state, bucket))
        self.model = ddp

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
        self.checkpointer = Checkpointer(directory=self._checkpoint_dir, **self._ckpt_kwargs)
        self.checkpointer.agree_through(self._step_flags)  # no all-reduce of its own per step
        self.checkpointer.register(
            model=self.module,
            optimizer=self.optimizer,
            train_state=self.state,
            sampler=sampler,
            **self._extra_state,
        )

    def _record_start(self, **extra: Any) -> None:
        """Rank 0: the ``start`` event of a segment, and ``restore`` when it began from a checkpoint."""
        sampler = self._require_sampler()
        self.events.record(
            "start",
            world_size=self.world_size,
            start_reason=self.env.start_reason.value,
            restart_count=self.env.restart_count,
            round=self.env.round,
            generation=self.env.generation,
            restored_step=self.restored.step if self.restored else None,
            checkpoint=self.restored.path if self.restored else None,
            **extra,
            samples_seen=self.state.samples_seen,
            epoch=sampler.epoch,
            cursor=sampler.position.cursor,
        )
        if self.restored is not None:
            self.events.record(
                "restore",
                step=self.restored.step,
                path=self.restored.path,
                saved_world_size=self.restored.world_size,
                steps_rerun=self._steps_rerun,
            )

    def _log_plan(self, previous: int | None, changed: int | None) -> None:
        """Rank 0: the batch plan in force (a lifecycle line), and the world-size change and rescale events."""
        if self.plan is None:
            return
        lr = self._lr_for_next_step()
        fields: dict[str, Any] = {
            "world_size": f"{previous if previous is not None else 'none'}->{self.world_size}",
            "policy": self.plan.policy.value,
            "global_batch": self.plan.global_batch,
            "micro_batch": self.plan.micro_batch,
            "accumulation": self.plan.accumulation,
            # With no LR policy or schedule the script's own LR (or scheduler) stands.
            "lr": f"{lr if lr is not None else self.optimizer.param_groups[0]['lr']:.6g}",
            "step": self.state.step,
        }
        lifecycle("rescale" if changed is not None else "batch_plan", **fields)
        if changed is not None:
            self.events.record("world_size_changed", old=changed, new=self.world_size, step=self.state.step)
            self.events.record("rescale", **fields)

    def _agree_on_segment(self) -> str:
        token = [uuid.uuid4().hex[:12]]
        if self.distributed:
            dist.broadcast_object_list(token, src=0)
        return str(token[0])

    def _open_metrics(self, restored_step: int) -> None:
        events_path = self.env.events_file
        if self._metrics_dir:
            events_path = events_path or join_path(self._metrics_dir, EVENTS_FILENAME)
            metrics_path = join_path(self._metrics_dir, METRICS_FILENAME)
            # Steps logged past the restored one were computed by a start that died: they are re-run now.
            logged = max((p.step for p in read_metrics(metrics_path).active), default=0)
            self._steps_rerun = max(0, logged - restored_step)
            self._metrics = MetricsWriter(metrics_path, self.segment, restored_step)
        self.events = EventsFile(events_path, run_id=self.env.run_id, segment=self.segment)
        if self._tensorboard_dir:
            if tensorboard_available():
                self._tensorboard = TensorBoardWriter(self._tensorboard_dir, restored_step)
            else:
                lifecycle("tensorboard_unavailable", level=logging.WARNING, fix="pip install 'elastrain[tensorboard]'")

    def close(self, save: bool = True) -> None:
        """Save the final step (unless ``save`` is false), then release checkpoint threads and the process group."""
        self._batches = self._steps = self._loader = None  # stops DataLoader workers
        self._announce_finishing()
        if self.checkpointer is not None:
            checkpointer, self.checkpointer = self.checkpointer, None
            try:
                final = save and self.state.step > 0
                if final and checkpointer.save(self.state.step, blocking=True, reason="final"):
                    self.events.record("checkpoint", step=self.state.step, reason="final")
            finally:
                checkpointer.close()  # raises CheckpointSaveError if the last save failed
        if self._metrics is not None:
            self._metrics.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self.rank == 0 and self._started:
            self.events.record("finish" if save else "stop", step=self.state.step, samples_seen=self.state.samples_seen)
        if self.live is not None:
            self.live.close()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False

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
        if self.max_steps is not None and self.state.step >= self.max_steps:
            return True
        return self.epochs is not None and self.sampler is not None and self.sampler.epoch >= self.epochs

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
        if self.live is not None:
            if self._regroup_due(self.live):
                # An announced change (a node joins, or leaves before our collective broke).
                self._regroup(None, wait=True)
            if self._collect_garbage:
                # The replaced DDP wrapper's reducer must be gone (its autograd hooks with it) before a backward.
                self._collect_garbage = False
                gc.collect()
        self._step_flags.begin_step()
        sampler = self._require_sampler()
        rank_step = next(self._steps, None) if self._steps is not None else None
        if rank_step is None:
            # A new epoch (or the first step): the loader and the step plan start from the same committed position.
            self._loader = DataLoader(self.dataset, batch_sampler=sampler, **self._loader_kwargs)
            self._steps = sampler.steps(sampler.position)
            self._batches = iter(self._loader)
            rank_step = next(self._steps)
        if self._batches is None:
            raise SessionError("internal: no batch iterator")
        datas = [next(self._batches) for _ in rank_step.micro_batches]
        non_blocking = bool(self._loader_kwargs["pin_memory"]) and self.device.type == "cuda"
        if self.device.type != "cpu":
            datas = [move_to(d, self.device, non_blocking) for d in datas]
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
        if self.token_count is None:
            return [loss_scale(len(idx), self.world_size, rank_step.global_size) for idx in rank_step.micro_batches]
        counts = [int(self.token_count(d)) for d in datas]
        total = torch.tensor([sum(counts)], dtype=torch.int64, device=self.device)
        if self.distributed:
            self._all_reduce(total)
        return [loss_scale(c, self.world_size, int(total.item())) for c in counts]

    def _lr_for_next_step(self) -> float | None:
        mult = self._lr_multiplier()
        return None if mult is None else self._base_lrs[0] * mult

    def _lr_multiplier(self) -> float | None:
        if self.plan is None or (self.lr_schedule is None and self.plan.policy is Policy.CONSTANT):
            return None
        scale = ramped_scale(
            self.state.previous_lr_scale(),
            self.plan.lr_scale,
            self.state.steps_since_change,
            self.config.rescale_warmup_steps,
        )
        schedule = self.lr_schedule(self.state.samples_seen) if self.lr_schedule is not None else 1.0
        return scale * schedule

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
        sampler = self._require_sampler()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        sampler.commit(step.rank_step)
        self.state.advance(step.global_size, sampler.epoch)
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
            if self._metrics is not None:
                self._metrics.checkpointed(self.state.step)  # object stores: no restorable step's points lost
            # A save the launcher asked for announces a membership change: a preemption notice, a node leaving.
            self.events.record("checkpoint", step=self.state.step, requested=request.reason if request else None)
            if request is not None and self._control is not None:
                self._control.mark_handled(request.request_id)
                # The agent asks with "leave: <why>" when its node goes (SIGTERM, a preemption notice).
                kind = "preemption" if request.cause is SaveCause.LEAVE else "membership_change"
                self.events.record(kind, step=self.state.step, reason=request.reason)

    def log(self, step: int, **values: Any) -> None:
        if self.rank != 0:
            return
        plain = {k: float(v.item()) if isinstance(v, torch.Tensor) else v for k, v in values.items()}
        if self._metrics is not None:
            self._metrics.log(step, **plain)
        if self._tensorboard is not None:
            self._tensorboard.log(step, **plain)

    def _require_sampler(self) -> ElasticSampler:
        if self.sampler is None:
            raise SessionError("the session is not started: use `with Session(...) as session:` or session.start()")
        return self.sampler

    # -- live mode (elastrain-run --live true) ------------------------------------------------------
    def _live_mode(self) -> bool:
        return self.env.live and self.env.under_elastrain and bool(self.env.control_dir) and not dist.is_initialized()

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        if self.live is not None:
            self.live.group.all_reduce(tensor)
        else:
            dist.all_reduce(tensor)

    def _start_live(self) -> Session:
        """start() in live mode: join the round, then agree on state exactly as a regroup does."""
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.live = LiveMember(self.env, backend)
        live = self.live
        self._step_flags.add(_REGROUP, lambda: live.pending_notice() is not None)  # moves at one agreed step
        if self.env.warm:  # built while the job trained without this node: now it may join a round
            self.env = self.live.await_round()
        self.live.join_first()
        self.distributed = self._owns_group = True
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.module.to(self.device)
        self.plan = plan(self.config, self.world_size)
        self.sampler = ElasticSampler(self.dataset, self.plan, self.rank, **self._sampler_kwargs)  # type: ignore[arg-type]
        self._enter_world(has_state=False, started=time.monotonic())
        self.live.ready()
        return self

    def _statefuls(self) -> dict[str, Any]:
        """The small state that travels with the model and optimizer: train state, data position, and the
        script's own ``Stateful`` extras."""
        out: dict[str, Any] = {"train_state": self.state, "sampler": self._require_sampler()}
        for name, obj in self._extra_state.items():
            if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
                out[name] = obj
        return out

    def _enter_world(self, has_state: bool, started: float) -> None:
        """Everything a live worker does once it is in a new round's group (first start or regroup):
        checkpointer, agreed state, DDP, batch plan, events. Collective, in this order, on every member."""
        sampler = self._require_sampler()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._control = ControlChannel(self.env.control_dir) if self.env.control_dir and self.rank == 0 else None
        sampler.plan = plan(self.config, self.world_size)
        sampler.rank = self.rank
        self._build_checkpointer(sampler)
        held = self.state.step
        agreement = vote(Ballot(has_state, held), self.device)
        sent = 0
        self.restored = None
        if agreement.from_checkpoint:
            self.restored = self._restore()
        elif agreement.source is not None:
            sent = broadcast_state(agreement.source, self.module, self.optimizer, self._statefuls(), self.device)
        if self._use_ddp:
            self._wrap_ddp()
        self.plan = plan(self.config, self.world_size, self.state.reference_world_size or self.world_size)
        sampler.plan = self.plan
        self._loader = self._steps = self._batches = None  # the next step starts at the agreed position
        self._current = None
        previous = self.state.world_size
        changed = self.state.start(self.world_size, lr_scale=self.plan.lr_scale)
        self.segment = self._agree_on_segment()
        self._reopen_metrics(
            agreement.step if agreement.step is not None else (self.restored.step if self.restored else 0)
        )
        if self.rank != 0:
            return
        took = round(time.monotonic() - started, 3)
        fields: dict[str, Any] = {
            "round": self.env.round,
            "world_size": f"{previous if previous is not None else 'none'}->{self.world_size}",
            "step": self.state.step,
            "source": agreement.source,
            "rolled_back": held - self.state.step if has_state else 0,
            "ranks_ahead": ",".join(map(str, agreement.ahead)) or None,
            "receivers": len(agreement.receivers),
            "bytes": sent,
            "took_s": took,
        }
        if has_state:
            lifecycle("regrouped", **fields)
            self.events.record("regroup", **fields)
        else:
            self._record_start(state_from=None if agreement.source is None else f"rank {agreement.source}")
        self._log_plan(previous, changed)

    def _reopen_metrics(self, restored_step: int) -> None:
        """A new segment starts at every entry into a world; rank 0 (perhaps a new one) opens it."""
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self.rank == 0:
            self._open_metrics(restored_step)
        else:
            self.events = EventsFile(None)

    def _collective_broke(self, exc: BaseException, step: Step | None, group_error: bool) -> None:
        """A collective failed: in live mode, regroup (giving ``step`` up), else raise ``exc``.

        ``group_error``: the error came from the training group, so it is known to be a broken group; any
        other error is taken for one only if the agent announces a regroup within the regroup timeout.
        """
        if self.live is None or (group_error and not self.live.group.broken.is_set()):
            raise exc
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
        if notice is None or notice.generation is None or (ours is not None and notice.generation <= ours):
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

    def _regroup_due(self, live: LiveMember) -> bool:
        """At a step boundary: whether to move to the next round now.

        When the step's gradient sync carried the flags, every rank decides alike: all move once any rank's
        agent announced a round, finishing the step in flight (a node joined: every collective completes);
        a round that lost a member is taken at once (its group is broken: the next collective would fail)."""
        notice = live.pending_notice()
        agreed = self._step_flags.agreed()
        if agreed is not None and _REGROUP in agreed:
            return agreed[_REGROUP] or (notice is not None and not notice.no_departure)
        if notice is None:
            return False
        # No sync carried the flags (the first step in a group): alone, or with a member gone, move now; with
        # every member staying, wait for the next step's sync (a peer may be inside a collective with us).
        return not notice.no_departure or self.world_size == 1

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
        )
        self._leave_world()
        for attempt in range(1, 11):
            try:
                self.env = live.move_to(notice)
                self._enter_world(has_state=True, started=started)
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
        self.model = self.module
        self.optimizer.zero_grad(set_to_none=True)
        if self.live is not None:
            self.live.group.leave()
        lifecycle(
            "world_left",
            checkpointer_s=round(checkpointer_s, 3),
            took_s=round(time.monotonic() - started, 3),
        )
