"""The per-event measures of a run (elastrain.chaos.analysis; the T5 report and bench/goodput.py use them)."""

from __future__ import annotations

import pytest

from elastrain.chaos.analysis import redone, stalls


@pytest.mark.parametrize(
    ("times", "events", "expected"),
    [
        ([0, 1, 2, 3], [], []),
        ([0, 1, 5, 6], [1.5], [4.0]),  # the gap the event fired in
        ([0, 1, 2, 9, 10], [1.5], [7.0]),  # a later, longer gap belongs to the last event before it
        ([0, 1, 4, 5, 12], [0.5, 4.5], [3.0, 7.0]),  # each event its own gap
        ([0, 1, 2], [5.0], [None]),  # no step after the event
    ],
)
def test_a_stall_belongs_to_the_event_that_caused_it(
    times: list[float], events: list[float], expected: list[float | None]
) -> None:
    assert stalls(times, events) == expected


def test_a_step_computed_twice_counts_for_the_first_event_after_its_first_computation() -> None:
    points = [(0.0, 1), (1.0, 2), (2.0, 3), (3.5, 2), (4.0, 3), (5.0, 4), (7.0, 4)]
    # steps 2 and 3 redone after the event at 3.0; step 4 after the event at 6.0
    assert redone(points, [3.0, 6.0]) == [3, 2, 1]
    assert redone(points, []) == [3]
