"""When a newcomer whose job's store fell silent starts the job over (elastrain/rendezvous/connection.py)."""

from __future__ import annotations

import pytest

from elastrain.rendezvous import state as st
from elastrain.rendezvous.connection import FixedStores, refound_why
from elastrain.rendezvous.settings import HandlerSettings


class Seen(FixedStores):
    """What the checkpoint root and the probes say, as a store factory would read them."""

    def __init__(self, vacated: bool, known_gone: bool) -> None:
        self._vacated, self._known_gone = vacated, known_gone

    def vacated(self) -> bool:
        return self._vacated

    def known_gone(self, cached: st.RendezvousState) -> bool:
        return self._known_gone


SETTINGS = HandlerSettings(heartbeat_timeout_s=5.0, refound_after_s=60.0)


@pytest.mark.parametrize(
    ("vacated", "known_gone", "silent_s", "why"),
    [
        (True, False, 0.0, "its world's last node left it"),  # the mark: at once
        (False, True, 1.0, None),  # every known node refused, but a member it never saw may still record a move
        (False, True, 5.0, "every node of the job it knew of is gone (probes refused)"),
        (False, False, 30.0, None),  # a node frozen or cut off proves nothing: it looks on
        (False, False, 60.0, "its published store is silent"),
    ],
)
def test_a_newcomer_starts_the_job_over_on_proof_or_after_refound_after(
    vacated: bool, known_gone: bool, silent_s: float, why: str | None
) -> None:
    assert refound_why(Seen(vacated, known_gone), st.RendezvousState(), silent_s, SETTINGS) == why
