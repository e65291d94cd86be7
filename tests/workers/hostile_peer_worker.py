"""Two ranks; in each exchange one of them is a hostile peer that sends a pickle through torch's own object
collectives (what elastrain used before), and the other receives it through elastrain's collective for that
place. Prints ``REFUSED <place>: <why>`` or ``ACCEPTED <place>`` on the honest rank, then ``DONE``.

The pickle would run ``touch <sentinel>`` wherever it is unpickled.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastrain import wire
from elastrain.checkpoint.group import Group
from elastrain.errors import WireFormatError
from elastrain.live.stream import broadcast_tree


class Hostile:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (self.command,))


def honest(place: str, receive: Callable[[], Any]) -> None:
    try:
        got = receive()
    except WireFormatError as exc:
        print(f"REFUSED {place}: {exc}", flush=True)
        return
    print(f"ACCEPTED {place}: {got!r}", flush=True)


def main() -> None:
    sentinel = sys.argv[1]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    evil = Hostile(f"touch {sentinel}")
    group = Group(None, 60.0)  # the checkpointer's own group (the commit protocol's collectives)

    # The commit protocol: rank 0's verdict broadcast to the others.
    if rank == 0:
        dist.broadcast_object_list([evil], src=0, group=group.pg)
    else:
        honest("checkpoint broadcast", lambda: group.broadcast(None))
    # The commit protocol: every rank's report gathered on rank 0.
    if rank == 1:
        with contextlib.suppress(pickle.UnpicklingError):  # the honest rank's JSON is no pickle: the attacker's problem
            dist.all_gather_object([None, None], evil, group=group.pg)
    else:
        honest("checkpoint all_gather", lambda: group.all_gather({"a.bin": {"size": 1, "crc32": 2}}))
    # Live mode: a joining member receives the state's skeleton from the source.
    if rank == 0:
        dist.broadcast_object_list([evil], src=0)
    else:
        honest("live state transfer", lambda: broadcast_tree(None, 0, torch.device("cpu")))
    # The Session: rank 0's segment token.
    if rank == 0:
        dist.broadcast_object_list([evil], src=0)
    else:
        honest("session segment", lambda: wire.broadcast(None, src=0))
    # And the honest path still works, tuples and int keys included.
    value = {"verdict": ("ok", 3), "by_rank": {0: "a", 1: "b"}}
    assert group.broadcast(value if rank == 0 else None) == value
    assert group.all_gather(("r", rank)) == [("r", 0), ("r", 1)]
    group.destroy()
    dist.destroy_process_group()
    print(f"DONE rank={rank}", flush=True)


if __name__ == "__main__":
    main()
