"""A logging step's window closes only once its loss is in the history (elastrain/integrations/trainer/lost_log.py):
the Trainer marks a step logged before two more collectives, and a peer lost between them loses the line."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from elastrain.integrations.trainer.lost_log import LostLog, has_loss_at, logging_due, lost_window_loss


@pytest.mark.parametrize(
    ("history", "step", "expected"),
    [
        ([], 10, False),
        ([{"loss": 1.0, "step": 10}], 10, True),
        ([{"loss": 1.0, "step": 10}, {"eval_loss": 2.0, "step": 10}], 10, True),
        ([{"eval_loss": 2.0, "step": 20}], 20, False),
        ([{"loss": 1.0, "step": 10}], 20, False),
        ([{"loss": 1.0, "step": 10}, {"loss": 0.9, "step": 20}, {"train_runtime": 1.0, "step": 20}], 20, True),
        ([{"loss": 1.0, "step": 20}, {"loss": 0.9, "step": 30}], 20, True),
    ],
)
def test_has_loss_at_by_table(history: list[dict[str, Any]], step: int, expected: bool) -> None:
    assert has_loss_at(history, step) is expected


def trainer(last_logged: int, history: list[dict[str, Any]]) -> Any:
    return SimpleNamespace(_globalstep_last_logged=last_logged, state=SimpleNamespace(log_history=history))


def test_a_step_marked_logged_without_its_line_keeps_its_window() -> None:
    lost = LostLog()
    lost.logged_at = 10
    for _ in range(10):
        lost.add(torch.tensor(0.5))
    lost.logged(trainer(20, [{"loss": 0.6, "step": 10}]))  # store_flos broke after the mark: no line at 20
    assert lost.logged_at == 10 and lost.window is not None and float(lost.window) == pytest.approx(5.0)


def test_a_logged_step_opens_a_new_window() -> None:
    lost = LostLog()
    lost.add(torch.tensor(0.5))
    lost.logged(trainer(10, [{"loss": 0.5, "step": 10}]))
    assert lost.logged_at == 10 and lost.window is None


def test_no_log_due_changes_nothing() -> None:
    lost = LostLog()
    lost.add(torch.tensor(0.5))
    lost.logged(trainer(0, []))
    assert lost.logged_at == 0 and lost.window is not None


@pytest.mark.parametrize(
    ("noted", "step", "expected"),
    [
        ((0.0, 0.0, 0.0, 0.0), 30, None),  # no member trained up to the agreed step: nothing to log
        ((10.0, 2.0, 40.0, 0.0), 30, None),  # the members logged it: nothing lost
        ((10.0, 2.0, 40.0, 2.0), 30, 0.5),  # two members, each 5.0 over the 10 steps since 20
        ((5.0, 1.0, 20.0, 1.0), 30, 0.5),  # the one survivor of a world whose other member died
        ((3.0, 1.0, 30.0, 1.0), 30, 3.0),  # logged at the step itself (never: the window is then closed): one step
    ],
)
def test_the_lost_window_loss_by_table(
    noted: tuple[float, float, float, float], step: int, expected: float | None
) -> None:
    assert lost_window_loss(*noted, step) == (None if expected is None else pytest.approx(expected))


@pytest.mark.parametrize(
    ("strategy", "every", "step", "expected"),
    [("steps", 10, 30, True), ("steps", 10, 35, False), ("steps", 10, 0, False), ("epoch", 10, 30, False)],
)
def test_a_logging_step_by_table(strategy: str, every: int, step: int, expected: bool) -> None:
    args, state = SimpleNamespace(logging_strategy=strategy), SimpleNamespace(logging_steps=every)
    assert logging_due(args, state, step) is expected


def test_a_window_starts_where_train_set_up_its_state() -> None:
    lost = LostLog()
    lost.add(torch.tensor(0.5))
    lost.begin(120)  # a checkpoint of step 120 loaded: the window since the last log is the Trainer's from there
    assert lost.logged_at == 120 and lost.window is None
