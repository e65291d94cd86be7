"""elastrain's side of a Trainer refers to it weakly: the script's own references alone keep a Trainer alive.

Under torchrun, a Trainer the script drops (a k-fold's fold, a sweep's trial, the end of ``main()``) is freed at once
by its reference count, and its DataLoaders with it: a persistent DataLoader's workers are told to stop (``None`` on
each index queue) and joined, in a tenth of a second. elastrain's side of a Trainer is kept in it
(``trainer._elastrain``, and its callback in the Trainer's callback handler); if that side referred to the Trainer
strongly, the two would form a reference cycle, freed only by a garbage collection. A collection finalises the
DataLoader's multiprocessing queues (their feeder threads stop) before the DataLoader iterator's own ``__del__``
runs, so its ``None`` is never sent: it waits 5 s for each worker (torch's ``MP_STATUS_CHECK_INTERVAL``) and then
terminates them. A script that trained two folds with two persistent workers paid ~10 s between the folds and ~10 s
at its end (36.8 s against torchrun's 13.9 s).
"""

from __future__ import annotations

import weakref
from typing import Any


class WeakTrainer:
    """A descriptor for the attribute that holds the Trainer: ``self.trainer = t`` keeps a weak reference, and
    ``self.trainer`` gives the Trainer back (ReferenceError once the script dropped it and it was freed)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._slot = f"_weak_{name}"
        self._owner = owner.__name__

    def __get__(self, obj: object, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        trainer = vars(obj)[self._slot]()
        if trainer is None:
            raise ReferenceError(f"the Trainer of this {self._owner} was freed: the script no longer holds it")
        return trainer

    def __set__(self, obj: object, trainer: Any) -> None:
        vars(obj)[self._slot] = weakref.ref(trainer)
