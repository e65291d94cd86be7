"""A Trainer worker's live membership (``elastrain-run``'s live mode): one per process.

The Trainer builds its process group through accelerate when the script first asks for a device
(``TrainingArguments.device``). Under elastrain-run in live mode that group is the current round's
:class:`~elastrain.live.group.TrainingGroup` instead, whose collectives a watchdog can give up and which a
regroup replaces in place (accelerate adopts it: its view is made again once the worker joined).

Every worker joins its first round in ``trainer.train()``, not before: the script runs to it on a
provisional one-process setup (:func:`provisional_environ`). A *warm* worker (started before its node
joined a round, so that the imports, the model and the data are ready when the node joins) has no round
yet and waits there for the agent's first notice. A *cold* one (a worker restarted into a round whose other
members train on in place) would otherwise meet them in its script's own setup collectives
(``main_process_first``'s barriers around the dataset map), which they never run; instead they wait for it
in the round's group join, bounded by the regroup timeout (which allows for a cold start). In the job's first
round, whose members all run the script from the top, an ``evaluate()`` or ``predict()`` before ``train()`` joins
it too (an evaluation-only script evaluates over the round, as under torchrun).

A Trainer that cannot regroup in place (:func:`restart_only`: DeepSpeed, FSDP, ``auto_find_batch_size``) joins when
the script first asks for a device, as in restart mode; a warm one ends there (``event=trainer_warm_unsupported``),
and its agent starts the workers after the rendezvous from then on.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from elastrain.env import WorkerEnv
from elastrain.live.member import LiveMember
from elastrain.live.receive_pool import ReceivePool
from elastrain.log import lifecycle
from elastrain.session.regroup import REGROUP_FLAG
from elastrain.step_flags import StepFlags

WARM_UNSUPPORTED_EXIT = 3
"""A warm worker of a Trainer that cannot regroup in place ends with this: its agent starts it after the rendezvous."""

# What tells accelerate (and torch) that a process is one of several: hidden while a warm worker sets up.
_DISTRIBUTED_VARIABLES = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextmanager
def provisional_environ() -> Iterator[None]:
    """While a warm worker's script sets up its device: the environment of a single process."""
    saved = {name: os.environ.pop(name) for name in _DISTRIBUTED_VARIABLES if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def restart_only(args: Any) -> str | None:
    """Why a Trainer with these ``TrainingArguments`` cannot regroup in place (its workers restart at every change,
    as under ``--live false``), or None. What accelerate reads: the arguments, or accelerate's own launch variables."""
    from accelerate.utils import parse_flag_from_env

    if args.deepspeed or parse_flag_from_env("ACCELERATE_USE_DEEPSPEED"):
        return "DeepSpeed"
    if args.fsdp or parse_flag_from_env("ACCELERATE_USE_FSDP"):
        return "FSDP"
    if args.auto_find_batch_size:
        return "auto_find_batch_size"
    return None


def backend_for(args: Any) -> str:
    """The process group's backend for a Trainer with these ``TrainingArguments``: gloo on CPU, else NCCL."""
    import torch

    return "gloo" if args.use_cpu or not torch.cuda.is_available() else "nccl"


def live_mode(env: WorkerEnv) -> bool:
    """Whether this worker regroups in place: elastrain-run's live mode, and no process group of the script's own."""
    import torch.distributed as dist

    return env.live and env.under_elastrain and bool(env.control_dir) and not dist.is_initialized()


class TrainerMembership:
    """The round this process trains in, its training group, and the step flags that carry "regroup now"."""

    _process: TrainerMembership | None = None

    def __init__(self, env: WorkerEnv) -> None:
        self.env = env
        self.member: LiveMember | None = None
        self.flags = StepFlags()
        self.warm = env.warm
        """True until a warm worker is given its first round."""
        self.trainings = 0
        """How many ``train()`` calls this worker began: a script may train one model after another."""

    @classmethod
    def of_process(cls) -> TrainerMembership | None:
        """This process's membership in live mode (made on first use), else None (restart mode)."""
        if cls._process is None:
            env = WorkerEnv.from_environ()
            if not live_mode(env):
                return None
            cls._process = cls(env)
        return cls._process

    @property
    def joined(self) -> bool:
        return self.member is not None and self.member.group.round is not None

    def await_round(self, backend: str, prepare: Callable[[], ReceivePool | None] | None = None) -> LiveMember:
        """This worker's round: a warm one waits for it (its agent's first notice). ``prepare``: a warm worker's
        memory for the state it will receive, made ready before it waits."""
        member = self._member(backend)
        if self.warm:
            self.env = member.await_round(prepare=prepare)
            self.warm = False
        return member

    def in_first_round(self, backend: str) -> bool:
        """Whether this worker's round is the job's first, whose every member runs its script from the top. A warm
        worker whose agent saw no round formed waits here for its round, or for word that the job formed without
        its node (then it stays warm, and waits for its round where it trains; so does one whose agent saw a round
        formed)."""
        if self.warm and (env := self._member(backend).await_first_round()) is not None:
            self.env, self.warm = env, False
        return not self.warm and self.env.first_round

    def _member(self, backend: str) -> LiveMember:
        if self.member is None:
            self.member = LiveMember(self.env, backend)
            member = self.member
            self.flags.add(REGROUP_FLAG, lambda: member.pending_notice() is not None)
            # Before the interpreter finalises: the watchdog stopped, left groups freed (pytorch#179291).
            atexit.register(member.close)
        return self.member

    def join(
        self, backend: str, prepare: Callable[[], ReceivePool | None] | None = None, compiles: bool = False
    ) -> None:
        """Join the round this worker was started into (collective over its members); no-op once joined.
        ``compiles``: the model is compiled (``--torch_compile``): each new world's first step waits longer."""
        member = self.await_round(backend, prepare)
        member.group.compiles = compiles
        if member.group.round is None:
            member.join_first()
            lifecycle("trainer_group_joined", round=member.round, rank=self.env.rank, world=self.env.world_size)

    def require(self) -> LiveMember:
        if self.member is None:
            raise RuntimeError("internal: the Trainer's live membership is used before it joined a round")
        return self.member
