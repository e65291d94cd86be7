"""What a Trainer worker holds in memory besides the model and optimizer, as one small ``Stateful`` each.

At a live regroup these travel from the member that keeps the agreed state to the members that have none
(a joining or restarted worker) or that roll back (a member a step ahead), together with the model and the
optimizer (:func:`elastrain.live.transfer.send_state`): the Trainer's own state (global step, epoch, log history,
best metric) with the state its callbacks export (an early stop's patience), the learning-rate scheduler's state,
elastrain's data position, and an iterable training set's own place at it. Every value is a plain number, string,
list or dict: nothing here is code.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from typing import Any

from elastrain.log import lifecycle


@dataclasses.dataclass
class DataPosition:
    """Where the data stream stands: ``cursor`` samples consumed after optimizer step ``step``."""

    step: int = 0
    cursor: int = 0
    global_batch: int = 0

    def cursor_at(self, step: int) -> int:
        """The stream position after optimizer step ``step`` (every step takes one global batch)."""
        return self.cursor + (step - self.step) * self.global_batch

    def rebase(self, step: int) -> None:
        """Count from optimizer step ``step`` (where the next train() call starts)."""
        self.cursor, self.step = self.cursor_at(step), step

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.cursor, self.global_batch = int(state["step"]), int(state["cursor"]), int(state["global_batch"])


# The fields of transformers' TrainerState that describe progress, not this process or this call of train().
_PROGRESS_FIELDS = (
    "epoch",
    "global_step",
    "num_input_tokens_seen",
    "total_flos",
    "log_history",
    "best_metric",
    "best_global_step",
    "best_model_checkpoint",
    "trial_name",
    "trial_params",
)


class Progress:
    """The Trainer's progress (its ``TrainerState``) as plain values, kept or received at a regroup.

    The progress of the last completed optimizer step: the Trainer adds each micro-batch's tokens to
    ``num_input_tokens_seen`` as it finishes it (``include_num_input_tokens_seen``), so in a step lost to a broken
    world the count already holds that step's finished micro-batches, which the next world trains (and counts) again.
    The count at the step's start (:meth:`step_begins`) is the one kept.
    """

    def __init__(self) -> None:
        self.values: dict[str, Any] | None = None
        self._source: Any = None
        self._callbacks: list[Any] = []
        self._tokens_at: tuple[int, Any] | None = None
        """``(global_step, num_input_tokens_seen)`` when the step after ``global_step`` began."""

    def track(self, trainer_state: Any, callbacks: list[Any]) -> None:
        """Send ``trainer_state``'s progress, and the state of the Trainer's ``callbacks`` that export one
        (transformers' ``ExportableState``: ``EarlyStoppingCallback``'s patience), when this member is the source."""
        self._source = trainer_state
        self._callbacks = callbacks

    def step_begins(self, trainer_state: Any) -> None:
        """A step begins (the Trainer's ``on_step_begin``, before its first micro-batch): its token count so far."""
        self._tokens_at = (int(trainer_state.global_step), trainer_state.num_input_tokens_seen)

    def state_dict(self) -> dict[str, Any]:
        if self._source is None:
            return {}
        values = {name: getattr(self._source, name) for name in _PROGRESS_FIELDS}
        if self._tokens_at is not None and self._tokens_at[0] == int(self._source.global_step):
            values["num_input_tokens_seen"] = self._tokens_at[1]  # not the lost step's finished micro-batches
        values[_CALLBACKS] = callback_states(self._callbacks)
        return dict(json.loads(json.dumps(values)))  # plain values only (log_history may hold numpy scalars)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values = dict(state) if state else None

    def snapshot(self) -> None:
        """Keep this member's own progress (it holds the agreed state): what the next train() resumes from."""
        self.values = self.state_dict() or None

    def apply(self, trainer_state: Any, callbacks: list[Any]) -> None:
        """Write the kept progress into a fresh ``TrainerState`` (the next train() call's), and the callbacks' state
        into the Trainer's ``callbacks``: every member of a world decides alike when to stop (an early stop)."""
        if self.values is not None:
            for name, value in self.values.items():
                if name == _CALLBACKS:
                    restore_callback_states(callbacks, value)
                else:
                    setattr(trainer_state, name, value)


_CALLBACKS = "callbacks"


def callback_states(callbacks: list[Any]) -> dict[str, list[dict[str, Any]]]:
    """The exported state (``state()``'s ``attributes``) of each callback that has one, by class name, in order."""
    from transformers.trainer_callback import ExportableState  # not at the top: the patches import this module

    out: dict[str, list[dict[str, Any]]] = {}
    for cb in callbacks:
        if isinstance(cb, ExportableState):
            out.setdefault(type(cb).__name__, []).append(dict(cb.state().get("attributes", {})))
    return out


def restore_callback_states(callbacks: list[Any], states: dict[str, list[dict[str, Any]]]) -> None:
    """Set each callback's attributes to the member's that sent them (the callbacks of one class, in order); a
    callback this member lacks, or has more of, keeps its own (one line says so)."""
    from transformers.trainer_callback import ExportableState

    mine: dict[str, list[Any]] = {}
    for cb in callbacks:
        if isinstance(cb, ExportableState):
            mine.setdefault(type(cb).__name__, []).append(cb)
    for name in sorted(set(states) | set(mine)):
        sent, here = states.get(name, []), mine.get(name, [])
        if len(sent) != len(here):
            lifecycle(
                "trainer_callbacks_differ",
                level=logging.WARNING,
                callback=name,
                sent=len(sent),
                here=len(here),
                why="the members' scripts add other callbacks: those without a peer's state keep their own",
            )
        for cb, attributes in zip(here, sent, strict=False):
            for attribute, value in attributes.items():
                setattr(cb, attribute, value)


class Deferred:
    """A ``Stateful`` for an object the Trainer builds later (its LR scheduler): a received state waits for it."""

    def __init__(self) -> None:
        self.target: Any = None
        self.pending: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return dict(self.target.state_dict()) if self.target is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pending = dict(state) if state else None

    def snapshot(self) -> None:
        self.pending = self.state_dict() or None

    def apply(self, target: Any) -> None:
        """``target`` is built: give it the kept or received state (once)."""
        self.target = target
        if self.pending is not None and target is not None:
            target.load_state_dict(self.pending)
        self.pending = None


class StreamPlace:
    """An iterable training set's place at a data position, as the set's own resumable state
    (:meth:`~elastrain.integrations.trainer.iterable.IterableStream.mark`): sent at a regroup and written with each
    checkpoint, so a member with no reader there (a joiner, a restart) resumes the set at it instead of reading
    every sample before it again."""

    def __init__(self) -> None:
        self._mark: Callable[[int], dict[str, Any] | None] | None = None
        self._agreed: Callable[[], int] = lambda: 0
        self.received: dict[str, Any] | None = None

    def attach(self, mark: Callable[[int], dict[str, Any] | None], agreed: Callable[[], int]) -> None:
        """The loader of an iterable set: its reader's marks, and the agreed position a regroup sends."""
        self._mark, self._agreed = mark, agreed

    def mark_at(self, position: int) -> dict[str, Any] | None:
        return self._mark(position) if self._mark is not None else None

    def state_dict(self) -> dict[str, Any]:
        return self.mark_at(self._agreed()) or {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.received = dict(state) if state else None

    def take(self) -> dict[str, Any] | None:
        """The received mark, once."""
        mark, self.received = self.received, None
        return mark


@dataclasses.dataclass
class Held:
    """Everything a Trainer worker holds between two ``train()`` calls, besides the model and the optimizer."""

    position: DataPosition = dataclasses.field(default_factory=DataPosition)
    progress: Progress = dataclasses.field(default_factory=Progress)
    scheduler: Deferred = dataclasses.field(default_factory=Deferred)
    stream: StreamPlace = dataclasses.field(default_factory=StreamPlace)
    holds_state: bool = False
    """This worker trained (or loaded) the state it holds: it can send it at a regroup."""
    memory_resume: bool = False
    """The next ``train()`` call continues from the state in memory (kept or received), not a checkpoint."""
