"""The hold after a requested save ends when a regroup notice arrives (written from a timer thread)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from elastrain.control import RegroupChannel, RegroupNotice


def _notice(round_: int) -> RegroupNotice:
    return RegroupNotice(
        round=round_, generation=7, world_size=4, group_rank=1, group_world_size=2, ranks={0: 2, 1: 3},
        master_addr="127.0.0.1", master_port=29999, start_reason="scale_down", previous_world_size=6,
        announced_at=time.time(),
    )  # fmt: skip


def test_the_hold_after_a_requested_save_ends_when_a_regroup_notice_arrives(tmp_path: Path) -> None:
    from elastrain.checkpoint.schedule import hold_for_restart
    from elastrain.control import ControlChannel

    events: list[tuple[str, dict[str, object]]] = []
    channel = ControlChannel(tmp_path)
    RegroupChannel(tmp_path).announce(_notice(round_=2))  # the current round's notice does not end it
    threading.Timer(0.2, lambda: RegroupChannel(tmp_path).announce(_notice(round_=3))).start()
    hold_for_restart(30.0, 7, lambda event, level, **f: events.append((event, f)), channel, live_round=2)
    assert events[-1] == ("checkpoint_hold_over", {"step": 7, "why": "regroup in place"})
