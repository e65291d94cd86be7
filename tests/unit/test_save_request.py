"""The agent's checkpoint request before a change (elastrain/launcher/save_request.py): what it logs for each way
the wait ends, on a real control channel in a temporary directory (the workers' side is played by its calls)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from elastrain.control import ControlChannel, SaveCause
from elastrain.launcher.options import ElastrainOptions
from elastrain.launcher.save_request import checkpoint_before_change
from elastrain.log import parse_event_line

OPTIONS = ElastrainOptions(checkpoint_dir="/ckpt", save_timeout_s=0.3)


def _events(lines: list[str]) -> list[str]:
    return [e["event"] for e in map(parse_event_line, lines) if e is not None]


def _ask(tmp_path: Path, *, exited: bool, finishing: bool, answered: bool = False) -> ControlChannel:
    control = ControlChannel(tmp_path)

    def gone() -> bool:
        if answered:  # a worker answers the request once it is written: a commit of the state it asks for
            ControlChannel(tmp_path).ack(step=7, checkpoint="ckpt-7", current_at=time.time())
        return exited

    checkpoint_before_change(
        control, OPTIONS, SaveCause.LEAVE, "SIGTERM", 5.0, workers_exited=gone, workers_finishing=lambda: finishing
    )
    return control


@pytest.mark.parametrize(
    ("exited", "finishing", "answered", "event", "error"),
    [
        (False, False, True, "checkpoint_acked", False),
        (True, False, False, "checkpoint_unanswered", True),  # killed with the agent: work since the last commit
        (False, False, False, "checkpoint_timeout", False),
        (True, True, False, "checkpoint_not_needed", False),  # finished training and exited: nothing is lost
        (False, True, False, "checkpoint_timeout", False),  # still closing at the bound
    ],
)
def test_each_end_of_the_wait_has_its_own_line(
    tmp_path: Path, logged: list[str], exited: bool, finishing: bool, answered: bool, event: str, error: bool
) -> None:
    _ask(tmp_path, exited=exited, finishing=finishing, answered=answered)
    assert _events(logged) == ["checkpoint_requested", event], logged
    assert ("before they saved" in logged[-1]) is error, logged[-1]


def test_without_a_checkpoint_dir_nothing_is_asked(tmp_path: Path, logged: list[str]) -> None:
    control = ControlChannel(tmp_path)
    checkpoint_before_change(control, ElastrainOptions(), SaveCause.LEAVE, "SIGTERM", 5.0)
    assert control.current_request() is None and not logged
