"""What a checkpoint holds: the registered model, optimizer and other ``Stateful`` objects.

Model and optimizer go through :func:`torch.distributed.checkpoint.state_dict.get_state_dict` /
``set_state_dict``, whose keys are parameter names independent of the parallelism (plain, DDP,
FSDP2), which is what lets a checkpoint load at another world size. Every other object only needs
``state_dict()`` / ``load_state_dict()``; its tensors go to DCP and its plain data to JSON.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from elastrain.checkpoint.codec import join_state, split_state
from elastrain.errors import CheckpointError, CheckpointMismatchError

MODEL = "model"
OPTIMIZER = "optimizer"


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


class Registry:
    """The objects one checkpointer saves, by name."""

    def __init__(self) -> None:
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.others: dict[str, Stateful] = {}

    def register(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **others: Any,
    ) -> None:
        if optimizer is not None and model is None and self.model is None:
            raise CheckpointError("register(optimizer=...) needs the model too: register(model=..., optimizer=...)")
        if model is not None:
            self.model = model
        if optimizer is not None:
            self.optimizer = optimizer
        for name, obj in others.items():
            if obj is None:
                continue
            if name in (MODEL, OPTIMIZER):
                raise CheckpointError(f"register(): the name {name!r} is reserved; pass it as model=/optimizer=")
            if not isinstance(obj, Stateful):
                raise CheckpointError(
                    f"register({name}=...): a {type(obj).__name__} has no state_dict()/load_state_dict(); "
                    "make it a torch.distributed.checkpoint.stateful.Stateful"
                )
            self.others[name] = obj

    @property
    def names(self) -> list[str]:
        names = [MODEL] if self.model is not None else []
        if self.optimizer is not None:
            names.append(OPTIMIZER)
        return names + list(self.others)

    def collect(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The current state as ``(tensors, plain)``; the tensors alias live parameters (stage before async use)."""
        state: dict[str, Any] = {}
        if self.model is not None:
            optims = [self.optimizer] if self.optimizer is not None else []
            model_sd, optim_sd = get_state_dict(self.model, optims)
            state[MODEL] = model_sd
            if self.optimizer is not None:
                state[OPTIMIZER] = optim_sd
        for name, obj in self.others.items():
            state[name] = obj.state_dict()
        return split_state(state)

    def apply(self, saved_plain: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], where: str) -> None:
        """Load ``saved_plain`` (the checkpoint's JSON tree) joined with the loaded ``tensors`` into every object."""
        missing = [n for n in self.names if n not in saved_plain]
        if missing:
            raise CheckpointMismatchError(
                f"{where} has no state for {', '.join(missing)} "
                f"(saved: {', '.join(sorted(saved_plain)) or 'nothing'}); "
                "register the same objects that were saved, or start a fresh --checkpoint-dir"
            )
        state = {name: join_state(saved_plain[name], tensors) for name in self.names}
        if self.model is not None:
            optims = [self.optimizer] if self.optimizer is not None else []
            set_state_dict(
                self.model,
                optims,
                model_state_dict=state[MODEL],
                optim_state_dict=state.get(OPTIMIZER, {}),
            )
        for name, obj in self.others.items():
            obj.load_state_dict(state[name])
