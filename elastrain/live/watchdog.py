"""A live worker's watchdog thread: the agent's regroup notice gets the training thread out of a collective.

A rank can wait in a collective that will never complete without failing: a peer that is alive but
left the round (its own collective broke first and it went to regroup), or a frozen one. The agent's
notice says the round is over; the watchdog then fails the training group's pending collectives
(:meth:`elastrain.live.group.TrainingGroup.abort`), so the wait ends at once instead of after
``--collective-timeout``. A notice of a change that lost no member (nodes joined) is left to the
step boundary that every rank agrees on: the old round's collectives all complete. It reads one
file's ``stat`` per poll.
"""

from __future__ import annotations

import threading

from elastrain.control import RegroupChannel
from elastrain.live.group import GroupBrokenError, TrainingGroup
from elastrain.log import lifecycle

POLL_S = 0.05


class Watchdog:
    def __init__(self, channel: RegroupChannel, group: TrainingGroup, round_: int) -> None:
        self._channel = RegroupChannel(channel.directory)  # its own cache: the training thread reads the other
        self._group = group
        self._round = round_
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastrain-live-watchdog", daemon=True)
        self._thread.start()

    def watch_round(self, round_: int) -> None:
        """The worker joined ``round_``: only a newer notice ends it."""
        self._round = round_

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            notice = self._channel.newer_than(self._round)
            if notice is None or notice.no_departure:
                continue  # nodes joined: every member completes its collectives, and all move at one step
            over = self._round
            failed = self._group.abort(GroupBrokenError(f"round {over} is over: regroup into {notice.round}"), over)
            if failed:
                lifecycle("collectives_given_up", round=over, next_round=notice.round, pending=failed)
            # A member is gone: a collective of the round that no future of ours stands for (FSDP2's, the
            # session's own) must not wait for it either.
            self._group.sever(over)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
