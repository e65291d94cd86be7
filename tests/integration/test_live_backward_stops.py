"""A live worker stops its backward at the next gradient bucket once its round is over (elastrain.live.group).

When the agent announces that a member is gone, the watchdog severs the round (:meth:`TrainingGroup.sever`). The
step in flight is lost either way: its all-reduce can never complete. Before, the backward computed on to its end
and only then met the broken collective (measured at 100M parameters: 1.1-1.7 s after the round was severed). Two
gloo processes, DDP with the live comm hook over a model in many buckets: rank 0's round is severed between two
steps, and its next backward must raise :class:`GroupBrokenError` from the first bucket, handing out no collective;
rank 1's must fail too (its connections were shut down), not hang.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from typing import Any

import torch
from support.processes import spawned_ranks
from torch.nn.parallel import DistributedDataParallel

from elastrain.live.group import GroupBrokenError, TrainingGroup
from elastrain.session.runtime import ddp_kwargs

LAYERS = 12


def _worker(rank: int, port: int, out: Any, severed: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    group = TrainingGroup("gloo", timeout_s=60.0)
    group.join(0, rank, 2, "127.0.0.1", port)
    torch.manual_seed(7)
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(LAYERS)))
    ddp = DistributedDataParallel(model, **ddp_kwargs({"bucket_cap_mb": 0.01}, in_sync=True))
    calls: list[int] = []
    ddp.register_comm_hook(None, lambda state, bucket: calls.append(1) or group.comm_hook(state, bucket))
    result: dict[str, Any] = {"rank": rank}
    x = torch.randn(8, 64)
    for _ in range(3):  # the first two build and rebuild DDP's buckets; the third counts them
        calls.clear()
        ddp(x).sum().backward()  # type: ignore[no-untyped-call]
        model.zero_grad(set_to_none=True)
    result["buckets"] = len(calls)
    if rank == 0:
        group.sever(0)  # what the watchdog does at the agent's notice that a member is gone
        result["broken"] = group.broken.is_set()
        severed.set()
    else:
        severed.wait(60)
    calls.clear()
    try:
        ddp(x).sum().backward()  # type: ignore[no-untyped-call]
        result["error"] = None
    except (GroupBrokenError, RuntimeError) as exc:
        result["error"] = type(exc).__name__
    result["calls"] = len(calls)
    group.leave()
    out.put(result)


def test_a_severed_round_stops_the_backward_at_its_next_bucket() -> None:
    first, second = spawned_ranks(_worker, 2, mp.get_context("spawn").Event())
    results = [first, second]
    assert first["buckets"] > 3, results  # several buckets per backward: a stop at the first one is visible
    assert first["broken"], results
    assert first["error"] == "GroupBrokenError" and first["calls"] == 1, results
    assert second["error"] is not None, results
