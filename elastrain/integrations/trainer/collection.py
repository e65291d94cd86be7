"""The garbage collections around a live move of the Trainer: none that walks the whole heap, unless it must.

Before the next world's first backward, the old world's DDP wrapper must be gone (its reducer's autograd hooks with
it). accelerate holds it until ``Accelerator.free_memory()``, which ``Trainer.train`` calls first thing, with a full
``gc.collect()`` (0.32-0.39 s of every rank's time at 100M parameters here, py-spy: it walks every object the model,
the tokenizer and the datasets made). At the move (:meth:`MoveCollection.leave`), elastrain freezes what lives
(``gc.freeze``: a collection skips frozen objects) and then lets accelerate drop its references: the old wrapper, no
longer referred to, is freed at once by its reference count, and accelerate's collection, and the Trainer's own in
the next ``train()``, walk only what is newer than the freeze. Only when the old wrapper outlives that (a reference
cycle: the first DDP wrapper of a process is caught in one when torch imports its compiler lazily in its
constructor) does one full collection run, before anything is frozen again. What was frozen goes back to the collector
once the new world's model is wrapped (:meth:`MoveCollection.wrapped`). When something still holds the old wrapper
(a collective failure's traceback), nothing is frozen: the Trainer's collection then frees it, as before.

elastrain's side of a Trainer refers to it weakly (:mod:`~elastrain.integrations.trainer.weak_trainer`), so a Trainer
the script drops is freed by its reference count, as under torchrun. One that a reference cycle of the script's (or
a library's) keeps until a collection would still hold its training DataLoader's persistent workers
(``dataloader_persistent_workers``) when multiprocessing's exit hook terminates them, which torch reports as a failed
worker: :func:`collect_at_exit` collects first.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing.util  # noqa: F401  (registers its exit hook as it is imported: before collect_at_exit's)
import time
import weakref
from typing import Any

from elastrain.log import lifecycle

_collecting_at_exit = False


def collect_at_exit() -> None:
    """Collect the worker's garbage as it exits, before multiprocessing's exit hook (atexit runs the hooks in the
    reverse order of their registration; importing multiprocessing.util registers its own), so that a finished
    Trainer, and the DataLoaders it holds, are freed first and their workers shut down as the DataLoader does."""
    global _collecting_at_exit
    if not _collecting_at_exit:
        _collecting_at_exit = True
        atexit.register(gc.collect)


class MoveCollection:
    """One Trainer worker's collections at its moves."""

    def __init__(self) -> None:
        self._frozen = False

    def leave(self, accelerator: Any, wrapper: weakref.ref[Any] | None) -> None:
        """The world is left: accelerate's references to its wrappers dropped and, when the old DDP ``wrapper`` (a weak
        reference: the caller holds it no more; None: the model was not wrapped) is then gone, what lives frozen
        until :meth:`wrapped`; one full collection first when only that frees the wrapper."""
        self.wrapped()  # what an earlier move froze returns to the collector first
        started = time.monotonic()
        gc.freeze()
        accelerator.free_memory()  # what Trainer.train does first: its gc.collect() walks only what is newer
        full = wrapper is not None and wrapper() is not None
        if full:  # in a reference cycle, or still held: a full collection, with nothing frozen
            gc.unfreeze()
            gc.collect()
        self._frozen = wrapper is None or wrapper() is None
        if full and self._frozen:
            gc.freeze()
        lifecycle(
            "trainer_garbage_collected",
            took_s=round(time.monotonic() - started, 3),
            full=full,
            frozen=self._frozen,
            why=None if self._frozen else "the old DDP wrapper is still referenced: the next train() collects it",
        )

    def wrapped(self) -> None:
        """The new world's model is wrapped (or the move is over): frozen objects go back to the collector."""
        if self._frozen:
            gc.unfreeze()
            self._frozen = False
