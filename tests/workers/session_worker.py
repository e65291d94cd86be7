"""A tiny Session job for the checkpoint failure tests: prints ``STEP n`` on rank 0 and sleeps between steps."""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.utils.data import TensorDataset

from elastrain.session import Session


def _say(line: str) -> None:
    """One line in one write: the workers share the log (unbuffered), and print() writes the text and the newline apart,
    so another process's line could land between them."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-steps", type=int, default=100000)
    p.add_argument("--save-every", type=int, default=1)
    p.add_argument("--on-save-error", choices=("raise", "warn"), default="raise")
    p.add_argument("--sleep", type=float, default=0.05)
    p.add_argument("--metrics-dir", default=None, help="metrics.jsonl and events.jsonl (default: the checkpoint dir)")
    p.add_argument("--checkpoint-dir", default=None, help="default: elastrain-run --checkpoint-dir")
    a = p.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    session = Session(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        data,
        global_batch=8,
        micro_batch=4,
        max_steps=a.max_steps,
        save_every_steps=a.save_every,
        on_save_error=a.on_save_error,
        metrics_dir=a.metrics_dir,
        checkpoint_dir=a.checkpoint_dir,
    )
    with session:
        for step in session:
            for mb in step:
                x, y = mb.data
                step.backward(torch.nn.functional.mse_loss(session.model(x), y), mb)
            step.optimizer_step()
            if session.rank == 0:
                _say(f"STEP {step.number}")
            time.sleep(a.sleep)
    if session.rank == 0:
        _say(f"DONE {session.state.step}")


if __name__ == "__main__":
    main()
