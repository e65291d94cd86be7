"""The garbage collections around a live move of the Trainer: one full collection, not two.

Before the next world's first backward, the old world's DDP wrapper must be gone (its reducer's autograd hooks with
it). accelerate holds it until ``Accelerator.free_memory()``, which ``Trainer.train`` calls first thing, with a full
``gc.collect()`` (0.33-0.39 s of every rank's time at 100M parameters here, py-spy: it walks every object the model,
the tokenizer and the datasets made). At the move, elastrain releases accelerate's references and collects once
(:meth:`MoveCollection.leave`); when the old wrapper is then gone, it freezes what survived (``gc.freeze``: the
survivors are live objects, and a collection skips frozen ones), so the Trainer's own collection walks only what the
new ``train()`` made, and unfreezes once the new world's model is wrapped (:meth:`MoveCollection.wrapped`). When
something still holds the old wrapper (a collective failure's traceback), nothing is frozen: the Trainer's
collection then frees it, as before.
"""

from __future__ import annotations

import gc
import time
import weakref
from typing import Any

from elastrain.log import lifecycle


class MoveCollection:
    """One Trainer worker's collections at its moves."""

    def __init__(self) -> None:
        self._frozen = False

    def leave(self, accelerator: Any, wrapper: weakref.ref[Any] | None) -> None:
        """The world is left: accelerate's references to its wrappers dropped, one full collection, and, when the old
        DDP ``wrapper`` (a weak reference: the caller holds it no more; None: the model was not wrapped) is gone, what
        survived frozen until :meth:`wrapped`."""
        self.wrapped()  # what an earlier move froze returns to the collector first
        started = time.monotonic()
        accelerator.free_memory()  # what Trainer.train does first, with its own gc.collect()
        alive = wrapper is not None and wrapper() is not None
        if not alive:
            gc.freeze()
            self._frozen = True
        lifecycle(
            "trainer_garbage_collected",
            took_s=round(time.monotonic() - started, 3),
            frozen=self._frozen,
            why=None if self._frozen else "the old DDP wrapper is still referenced: the next train() collects it",
        )

    def wrapped(self) -> None:
        """The new world's model is wrapped (or the move is over): frozen objects go back to the collector."""
        if self._frozen:
            gc.unfreeze()
            self._frozen = False
