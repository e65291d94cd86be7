"""Memory a new member makes ready while it waits for its round, for the optimizer state it will receive.

A warm worker (a joiner, a spare) waits seconds to minutes for its first round and then receives the agreed
state. Its model is built, but its optimizer has no state yet: the state arrives into new memory, and on CPU
every page of it is first touched by the kernel's socket copy, several times slower than a page touched in user
space (``bench/state_transfer.py``: 210 MB of AdamW state took 0.59 s of system time received into untouched
pages, and the stream moves at the wire's speed into memory already touched). So while it waits, the worker
allocates the tensors its optimizer will hold, shaped like its parameters, a thread touches them, and the
transfer receives into them (:func:`elastrain.live.transfer.send_state`, ``pool=``): they become the optimizer's
own tensors, not views of a larger block. The worker says it is warm only once the thread is done (bounded:
:meth:`elastrain.live.member.LiveMember.await_round`); should the round come first all the same, the transfer stops
the thread and touches the rest piece by piece. What the transfer does not use is freed with the pool.

The same goes for the gradients of a new member's first backward (``gradients=True``): written for the first time
in that backward, on this machine their page faults made a joiner's first step seconds slower at 250M parameters,
and the running workers wait for it at the step's all-reduce. So the pool gives each parameter that has no gradient
a zeroed one, on the calling thread (the training thread: glibc gives each thread its own arena, and the gradients,
freed by the loop's ``zero_grad``, are what that thread's next backward allocates its own from); the first backward
accumulates into it (0 + g is g, exactly). When the state comes from a checkpoint instead, the gradients are taken
back (:meth:`ReceivePool.take_back_gradients`): torch's ``get_state_dict`` makes an empty optimizer's state (for the
checkpoint to load into) only while no parameter has a gradient.

Only for optimizers whose state is known: torch's Adam family keeps two tensors per parameter, shaped like it
(``exp_avg`` and ``exp_avg_sq``; Adamax ``exp_inf``). For any other optimizer the pool is empty and the state is
received into new memory, touched piece by piece just before its piece arrives.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass

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
    """Tensors by shape, dtype and device, each handed out once (:meth:`take`), touched by a thread of their own
    until the transfer needs them (:meth:`stop`; a warm worker waits for it, bounded, before it says it is warm)."""

    def __init__(
        self,
        tensors: list[torch.Tensor] | None = None,
        touch: bool = False,
        gradients: list[torch.Tensor] | None = None,
    ) -> None:
        self._free: dict[_Key, list[_Pooled]] = defaultdict(list)
        self._order = [_Pooled(t, touched=not touch) for t in tensors or []]
        self._given: list[tuple[torch.Tensor, torch.Tensor]] = []
        """(parameter, gradient) the pool gave: :meth:`take_back_gradients` undoes it."""
        for param in (gradients or []) if touch else []:
            if param.grad is None:
                grad = torch.zeros_like(param, memory_format=torch.contiguous_format)
                param.grad = grad
                self._given.append((param, grad))
        for pooled in self._order:
            t = pooled.tensor
            self._free[_key(tuple(t.shape), t.dtype, t.device)].append(pooled)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if touch and self._order:
            self._thread = threading.Thread(target=self._touch_all, name="elastrain-receive-pool", daemon=True)
            self._thread.start()

    @classmethod
    def for_optimizer(cls, optimizer: torch.optim.Optimizer, gradients: bool = False) -> ReceivePool:
        """Tensors for the state ``optimizer`` will receive, touched from now on. Empty for an optimizer that holds
        state already (it receives into its own) or whose state is not known. ``gradients``: its parameters'
        gradients made too (the first backward's), at once on the calling thread (for a loop whose first backward
        comes after the pool is stopped: the Session's)."""
        if optimizer.state:
            return cls()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return cls.for_parameters(params, type(optimizer), gradients)

    @classmethod
    def for_parameters(cls, params: list[torch.Tensor], optimizer_class: type, gradients: bool = False) -> ReceivePool:
        """Tensors for the state an optimizer of ``optimizer_class`` over ``params`` will receive (an optimizer
        not made yet: the Trainer's), touched from now on; CPU parameters only (device memory has no pages to
        touch). ``gradients``: see :meth:`for_optimizer`."""
        copies = state_tensors_per_parameter(optimizer_class)
        params = [p for p in params if p.device.type == "cpu" and p.requires_grad]
        made = [torch.empty_like(p, memory_format=torch.contiguous_format) for p in params for _ in range(copies)]
        if not made and not gradients:
            return cls()
        return cls(made, touch=True, gradients=params if gradients else None)

    def _touch_all(self) -> None:
        started = time.monotonic()
        done = 0
        for pooled in self._order:
            if self._stop.is_set():
                break
            pooled.tensor.zero_()  # maps its pages (torch lets go of the GIL meanwhile)
            pooled.touched = True
            done += 1
        lifecycle(
            "receive_pool_touched",
            tensors=f"{done}/{len(self._order)}",
            bytes=sum(p.tensor.numel() * p.tensor.element_size() for p in self._order[:done]),
            gradients=len(self._given) or None,
            gradient_bytes=sum(g.numel() * g.element_size() for _, g in self._given) or None,
            took_s=round(time.monotonic() - started, 3),
        )

    def ready(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) for the thread to touch every tensor (and make every gradient); whether
        it did."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                return False
        return all(p.touched for p in self._order)

    def stop(self, timeout_s: float = 30.0) -> None:
        """The transfer starts: the touching ends after the tensor at hand (bounded wait); what it did not reach
        is touched piece by piece as it is received."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():  # a tensor so large that touching it outlasts the bound: leave it be
                self._free.clear()
            self._thread = None

    def take(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, bool] | None:
        """A tensor of this shape, dtype and device never handed out before, and whether it was touched; None
        when none is left. After :meth:`stop`."""
        if self._thread is not None:
            raise RuntimeError("internal: ReceivePool.take before stop()")
        free = self._free.get(_key(shape, dtype, device))
        if not free:
            return None
        pooled = free.pop()
        return pooled.tensor, pooled.touched

    def take_back_gradients(self) -> None:
        """The state comes from a checkpoint, not a peer: the gradients the thread gave are set back to None (torch's
        ``get_state_dict`` builds an empty optimizer's state with a zero-gradient step only while no parameter has a
        gradient, and a checkpoint's optimizer state loads into that). A gradient changed since is left alone."""
        self.stop()
        for param, grad in self._given:
            if param.grad is grad:
                param.grad = None
        self._given = []

    def left(self) -> list[torch.Tensor]:
        """The tensors not handed out yet."""
        return [p.tensor for ps in self._free.values() for p in ps]

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.left())

    def close(self) -> None:
        """Stop touching and free what was not handed out."""
        self.stop()
        self._free.clear()
        self._order = []
        self._given = []


@dataclass
class _Pooled:
    tensor: torch.Tensor
    touched: bool


def _key(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> _Key:
    return (shape, dtype, torch.device("cpu") if device.type == "cpu" else device)
