"""A lost step's forward pass stops between two of the model's blocks once the round is broken (live mode).

When a member is gone (the agent's notice; the watchdog severs the round: :mod:`elastrain.live.group`), the step in
flight can never complete: its gradients' all-reduce lost a member. Its backward stops at the next gradient bucket
(:meth:`~elastrain.live.group.TrainingGroup.comm_hook`); a notice that comes during the forward pass let the forward run
to its end first (measured with a GPT-2 of 101.9M parameters: 0.4 s of a 4.6 s step, before a backward that stopped at
once). While ``Trainer.train()`` runs, each block of the model's stacks (the members of its ``ModuleList``s: a
transformer's layers) asks before its forward whether the round is broken, and raises
:class:`~elastrain.live.group.GroupBrokenError` if so: ``train()`` is left as when a collective breaks, and the worker
regroups. One ``Event.is_set`` per block and forward; none under ``torch.compile`` (a hook that reads another thread's
flag would break its graph).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from elastrain.live.group import GroupBrokenError


def blocks_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The members of every ``ModuleList`` in ``model``: its stacks of blocks, where a forward pass can stop."""
    return [block for stack in model.modules() if isinstance(stack, torch.nn.ModuleList) for block in stack]


@contextlib.contextmanager
def forward_stops(model: torch.nn.Module, broken: Callable[[], bool]) -> Iterator[None]:
    """While inside: each of ``model``'s blocks raises :class:`GroupBrokenError` before its forward once ``broken()``
    (the training group's ``broken.is_set``) says so. The hooks are gone on leaving."""

    def check(module: torch.nn.Module, args: Any) -> None:
        if broken():
            raise GroupBrokenError("the round is broken: the lost step's forward pass stops at its next block")

    handles = [block.register_forward_pre_hook(check) for block in blocks_of(model)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
