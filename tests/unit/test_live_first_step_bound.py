"""How long a new world's first step waits (elastrain.live.group): longer only for a compiled model, or as long as
--first-step-timeout says."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from elastrain.live.group import FIRST_STEP_TIMEOUT_S, TrainingGroup, is_compiled


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))


def test_a_model_wrapped_or_compiled_in_place_is_compiled_and_a_plain_one_is_not() -> None:
    assert not is_compiled(_net())
    assert is_compiled(torch.compile(_net(), backend="eager"))
    in_place = _net()
    in_place.compile(backend="eager")
    assert is_compiled(in_place)
    outer = torch.nn.Sequential(torch.compile(torch.nn.Linear(3, 3), backend="eager"), torch.nn.ReLU())
    assert is_compiled(outer)  # a compiled part is enough: its first call compiles


@pytest.mark.parametrize(
    ("collective_s", "compiles", "flag_s", "first_step_s"),
    [
        (30.0, False, None, 30.0),  # an eager model: --collective-timeout from the world's first step on
        (30.0, True, None, FIRST_STEP_TIMEOUT_S),
        (5.0, True, None, FIRST_STEP_TIMEOUT_S),
        (900.0, True, None, 900.0),  # a longer --collective-timeout is kept
        (None, True, None, None),  # no --collective-timeout: torch's default throughout
        (None, False, None, None),
        (30.0, True, 1800.0, 1800.0),  # --first-step-timeout: a model whose compile takes longer than 10 minutes
        (30.0, False, 300.0, 300.0),  # or a script that compiles what elastrain does not see (a function)
        (30.0, True, 10.0, 30.0),  # never shorter than --collective-timeout
        (None, True, 1800.0, None),
    ],
)
def test_a_new_world_s_first_step_waits_longer_only_when_the_script_compiles_or_the_flag_says(
    collective_s: float | None, compiles: bool, flag_s: float | None, first_step_s: float | None
) -> None:
    group = TrainingGroup("gloo", collective_s, first_step_timeout_s=flag_s)
    group.compiles = compiles
    want = timedelta(seconds=first_step_s) if first_step_s is not None else None
    assert group.first_step_timeout() == want
