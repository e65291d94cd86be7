"""A tiny Session job for the object-storage tests (launched by ``python -m elastrain``).

Checkpoints, ``metrics.jsonl`` and ``events.jsonl`` all go to ``--checkpoint-dir`` (a URL in these
tests). ``--hang-step N`` makes rank ``--hang-rank`` stop in the middle of writing its DCP data
file for the save of step N (a few bytes written, the object not closed) and print ``IN_SAVE``,
so that the test can SIGKILL the whole job in the middle of a save.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint import _fsspec_filesystem
from torch.utils.data import Dataset

from elastrain import WorkerEnv
from elastrain.checkpoint import layout
from elastrain.session import Session


class Regression(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x @ torch.tensor([1.5, -2.0, 0.5, 3.0])

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def hang_in_save(step: int, rank: int) -> None:
    """Stop forever inside the write of rank ``rank``'s data file for the save of ``step`` (the rank when it saves:
    a worker started before its round has none yet)."""
    original = _fsspec_filesystem.FileSystem.create_stream
    folder = f"/{layout.step_dir_name(step)}/"

    @contextlib.contextmanager
    def create_stream(self: Any, path: Any, mode: str) -> Iterator[Any]:
        with original(self, path, mode) as stream:
            mine = WorkerEnv.from_environ().rank == rank
            if mine and "w" in mode and folder in str(path) and str(path).endswith(".distcp"):
                stream.write(b"partial shard")
                print("IN_SAVE", path, flush=True)
                time.sleep(600)
            yield stream

    _fsspec_filesystem.FileSystem.create_stream = create_stream  # type: ignore[method-assign]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--hang-step", type=int, default=None)
    p.add_argument("--hang-rank", type=int, default=1)
    a = p.parse_args()
    if a.hang_step is not None:
        hang_in_save(a.hang_step, a.hang_rank)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with Session(
        model,
        optimizer,
        Regression(64),
        global_batch=8,
        micro_batch=2,
        max_steps=a.max_steps,
        save_every_steps=a.save_every,
        keep_last=3,
        seed=7,
    ) as session:
        if session.rank == 0:
            info = session.restored
            print("RESTORED", json.dumps(None if info is None else {"step": info.step, "path": info.path}), flush=True)
        for step in session:
            for mb in step:
                x, y = mb.data
                loss = (session.model(x).squeeze(-1) - y).pow(2).mean()
                step.backward(loss, mb)
            step.optimizer_step()
            step.log(loss=step.mean_loss())
    if session.rank == 0:
        print("DONE", session.state.step, flush=True)


if __name__ == "__main__":
    main()
