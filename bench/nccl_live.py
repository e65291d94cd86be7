"""The NCCL path of a live regroup (elastrain.live.group) on real GPUs: a frozen peer's collective is given up.

    python bench/nccl_live.py            # needs 2 CUDA devices; elsewhere it says so and exits 0

Two processes, one GPU each, join round 0 of a :class:`~elastrain.live.group.TrainingGroup` with the NCCL
backend and all-reduce once. Then rank 1 freezes (sleeps, never enters the next all-reduce) while rank 0
starts one; rank 0's watchdog stand-in gives the round up (``TrainingGroup.sever``: the communicators are
aborted, with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``), the pending all-reduce must fail within seconds (not
after the 60 s collective timeout), the process must survive, leave the round without waiting for the
frozen peer (abort, never destroy) and all-reduce in a new round of one. Prints each time and PASS/FAIL.
This machine has no GPU: the script has not been run here; it is what checks the path where one is.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from elastrain import binding  # noqa: E402
from elastrain.live.group import GroupBrokenError, TrainingGroup  # noqa: E402

BOUND_S = 20.0  # the pending all-reduce must fail well before the 60 s collective timeout


def _free_port() -> int:
    return binding.free_port("127.0.0.1")


def _member(rank: int, port: int, port2: int, results: dict[str, object]) -> None:
    torch.cuda.set_device(rank)
    group = TrainingGroup("nccl", timeout_s=60.0, join_timeout_s=60.0)
    group.join(0, rank, 2, "127.0.0.1", port)
    t = torch.ones(4, device="cuda")
    group.all_reduce(t)
    torch.cuda.synchronize()
    if rank == 1:
        time.sleep(120)  # frozen: never joins the next collective; killed by the parent
        return
    outcome: list[str] = []

    def pending() -> None:
        try:
            group.all_reduce(torch.ones(1 << 20, device="cuda"))
            torch.cuda.synchronize()
            outcome.append("completed (wrong: the peer is frozen)")
        except (GroupBrokenError, RuntimeError) as exc:
            outcome.append(f"failed: {type(exc).__name__}")

    waiter = threading.Thread(target=pending, daemon=True)
    waiter.start()
    time.sleep(1.0)
    started = time.monotonic()
    group.abort(GroupBrokenError("round 0 is over"), 0)
    group.sever(0)
    waiter.join(BOUND_S)
    results["given_up_s"] = round(time.monotonic() - started, 3)
    results["outcome"] = outcome[0] if outcome else "still blocked"
    started = time.monotonic()
    group.leave()
    results["leave_s"] = round(time.monotonic() - started, 3)
    group.join(1, 0, 1, "127.0.0.1", port2)
    t = torch.full((4,), 3.0, device="cuda")
    group.all_reduce(t)
    torch.cuda.synchronize()
    results["new_round_sum"] = float(t[0].item())
    group.leave()


def main() -> int:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print("nccl_live: needs 2 CUDA devices; none here, nothing was tested", flush=True)
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    results = manager.dict()
    port, port2 = _free_port(), _free_port()
    procs = [ctx.Process(target=_member, args=(r, port, port2, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    procs[0].join(BOUND_S + 60)
    procs[1].kill()
    procs[1].join(10)
    alive = procs[0].exitcode == 0
    print(f"nccl_live: {dict(results)} rank-0 exit={procs[0].exitcode}", flush=True)
    ok = (
        alive
        and str(results.get("outcome", "")).startswith("failed")
        and float(results.get("given_up_s", BOUND_S)) < BOUND_S
        and results.get("new_round_sum") == 3.0
    )
    print("nccl_live: PASS" if ok else "nccl_live: FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
