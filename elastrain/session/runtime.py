"""Where the session's model runs: the device, the process group (the launcher's, or the live round's) and DDP.

In restart mode the process group is the one torch's environment describes (the session starts it with
the launcher's collective timeout, or uses the script's own). Under ``elastrain-run --live true`` it is
the current round's :class:`~elastrain.live.group.TrainingGroup`, which a regroup replaces; the DDP
wrapper is bound to a group, so it is rebuilt at every entry into a world (:meth:`Runtime.wrap`) and
routes its gradient all-reduce through the group's comm hook, which the watchdog can give up.
Either way the step's control flags ride on the last gradient bucket (:mod:`elastrain.step_flags`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from elastrain.env import WorkerEnv
from elastrain.live.group import is_compiled
from elastrain.live.member import LiveMember
from elastrain.live.receive_pool import ReceivePool
from elastrain.live.sharded import ShardedModel, parameter_names, repoint_optimizer
from elastrain.session.catch_up import CatchUp, eligible, sync_idle, worth_it
from elastrain.session.config import RuntimeConfig
from elastrain.step_flags import StepFlags, flagged_allreduce


class Runtime:
    """The device, the process group and the (DDP-wrapped) model of one worker; rank and world size current."""

    def __init__(self, module: torch.nn.Module, config: RuntimeConfig, env: WorkerEnv, flags: StepFlags) -> None:
        self.module = module
        """The script's model, never wrapped."""
        self.model: torch.nn.Module = module
        """What the loop calls: the module, or DDP around it over the current group."""
        self.config = config
        self.flags = flags
        self.device = config.device if config.device is not None else _default_device(env)
        self.rank = env.rank
        self.world_size = env.world_size
        self.distributed = False
        self.live: LiveMember | None = None
        """Set under ``--live true``: this process's membership of the current round."""
        self.sharded = ShardedModel(module, config.shard) if config.shard is not None else None
        """With ``shard=``: the model is sharded anew in every world (no DDP; its state comes from checkpoints)."""
        self.catch_up: CatchUp | None = None
        """The world's first step when its needy members sit it out (:mod:`elastrain.session.catch_up`)."""
        self._owns_group = False
        self._replaced: list[weakref.ref[torch.nn.Module]] = []
        """The DDP wrappers dropped since :meth:`replaced_alive` last answered (weakly: they may be gone)."""

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    @staticmethod
    def live_mode(env: WorkerEnv) -> bool:
        """Whether the launcher asked for live regroups (and the script did not start a group of its own)."""
        return env.live and env.under_elastrain and bool(env.control_dir) and not dist.is_initialized()

    def start(self, env: WorkerEnv) -> None:
        """Restart mode: the launcher's process group (or the script's own), and the model on its device."""
        if dist.is_available() and dist.is_initialized():
            self.distributed = True
        elif env.world_size > 1 or env.under_elastrain:
            timeout = timedelta(seconds=env.collective_timeout_s) if env.collective_timeout_s else None
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            dist.init_process_group(backend=self.backend, timeout=timeout)
            self.distributed = self._owns_group = True
        self.refresh()
        self.module.to(self.device)

    def start_live(self, env: WorkerEnv, prepare: Callable[[], ReceivePool | None] | None = None) -> WorkerEnv:
        """Live mode: wait for a round if started warm (its memory made ready first: ``prepare``), join it; the
        worker's environment in that round."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.live = LiveMember(env, self.backend)
        self.live.group.compiles = is_compiled(self.module)
        if env.warm:  # built while the job trained without this node: now it may join a round
            env = self.live.await_round(prepare=prepare)
        self.live.join_first()
        self.distributed = self._owns_group = True
        self.refresh()
        self.module.to(self.device)
        return env

    def refresh(self) -> None:
        """Rank and world size from the current process group."""
        if self.distributed:
            self.world_size, self.rank = dist.get_world_size(), dist.get_rank()

    def shard(self, optimizer: torch.optim.Optimizer) -> None:
        """A sharded model's module for this world: sharded on its mesh (the script's own module in the first
        world, a fresh one after: uninitialised until the checkpoint loads), the optimizer pointed at it."""
        if self.sharded is None or not self.distributed:
            return  # one process: nothing to shard over
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        names = parameter_names(self.module)  # before fully_shard replaces the parameters
        self.module = self.model = self.sharded.build(self.module, mesh, self.device)
        repoint_optimizer(optimizer, names, self.module)

    def wrap(self, agree_saves: bool, in_sync: bool = False) -> None:
        """``model``: the module in DDP over the current group (when distributed and DDP is on).

        ``in_sync``: every rank's module already holds the same state (the members agreed on it and it was
        sent): DDP skips its own broadcast of the module from rank 0 (unless the script's ``ddp_kwargs`` say).

        The step flags ride on the last gradient bucket through the live group's hook, or, in restart mode,
        through :func:`~elastrain.step_flags.flagged_allreduce` when there are saves to agree on
        (``agree_saves``); without a checkpointer DDP keeps its own all-reduce."""
        if not (self.distributed and self.config.ddp) or self.sharded is not None:
            return
        ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = DistributedDataParallel(self.module, device_ids=ids, **ddp_kwargs(self.config.ddp_kwargs, in_sync))
        flags = self.flags
        # Lambdas: DDP rejects a hook whose annotations are strings (from __future__ import annotations).
        if self.live is not None:
            group = self.live.group

            def live_hook(state: object, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
                share = self.catch_up  # this step's contributors, read when the bucket is ready
                if share is None:
                    return group.comm_hook(state, bucket, flags)
                return group.comm_hook(state, bucket, flags, share.contributors, share.idle)

            ddp.register_comm_hook(None, lambda state, bucket: live_hook(state, bucket))
        elif agree_saves:
            hook = flagged_allreduce(flags)
            ddp.register_comm_hook(None, lambda state, bucket: hook(state, bucket))
        self.model = ddp

    def catch_up_for(
        self, holders: tuple[int, ...], needy: tuple[int, ...], agreed: int | None, trained_at: int | None = None
    ) -> CatchUp | None:
        """Whether the ``needy`` members sit the world's first step (after step ``agreed``) out while the whole state
        streams to them from the ``holders`` (:mod:`elastrain.session.catch_up`): the same answer on every member,
        from the agreement and the script's settings only."""
        config = self.config
        if agreed is None or not (needy and holders and self.backend == "gloo" and config.overlap_state_transfer):
            return None
        if not worth_it(len(holders), trained_at):  # fewer holders than trained the step: the state first
            return None
        if not config.ddp or self.sharded is not None or not eligible(self.module, config.ddp_kwargs):
            return None
        return CatchUp(holders, self.rank, agreed)

    def sit_out(self) -> None:
        """An idle member's part of the step's gradient all-reduce (:func:`~elastrain.session.catch_up.sync_idle`);
        nothing on a member that is not idle."""
        if self.catch_up is None or not self.catch_up.idle:
            return
        if not isinstance(self.model, DistributedDataParallel):
            raise RuntimeError("internal: a member sits a step out only in a DDP world")
        sync_idle(self.model)

    def unwrap(self) -> None:
        """Drop the DDP wrapper (bound to a group being left), and the catch-up of its world."""
        if self.model is not self.module:
            self._replaced.append(weakref.ref(self.model))
        self.model = self.module
        self.catch_up = None

    def replaced_alive(self) -> bool:
        """Whether a DDP wrapper dropped since the last call is still referenced (a broken collective's traceback
        holds it in a cycle): its reducer's autograd hooks would fire in the next backward until it is collected.
        A wrapper dropped with nothing referring to it is gone already (the reducer freed with it)."""
        alive = any(ref() is not None for ref in self._replaced)
        self._replaced = []
        return alive

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """A sum over the current group; in live mode one the watchdog can give up (``GroupBrokenError``)."""
        if self.live is not None:
            self.live.group.all_reduce(tensor)
        else:
            dist.all_reduce(tensor)

    def close(self) -> None:
        """Leave the live round and destroy the process group the session started (never the script's own)."""
        if self.live is not None:
            self.live.close()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False


DDP_BUCKET_CAP_MB = 25
"""DDP's own default bucket size."""


def ddp_kwargs(script: Mapping[str, Any], in_sync: bool) -> dict[str, Any]:
    """Pure: DDP's keyword arguments, the script's ``ddp_kwargs`` first.

    ``in_sync``: skip DDP's broadcast of the module (``init_sync=False``). Buckets: DDP (torch >= 2.9) puts the
    whole gradient in one bucket in its first iteration unless per-bucket caps are given, so that first step
    all-reduces it only after the whole backward; the session builds DDP anew in every live world, so it gives
    the caps (``bucket_cap_mb_list``: buckets of the script's ``bucket_cap_mb``, DDP's 25 MiB by default, from
    the first step on, rebuilt by the gradients' order after it as before)."""
    kwargs = dict(script)
    if in_sync:
        kwargs.setdefault("init_sync", False)
    if "bucket_cap_mb_list" not in kwargs:
        kwargs["bucket_cap_mb_list"] = [kwargs.get("bucket_cap_mb") or DDP_BUCKET_CAP_MB]
    return kwargs


def _default_device(env: WorkerEnv) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")
