"""The fencing generation claimed by racing processes: exactly one wins."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

from elastrain import fence


def _race(root: str, i: int, q: mp.Queue) -> None:  # type: ignore[type-arg]
    q.put((i, fence.claim_after(root, "job", 1, f"w{i}", (), parent=0) is not None))


def test_racing_processes_one_winner(tmp_path: Path) -> None:
    root = str(tmp_path)
    fence.claim_fresh(root, "job", 0, "s0", ())
    ctx = mp.get_context("fork")
    q: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    procs = [ctx.Process(target=_race, args=(root, i, q)) for i in range(8)]
    for p in procs:
        p.start()
    results = [q.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert sum(won for _, won in results) == 1
