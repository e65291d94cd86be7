"""A step's evaluation and save cut short by a broken world are run again by the next
(elastrain/integrations/trainer/lost_epilogue.py): what each member says is missing, by table."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from elastrain.integrations.trainer.lost_epilogue import Due, LostEpilogue, has_eval_at, missing, without_eval_at

HISTORY = [
    {"loss": 1.2, "step": 30},
    {"eval_loss": 1.1, "eval_runtime": 0.2, "step": 30},
    {"eval_test_loss": 1.3, "step": 30},  # a second evaluation set: eval_<name>_
    {"loss": 1.0, "step": 40},
]


@pytest.mark.parametrize(
    ("step", "expected"),
    [(30, True), (40, False), (20, False)],
)
def test_has_eval_at_by_table(step: int, expected: bool) -> None:
    assert has_eval_at(HISTORY, step) is expected


def test_without_eval_at_drops_that_steps_evaluations_only() -> None:
    assert without_eval_at(HISTORY, 30) == [{"loss": 1.2, "step": 30}, {"loss": 1.0, "step": 40}]
    assert without_eval_at(HISTORY, 40) == HISTORY


DUE = Due(30, evaluate=True, save=True)


@pytest.mark.parametrize(
    ("due", "own", "agreed", "evaluated", "committed", "best", "saves_best", "expected"),
    [
        (DUE, 30, 30, False, False, None, False, (True, True)),  # cut short in the evaluation
        (DUE, 30, 30, True, False, None, False, (False, True)),  # evaluated, cut short in the save
        (DUE, 30, 30, True, True, None, False, (False, False)),  # both done: a later collective broke
        (None, 30, 30, False, False, None, False, (False, False)),  # its epilogue returned (or none was due)
        (DUE, -1, 30, False, False, None, False, (False, False)),  # a joiner has no say
        (DUE, 31, 30, False, False, None, False, (False, False)),  # a member a step ahead rolls back: no say
        (DUE, 30, None, False, False, None, False, (False, False)),  # the world loads a checkpoint
        (Due(20, True, True), 30, 30, False, False, None, False, (False, False)),  # an older epilogue's note
        (Due(30, True, False), 30, 30, True, False, 30, True, (False, True)),  # save_strategy=best: the new best
        (Due(30, True, False), 30, 30, True, False, 10, True, (False, False)),  # not the best: no save
        (Due(30, False, True), 30, 30, False, False, None, False, (False, True)),  # a save alone (a request)
    ],
)
def test_what_a_member_says_is_missing_by_table(
    due: Due | None,
    own: int,
    agreed: int | None,
    evaluated: bool,
    committed: bool,
    best: int | None,
    saves_best: bool,
    expected: tuple[bool, bool],
) -> None:
    got = missing(due, own, agreed, evaluated=evaluated, committed=committed, best_step=best, saves_best=saves_best)
    assert got == expected


def trainer(step: int, evaluate: bool, save: bool) -> Any:
    flags = {"should_log": True, "should_epoch_stop": False, "should_training_stop": False}
    control = SimpleNamespace(should_evaluate=evaluate, should_save=save, **flags)
    return SimpleNamespace(control=control, state=SimpleNamespace(global_step=step))


def test_an_epilogue_is_noted_as_it_enters_and_forgotten_when_it_returns() -> None:
    lost = LostEpilogue()
    lost.entering(trainer(30, evaluate=True, save=False))
    assert lost.pending == Due(30, evaluate=True, save=False)
    lost.returned()
    assert lost.pending is None
    lost.entering(trainer(31, evaluate=False, save=False))  # a log alone: the lost log's (lost_log.py)
    assert lost.pending is None
