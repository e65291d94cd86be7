"""When a newcomer whose job's store fell silent starts the job over (elastrain/rendezvous/connection.py)."""

from __future__ import annotations

import pytest

from elastrain.rendezvous import state as st
from elastrain.rendezvous.connection import FixedStores, refound_why
from elastrain.rendezvous.settings import HandlerSettings


class Seen(FixedStores):
    """What the checkpoint root and the probes say, as a store factory would read them."""

    def __init__(self, vacated: bool, known_gone: bool, no_world: bool = False) -> None:
        self._vacated, self._known_gone, self._no_world = vacated, known_gone, no_world

    def vacated(self) -> bool:
        return self._vacated

    def known_gone(self, cached: st.RendezvousState) -> bool:
        return self._known_gone

    def no_world_since_start(self) -> bool:
        return self._no_world


SETTINGS = HandlerSettings(heartbeat_timeout_s=5.0, refound_after_s=60.0)


@pytest.mark.parametrize(
    ("vacated", "known_gone", "silent_s", "why"),
    [
        (True, False, 0.0, "its world's last node left it"),  # the mark: at once
        (False, True, 1.0, None),  # every known node refused, but a member it never saw may still record a move
        (False, True, 5.0, "every node and store of the job it knew of is gone (probes refused)"),
        (False, False, 30.0, None),  # a node frozen or cut off proves nothing: it looks on
        (False, False, 60.0, "its published store is silent"),
    ],
)
def test_a_newcomer_starts_the_job_over_on_proof_or_after_refound_after(
    vacated: bool, known_gone: bool, silent_s: float, why: str | None
) -> None:
    assert refound_why(Seen(vacated, known_gone), st.RendezvousState(), silent_s, SETTINGS) == why


@pytest.mark.parametrize(("no_world", "silent_s", "why"), [
    (True, 0.0, "its store held no world of the job (no newer fencing claim since this node started)"),
    (False, 0.0, None),  # a round claimed a generation since: its world may be moving the store
])  # fmt: skip
def test_a_newcomer_whose_own_store_held_no_world_starts_over_at_once(
    no_world: bool, silent_s: float, why: str | None
) -> None:
    assert refound_why(Seen(False, False, no_world), st.RendezvousState(), silent_s, SETTINGS) == why
