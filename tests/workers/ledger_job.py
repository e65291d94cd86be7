"""A tiny deterministic job for the ledger and equivalence tests: it records every sample id it trains on.

Linear regression in float64 through :class:`elastrain.session.Session` (``constant`` policy). Each
rank appends the ids of every step to a shared ledger (a step-keyed metrics file, so the steps an
interrupted start re-runs are superseded), before the step can be checkpointed. Rank 0 writes the
final full-dataset loss to ``result.json``. Run it under ``python -m elastrain`` or alone.

``LEDGER_TERM_AT=<step>`` (in one node's environment): at the first save step from ``<step>`` on that it trains in a
world of two or more, that node's worker SIGTERMs its own agent once the step's gradients are agreed, before its
optimizer step and the step's save, prints ``LEDGER_TERM step=<n>`` and waits a second: the node is asked to leave
while that step's checkpoint is written (``bench/support/node_kill.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset

from elastrain.metrics import MetricsWriter
from elastrain.session import Session

FEATURES = 4


class Regression(Dataset[tuple[int, torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, FEATURES, generator=g, dtype=torch.float64)
        w = torch.tensor([1.5, -2.0, 0.5, 3.0], dtype=torch.float64)
        self.y = self.x @ w + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--samples", type=int, default=60)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--policy", default="constant", choices=["constant", "linear", "sqrt"])
    p.add_argument("--rescale-warmup-steps", type=int, default=0)
    p.add_argument("--async-save", choices=("true", "false"), default="true")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")
    a = p.parse_args(argv)
    term_at = int(os.environ.get("LEDGER_TERM_AT", "0"))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1, dtype=torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = Regression(a.samples)

    with Session(
        model,
        optimizer,
        data,
        global_batch=a.global_batch if a.policy == "constant" else None,
        policy=a.policy,
        rescale_warmup_steps=a.rescale_warmup_steps,
        micro_batch=a.micro_batch,
        max_steps=a.max_steps,
        checkpoint_dir=a.checkpoint_dir,
        save_every_steps=a.save_every,
        async_save=a.async_save == "true",
        num_workers=a.num_workers,
        seed=7,
    ) as session:
        ledger: MetricsWriter | None = None
        for step in session:
            if ledger is None or ledger.segment != session.segment:
                # A new segment at every start and (--live) at every regroup, from the agreed step.
                if ledger is not None:
                    ledger.close()
                path, first = out / "ledger.jsonl", session.state.step
                ledger = MetricsWriter(path, session.segment, first, open_segment=session.rank == 0)
            # Recorded before the step's backward: a step is in a checkpoint only if it is in the ledger, and a rank
            # SIGKILLed right after the step's gradient sync gave its samples to a step its peers commit. (A step
            # that a live regroup gave up is logged too: the next segment, from the agreed step, supersedes it.)
            ids = [int(i) for mb in step.micro_batches for i in mb.data[0]]
            ledger.log(step.number, rank=session.rank, world_size=session.world_size, epoch=step.epoch, ids=ids)
            for mb in step:
                _, x, y = mb.data
                loss = ((session.model(x).squeeze(-1) - y) ** 2).mean()
                step.backward(loss, mb)
            if term_at and step.number >= term_at and step.number % a.save_every == 0 and session.world_size > 1:
                term_at = 0
                print(f"LEDGER_TERM step={step.number}", flush=True)
                from bench.support.node_kill import term_own_agent  # the repository is on the tests' PYTHONPATH

                term_own_agent()
                time.sleep(1.0)  # the agent's request lands after this step's agreement, while its save runs
            step.optimizer_step()
            step.log(loss=step.mean_loss(), lr=optimizer.param_groups[0]["lr"])
            if a.sleep:
                time.sleep(a.sleep)
        if session.rank == 0:
            with torch.no_grad():
                final = float(((model(data.x).squeeze(-1) - data.y) ** 2).mean())
            result = {"final_loss": final, "step": session.state.step, "pid": os.getpid()}
            (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
