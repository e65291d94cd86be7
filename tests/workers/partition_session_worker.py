"""The partition tests' worker as a Session job, for ``elastrain-run --live true`` (workers regroup in place).

It prints the lines of tests/workers/partition_worker.py, read from the worker's *current* round (a
live regroup changes rank, world size, round, generation and the group's store in this same process)::

    PW_START t=<after the session started> rank=.. ws=.. round=.. gen=.. world=<MASTER_ADDR:MASTER_PORT> pid=..
    PW_STEP t=<after the step> step=<the job's global step> rank=.. ws=.. round=.. gen=.. world=.. pid=..

The job ends once the file named by PW_STOP_FILE holds a step number: every rank stops after that step
(all ranks agree on the job's step, so none is left waiting in a collective).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from elastrain.session import Session


def tag(session: Session) -> str:
    return (
        f"rank={session.rank} ws={session.world_size} round={os.environ.get('ELASTRAIN_ROUND', '-')} "
        f"gen={os.environ.get('ELASTRAIN_GENERATION') or '-'} "
        f"world={os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} pid={os.getpid()}"
    )


def stop_step(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def main() -> None:
    stop_file = os.environ.get("PW_STOP_FILE", "")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(1200, 8, generator=g), torch.randn(1200, 1, generator=g))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    stop_at: int | None = None
    with Session(model, optimizer, data, global_batch=6, micro_batch=2, max_steps=10**6) as session:
        print(f"PW_START t={time.time():.3f} {tag(session)}", flush=True)
        for step in session:
            for mb in step:
                x, y = mb.data
                step.backward(torch.nn.functional.mse_loss(session.model(x), y), mb)
            step.optimizer_step()
            if step.abandoned:  # a regroup gave the step up: the new world trains it again
                continue
            print(f"PW_STEP t={time.time():.3f} step={session.state.step} {tag(session)}", flush=True)
            if stop_at is None and stop_file:
                stop_at = stop_step(stop_file)
            if stop_at is not None and session.state.step >= stop_at:
                session.request_stop()
            time.sleep(0.1)


if __name__ == "__main__":
    main()
