"""The Session's settings: one frozen, validated :class:`SessionConfig`, grouped by the part that uses them.

A script passes them as keywords (``Session(model, opt, data, global_batch=64, max_steps=1000)``) or
builds the config once and passes it (``Session(model, opt, data, config=cfg)``). Either way every
value is checked before anything starts, and a bad one is refused with one line naming the setting:
``Session(save_every_steps=0): must be >= 1``. The batch settings are
:class:`~elastrain.scaling.ScalingConfig`'s (which checks them itself).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, TypedDict, TypeVar, Unpack

import torch

from elastrain.data import EpochEnd
from elastrain.errors import CheckpointError
from elastrain.live.sharded import ShardFn
from elastrain.scaling import Policy, ScalingConfig, Schedule
from elastrain.session.errors import SessionConfigError
from elastrain.storage import local_path

OnSaveError = Literal["raise", "warn"]
_E = TypeVar("_E", Policy, EpochEnd)


@dataclass(frozen=True)
class DataConfig:
    """How the session reads the dataset (:class:`~elastrain.session.feed.Feed`)."""

    collate_fn: Callable[[list[Any]], Any] | None = None
    num_workers: int = 0
    pin_memory: bool = False
    seed: int = 0
    shuffle: bool = True
    epoch_end: EpochEnd = EpochEnd.PARTIAL
    token_count: Callable[[Any], int] | None = None
    """``token_count(batch)``: normalise the loss by tokens instead of samples (one scalar all-reduce per step)."""


@dataclass(frozen=True)
class CheckpointSettings:
    """When and where the session's :class:`~elastrain.checkpoint.Checkpointer` saves."""

    directory: str | None = None
    """``checkpoint_dir``; None: the launcher's ``--checkpoint-dir`` (or no checkpoints)."""
    save_every_steps: int | None = None
    save_every_seconds: float | None = None
    keep_last: int = 3
    async_save: bool = True
    on_save_error: OnSaveError = "raise"
    """A failed save stops the run (``raise``) or is only logged (``warn``)."""


@dataclass(frozen=True)
class OutputConfig:
    """Where rank 0 writes ``metrics.jsonl``/``events.jsonl`` (default: the checkpoint directory) and TensorBoard."""

    metrics_dir: str | None = None
    tensorboard_dir: str | None = None


@dataclass(frozen=True)
class RuntimeConfig:
    """Where the model runs (:class:`~elastrain.session.runtime.Runtime`)."""

    ddp: bool = True
    ddp_kwargs: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    device: torch.device | None = None
    """None: ``cuda:<local_rank>`` when CUDA is available, else the CPU."""
    shard: ShardFn | None = None
    """``shard(module, mesh)``: shard the model (FSDP2's ``fully_shard`` calls) instead of wrapping it in DDP. The
    session calls it in every world, on that world's mesh (:mod:`elastrain.live.sharded`); pass the model unsharded."""
    overlap_state_transfer: bool = True
    """Live mode on gloo: the members that receive the state (a joiner, a promoted spare, a member rolled back) sit
    the new world's first step out while the whole state streams to them, and the members that hold it compute that
    step alone (:mod:`elastrain.session.catch_up`; a rank that sits a step out runs no micro-batch of it). Where DDP
    syncs more than gradients (module buffers broadcast, ``find_unused_parameters``, ``static_graph``), the model
    arrives before the step and only the optimizer's state streams while it runs. False: the whole state arrives
    before the step (nothing to share the CPU or the wire with)."""
    catch_up_phase_bytes: int | None = None
    """About how many bytes of state each step of a catch-up carries (None: all of it in the first step): a larger
    state arrives over several steps (at most :data:`~elastrain.live.phases.MAX_PHASES`), a run of parameters per
    step, and the members that receive it sit them all out (:mod:`elastrain.live.phases`; torch's per-parameter
    optimizers only). For a state whose transfer takes longer than a step (a slow network between nodes): the
    running workers then wait for no more than one step can carry, and a joiner helps that many steps later."""


@dataclass(frozen=True)
class SessionConfig:
    """Every setting of a :class:`~elastrain.session.Session`; build it with :meth:`of` (it validates)."""

    scaling: ScalingConfig
    max_steps: int | None = None
    epochs: int | None = None
    lr_schedule: Schedule | None = None
    """Maps samples consumed to a multiplier on each parameter group's initial LR."""
    data: DataConfig = DataConfig()
    checkpoint: CheckpointSettings = CheckpointSettings()
    output: OutputConfig = OutputConfig()
    runtime: RuntimeConfig = RuntimeConfig()

    def __post_init__(self) -> None:
        if self.max_steps is None and self.epochs is None:
            raise SessionConfigError("max_steps", "give max_steps or epochs: it says when training ends")
        _at_least("max_steps", self.max_steps, 0)
        _at_least("epochs", self.epochs, 1)
        data, ckpt, out = self.data, self.checkpoint, self.output
        _at_least("num_workers", data.num_workers, 0)
        _at_least("seed", data.seed, None)
        _at_least("save_every_steps", ckpt.save_every_steps, 1)
        _at_least("catch_up_phase_bytes", self.runtime.catch_up_phase_bytes, 1)
        _at_least("keep_last", ckpt.keep_last, 1)
        for name, flag in (
            ("pin_memory", data.pin_memory),
            ("shuffle", data.shuffle),
            ("async_save", ckpt.async_save),
            ("ddp", self.runtime.ddp),
        ):
            if not isinstance(flag, bool):
                raise SessionConfigError(name, f"must be True or False, got {flag!r}")
        for name, where in (
            ("checkpoint_dir", ckpt.directory),
            ("metrics_dir", out.metrics_dir),
            ("tensorboard_dir", out.tensorboard_dir),
        ):
            if where is not None and not isinstance(where, str):
                raise SessionConfigError(name, f"must be a path (a string), got {where!r}")
        seconds = ckpt.save_every_seconds
        if seconds is not None:
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
                raise SessionConfigError("save_every_seconds", f"must be a number of seconds, got {seconds!r}")
            if not seconds > 0:
                raise SessionConfigError("save_every_seconds", f"must be > 0, got {seconds!r}")
        if not isinstance(self.runtime.ddp_kwargs, Mapping):
            raise SessionConfigError(
                "ddp_kwargs", f"must be a dict of DDP's keyword arguments, got {self.runtime.ddp_kwargs!r}"
            )
        if ckpt.on_save_error not in ("raise", "warn"):
            raise SessionConfigError("on_save_error", f"must be 'raise' or 'warn', got {ckpt.on_save_error!r}")
        for name, fn in (("collate_fn", data.collate_fn), ("token_count", data.token_count)):
            if fn is not None and not callable(fn):
                raise SessionConfigError(name, f"must be callable, got {type(fn).__name__}")
        if self.runtime.shard is not None and not callable(self.runtime.shard):
            raise SessionConfigError("shard", f"must be a function shard(module, mesh), got {self.runtime.shard!r}")
        if self.lr_schedule is not None and not callable(self.lr_schedule):
            raise SessionConfigError("lr_schedule", f"must map samples seen to a multiplier, got {self.lr_schedule!r}")

    @classmethod
    def of(cls, **settings: Unpack[SessionSettings]) -> SessionConfig:
        """The config for :class:`~elastrain.session.Session`'s keyword settings (unknown names are refused)."""
        known = SessionSettings.__annotations__
        for name in settings:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise SessionConfigError(name, f"no such setting{hint}")
        s: dict[str, Any] = dict(settings)
        for name in ("global_batch", "reference_world_size"):
            _at_least(name, s.get(name), None)  # their ranges are the scaling config's to check
        for name in ("micro_batch", "accumulation", "rescale_warmup_steps"):
            _at_least(name, s.get(name, 0), None)
        ddp_kwargs = s.get("ddp_kwargs") or {}
        if not isinstance(ddp_kwargs, Mapping):
            raise SessionConfigError("ddp_kwargs", f"must be a dict of DDP's keyword arguments, got {ddp_kwargs!r}")
        return cls(
            scaling=ScalingConfig(
                policy=_enum(Policy, "policy", s.get("policy", Policy.CONSTANT)),
                global_batch=s.get("global_batch"),
                micro_batch=s.get("micro_batch", 1),
                accumulation=s.get("accumulation", 1),
                reference_world_size=s.get("reference_world_size"),
                rescale_warmup_steps=s.get("rescale_warmup_steps", 0),
            ),
            max_steps=s.get("max_steps"),
            epochs=s.get("epochs"),
            lr_schedule=s.get("lr_schedule"),
            data=DataConfig(
                collate_fn=s.get("collate_fn"),
                num_workers=s.get("num_workers", 0),
                pin_memory=s.get("pin_memory", False),
                seed=s.get("seed", 0),
                shuffle=s.get("shuffle", True),
                epoch_end=_enum(EpochEnd, "epoch_end", s.get("epoch_end", EpochEnd.PARTIAL)),
                token_count=s.get("token_count"),
            ),
            checkpoint=CheckpointSettings(
                directory=_path_or_none("checkpoint_dir", s.get("checkpoint_dir")),
                save_every_steps=s.get("save_every_steps"),
                save_every_seconds=s.get("save_every_seconds"),
                keep_last=s.get("keep_last", 3),
                async_save=s.get("async_save", True),
                on_save_error=s.get("on_save_error", "raise"),
            ),
            output=OutputConfig(
                metrics_dir=_path_or_none("metrics_dir", s.get("metrics_dir")),
                tensorboard_dir=_path_or_none("tensorboard_dir", s.get("tensorboard_dir")),
            ),
            runtime=RuntimeConfig(
                ddp=s.get("ddp", True),
                ddp_kwargs=MappingProxyType(dict(ddp_kwargs)),
                device=_device(s.get("device")),
                shard=s.get("shard"),
                overlap_state_transfer=bool(s.get("overlap_state_transfer", True)),
                catch_up_phase_bytes=s.get("catch_up_phase_bytes"),
            ),
        )


class SessionSettings(TypedDict, total=False):
    """The keyword settings of :class:`~elastrain.session.Session` (each documented on the config part that
    holds it: :class:`~elastrain.scaling.ScalingConfig`, :class:`DataConfig`, :class:`CheckpointSettings`,
    :class:`OutputConfig`, :class:`RuntimeConfig`)."""

    global_batch: int | None
    micro_batch: int
    policy: Policy | str
    accumulation: int
    reference_world_size: int | None
    rescale_warmup_steps: int
    lr_schedule: Schedule | None
    max_steps: int | None
    epochs: int | None
    collate_fn: Callable[[list[Any]], Any] | None
    num_workers: int
    pin_memory: bool
    seed: int
    shuffle: bool
    epoch_end: EpochEnd | str
    token_count: Callable[[Any], int] | None
    checkpoint_dir: str | None
    save_every_steps: int | None
    save_every_seconds: float | None
    keep_last: int
    async_save: bool
    on_save_error: OnSaveError
    metrics_dir: str | None
    tensorboard_dir: str | None
    ddp: bool
    ddp_kwargs: Mapping[str, Any] | None
    device: torch.device | str | None
    shard: ShardFn | None
    overlap_state_transfer: bool
    catch_up_phase_bytes: int | None


def _at_least(name: str, value: Any, low: int | None) -> None:
    """``value`` is None or an integer (not a bool) of at least ``low`` (any integer when ``low`` is None)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise SessionConfigError(name, f"must be an integer, got {value!r}")
    if low is not None and value < low:
        raise SessionConfigError(name, f"must be >= {low}, got {value}")


def _enum(kind: type[_E], name: str, value: Any) -> _E:
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in kind)
        raise SessionConfigError(name, f"must be one of {choices}, got {value!r}") from None


def _path_or_none(name: str, value: Any) -> str | None:
    """A path setting: None or "" (the default), a string or a path; a ``file://`` URL as the local path it names."""
    if value is None or value == "":
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise SessionConfigError(name, f"must be a path (a string), got {value!r}")
    try:
        return local_path(value)
    except CheckpointError as exc:
        raise SessionConfigError(name, str(exc)) from None


def _device(value: Any) -> torch.device | None:
    if value is None:
        return None
    try:
        return torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise SessionConfigError("device", f"not a torch device: {value!r} ({exc})") from None
