"""Staging: the copy of the state that an asynchronous save writes while training goes on.

Parameters and optimizer state change only inside ``optimizer.step()``. So the training thread
copies just the rest (buffers, other objects' tensors) and the writer thread copies parameters and
optimizer state while the next step's forward and backward run; a pre-hook on the optimizer makes
the next ``step()`` wait until that copy is done. Training stalls only for what it must.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from elastrain.checkpoint.state import OPTIMIZER, Registry


def _ptr(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return int(local.data_ptr())


class Stager:
    """Copies state for async saves; one per checkpointer."""

    def __init__(self, registry: Registry, overlap: bool = True) -> None:
        self._registry = registry
        self._overlap = overlap
        self._now = DefaultStager(StagingOptions(False, False, False, False))
        self._later = DefaultStager(StagingOptions(False, False, False, False))  # used by the writer thread only
        self._done = threading.Event()
        self._done.set()
        self._hooked: torch.optim.Optimizer | None = None
        self._hook: RemovableHandle | None = None
        self.waited_s = 0.0  # how long optimizer.step() waited for the writer thread's copy, in total

    def _deferrable(self, tensors: dict[str, torch.Tensor]) -> set[str]:
        """Keys whose tensors only ``optimizer.step()`` changes: parameters and optimizer state."""
        model, opt = self._registry.model, self._registry.optimizer
        if not self._overlap or model is None or opt is None:
            return set()
        self._install_hook(opt)
        params = {_ptr(p) for p in model.parameters()}
        return {k for k, t in tensors.items() if k.startswith(f"{OPTIMIZER}/") or _ptr(t) in params}

    def _install_hook(self, opt: torch.optim.Optimizer) -> None:
        if self._hooked is opt:
            return
        if self._hook is not None:
            self._hook.remove()
        self._hooked = opt
        self._hook = opt.register_step_pre_hook(self._before_step)

    def _before_step(self, *_: Any) -> None:
        if not self._done.is_set():
            t0 = time.perf_counter()
            self._done.wait()
            self.waited_s += time.perf_counter() - t0

    def stage(self, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Training thread: ``(copied, deferred)``; pass ``deferred`` to :meth:`finish` on the writer thread."""
        later = self._deferrable(tensors)
        now = {k: t for k, t in tensors.items() if k not in later}
        copied: dict[str, torch.Tensor] = self._now.stage(now) if now else {}  # type: ignore[assignment]
        deferred = {k: tensors[k] for k in later}
        if deferred:
            self._done.clear()
        return copied, deferred

    def finish(self, copied: dict[str, torch.Tensor], deferred: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Writer thread: copy the deferred tensors, release ``optimizer.step()``; the full staged state."""
        try:
            if deferred:
                copied = {**copied, **self._later.stage(deferred)}  # type: ignore[dict-item]
            return copied
        finally:
            self._done.set()

    def release(self) -> None:
        """Never leave ``optimizer.step()`` blocked (a failed save)."""
        self._done.set()

    def close(self) -> None:
        self.release()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._now.close()
        self._later.close()
