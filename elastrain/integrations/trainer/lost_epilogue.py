"""A step's evaluation and save that its world lost, done in the next world before it trains on.

After each optimizer step the Trainer runs the step's epilogue (``Trainer._maybe_log_save_evaluate``): the log, an
evaluation when one is due (``eval_strategy``), a ``checkpoint-N`` when one is due (``save_strategy``, the last step,
a save the launcher requested). A peer lost in it (the evaluation's gathers, the save's barriers and commit) leaves
the step complete on every survivor and its epilogue cut short, and ``Trainer.train``, entered again for the next
world, goes on with the next step: the run would lack that evaluation (its metrics, its say in the best model) and
that checkpoint, unlike an uninterrupted run. (The lost log is :mod:`~elastrain.integrations.trainer.lost_log`'s.)

So each rank notes what the epilogue it enters is due to do (:meth:`LostEpilogue.entering`), and forgets it once the
epilogue returns. Entering a world, the members that completed the agreed step say, collectively, whether that
step's evaluation is missing from their log history or its save is not committed; if any is, every member of the new
world runs that part of the epilogue again, as the Trainer would have, once ``Trainer.train`` has set up its state
(:meth:`LostEpilogue.redo`, from the integration's ``on_train_begin``). An evaluation some member had logged is
dropped from every history first, so that each holds it once. The save is written into a fresh folder: the
leftover of the cut-short one is removed by the commit protocol before the Trainer writes
(:meth:`~elastrain.integrations.trainer.checkpoints.TrainerCheckpoints.prepare`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastrain.log import lifecycle

EVAL_PREFIX = "eval_"
"""The Trainer's metric prefix for an evaluation during training (``Trainer._evaluate``: ``eval`` and, for several
evaluation sets, ``eval_<name>``)."""


@dataclass(frozen=True)
class Due:
    """What a step's epilogue does beyond its log: evaluate, save."""

    step: int
    evaluate: bool
    save: bool


def has_eval_at(history: list[dict[str, Any]], step: int) -> bool:
    """Pure: whether a log history holds an evaluation's metrics logged at ``step``."""
    return any(entry.get("step") == step and _is_eval(entry) for entry in history)


def without_eval_at(history: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
    """Pure: ``history`` without the evaluation entries logged at ``step``."""
    return [entry for entry in history if not (entry.get("step") == step and _is_eval(entry))]


def _is_eval(entry: dict[str, Any]) -> bool:
    return any(key.startswith(EVAL_PREFIX) for key in entry)


def missing(
    due: Due | None,
    own_step: int,
    agreed_step: int | None,
    *,
    evaluated: bool,
    committed: bool,
    best_step: int | None,
    saves_best: bool,
) -> tuple[bool, bool]:
    """Pure: what of the agreed step's epilogue this member says is missing, ``(evaluation, save)``. Only a member
    that completed the agreed step and entered its epilogue has a say. ``evaluated``: its history holds the step's
    evaluation; ``committed``: the step's checkpoint is committed; ``best_step``/``saves_best``: with
    ``save_strategy="best"`` the evaluation decides the save (the step became the best one)."""
    if due is None or agreed_step is None or own_step != agreed_step or due.step != agreed_step:
        return False, False
    evaluation = due.evaluate and not evaluated
    save = (due.save or (saves_best and due.evaluate and best_step == agreed_step)) and not committed
    return evaluation, save


class LostEpilogue:
    """This rank's epilogue in progress, and the lost one its new world runs again."""

    def __init__(self) -> None:
        self.pending: Due | None = None
        """The epilogue this rank entered and has not returned from (None: none, or it returned)."""
        self.redo_due: Due | None = None
        """Agreed by the world: what of the agreed step's epilogue runs again at the next ``train()``."""

    def entering(self, trainer: Any) -> None:
        """``Trainer._maybe_log_save_evaluate`` is entered: note what it is due to do. After the last step of an epoch
        or of the run (the Trainer's epoch ends next), what the epoch's end will do too: the world may break before
        it gets there."""
        control = trainer.control
        step = int(trainer.state.global_step)
        evaluate, save = bool(control.should_evaluate), bool(control.should_save)
        if control.should_epoch_stop or control.should_training_stop:
            from transformers import DefaultFlowCallback, TrainerControl

            at_end = DefaultFlowCallback().on_epoch_end(trainer.args, trainer.state, TrainerControl())
            evaluate, save = evaluate or at_end.should_evaluate, save or at_end.should_save
        due = Due(step, evaluate, save)
        self.pending = due if due.evaluate or due.save else None

    def returned(self) -> None:
        """The epilogue returned: nothing of it is lost."""
        self.pending = None

    def agree(
        self,
        trainer: Any,
        committed: Callable[[int], bool],
        device: torch.device,
        own_step: int,
        agreed_step: int | None,
    ) -> None:
        """Collective, on every member entering a world: whether the agreed step's evaluation or save was lost (see
        :func:`missing`; ``committed``: whether a step's checkpoint is); every member then runs it again at the next
        ``train()`` (:meth:`redo`)."""
        due, self.pending = self.pending, None
        state, args = trainer.state, trainer.args
        step = agreed_step if agreed_step is not None else -1
        evaluation, save = missing(
            due,
            own_step,
            agreed_step,
            evaluated=has_eval_at(state.log_history, step),
            committed=step >= 0 and committed(step),
            best_step=state.best_global_step,
            saves_best=args.save_strategy == "best",
        )
        flags = torch.tensor([float(evaluation), float(save)], dtype=torch.float64, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        lost_eval, lost_save = (bool(v) for v in flags.tolist())
        self.redo_due = Due(step, lost_eval, lost_save) if lost_eval or lost_save else None
        if self.redo_due is not None and dist.get_rank() == 0:
            lifecycle("trainer_epilogue_lost", step=step, evaluate=lost_eval, save=lost_save)

    def redo(self, trainer: Any, trial: Any, ignore_keys_for_eval: Any) -> None:
        """In the state ``Trainer.train`` set up again, before its first step: the lost evaluation and save, run by
        the Trainer's own epilogue (every member alike: collective). A broken world's flags are not this one's."""
        control = trainer.control
        control.should_log = control.should_evaluate = control.should_save = False
        due, self.redo_due = self.redo_due, None
        if due is None or due.step != int(trainer.state.global_step):
            return
        if due.evaluate:
            trainer.state.log_history = without_eval_at(trainer.state.log_history, due.step)
        control.should_evaluate, control.should_save = due.evaluate, due.save
        if dist.get_rank() == 0:
            lifecycle("trainer_epilogue_redone", step=due.step, evaluate=due.evaluate, save=due.save)
        trainer._maybe_log_save_evaluate(
            trainer._tr_loss, None, trainer.model_wrapped, trial, trainer.state.epoch, ignore_keys_for_eval, 0.0
        )
