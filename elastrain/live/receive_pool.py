"""Memory a new member makes ready while it waits for its round, for the optimizer state it will receive.

A warm worker (a joiner, a spare) waits seconds to minutes for its first round and then receives the agreed
state. Its model is built, but its optimizer has no state yet: the state arrives into new memory, and on CPU
every page of it is first touched by the kernel's socket copy, several times slower than a page touched in user
space (``bench/state_transfer.py``: 210 MB of AdamW state took 0.59 s of system time received into untouched
pages, and the stream moves at the wire's speed into memory already touched). So while it waits, the worker
allocates and touches the tensors its optimizer will hold, shaped like its parameters, and the transfer receives
into them (:func:`elastrain.live.transfer.send_state`, ``pool=``): they become the optimizer's own tensors, not
views of a larger block. What the transfer does not use is freed with the pool.

Only for optimizers whose state is known: torch's Adam family keeps two tensors per parameter, shaped like it
(``exp_avg`` and ``exp_avg_sq``; Adamax ``exp_inf``). For any other optimizer the pool is empty and the state is
received into new memory, touched piece by piece just before its piece arrives.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from elastrain.log import lifecycle

_ADAM_FAMILY: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adamax,
)
"""Optimizers that keep two state tensors per parameter, each of the parameter's shape, dtype and device."""

_Key = tuple[tuple[int, ...], torch.dtype, torch.device]


def state_tensors_per_parameter(optimizer_class: type) -> int:
    """Pure: how many tensors shaped like each parameter an optimizer of this class keeps as its state (0: not
    known)."""
    return 2 if isinstance(optimizer_class, type) and issubclass(optimizer_class, _ADAM_FAMILY) else 0


class ReceivePool:
    """Touched tensors by shape, dtype and device, each handed out once (:meth:`take`)."""

    def __init__(self, tensors: list[torch.Tensor] | None = None) -> None:
        self._free: dict[_Key, list[torch.Tensor]] = defaultdict(list)
        for t in tensors or []:
            self._free[_key(tuple(t.shape), t.dtype, t.device)].append(t)

    @classmethod
    def for_optimizer(cls, optimizer: torch.optim.Optimizer) -> ReceivePool:
        """Tensors for the state ``optimizer`` will receive, allocated and touched now. Empty for an optimizer
        that holds state already (it receives into its own) or whose state is not known."""
        if optimizer.state:
            return cls()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return cls.for_parameters(params, type(optimizer))

    @classmethod
    def for_parameters(cls, params: list[torch.Tensor], optimizer_class: type) -> ReceivePool:
        """Tensors for the state an optimizer of ``optimizer_class`` over ``params`` will receive (an optimizer
        not made yet: the Trainer's), allocated and touched now; CPU parameters only (device memory has no pages
        to touch)."""
        copies = state_tensors_per_parameter(optimizer_class)
        params = [p for p in params if p.device.type == "cpu" and p.requires_grad]
        if copies == 0 or not params:
            return cls()
        started = time.monotonic()
        pool = cls([torch.zeros_like(p, memory_format=torch.contiguous_format) for p in params for _ in range(copies)])
        lifecycle(
            "receive_pool_ready",
            tensors=len(params) * copies,
            bytes=pool.bytes,
            took_s=round(time.monotonic() - started, 3),
        )
        return pool

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """A touched tensor of this shape, dtype and device, never handed out before; None when none is left."""
        free = self._free.get(_key(shape, dtype, device))
        return free.pop() if free else None

    def left(self) -> list[torch.Tensor]:
        """The tensors not handed out yet."""
        return [t for ts in self._free.values() for t in ts]

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.left())

    def clear(self) -> None:
        """Free what was not handed out."""
        self._free.clear()


def _key(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> _Key:
    return (shape, dtype, torch.device("cpu") if device.type == "cpu" else device)
