"""Two Trainers, one after the other, in one process (as a k-fold or a sweep script does), their training
DataLoaders with persistent worker processes; it imports nothing from elastrain.

After the first fold it drops its Trainer and model and prints ``FOLD_FREED <bool> <n>``: whether the model was
freed at once, by its reference count (as under torchrun, and as a script that trains the next fold expects of its
memory), and how many child processes (the DataLoader's persistent workers) are left; then pauses ``--fold-pause``
seconds. Each rank prints ``FOLD_STEP fold=<k> step=<n> world=<size>`` after every step (each step sleeps
``--step-sleep`` seconds first, for a test to act during a fold), and at the end ``DONE <rank> <steps of fold 0>
<steps of fold 1>`` (the second fold ends with ``trainer.end()``, as TRL's scripts do). While the file
``--hold-file`` exists, a rank that trains alone (world size 1) waits after its step's line: a test holds the job
in a fold while a node starts. The arguments' defaults come from ``SEQ_OUTPUT_DIR``, ``SEQ_MAX_STEPS``,
``SEQ_STEP_SLEEP``, ``SEQ_FOLD_PAUSE`` and ``SEQ_HOLD_FILE``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
import weakref
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

p = argparse.ArgumentParser()
p.add_argument("--output-dir", default=os.environ.get("SEQ_OUTPUT_DIR"))
p.add_argument("--max-steps", type=int, default=int(os.environ.get("SEQ_MAX_STEPS", "6")))
p.add_argument("--step-sleep", type=float, default=float(os.environ.get("SEQ_STEP_SLEEP", "0")))
p.add_argument("--fold-pause", type=float, default=float(os.environ.get("SEQ_FOLD_PAUSE", "0")))
p.add_argument("--hold-file", default=os.environ.get("SEQ_HOLD_FILE"))
args = p.parse_args()


def say(line: str) -> None:
    """One write per line: under ``python -u`` a print of several arguments writes each apart, and the two ranks,
    which print to one stream at the same moment, would interleave their words."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Progress(TrainerCallback):
    def __init__(self, fold: int) -> None:
        self.fold = fold

    def on_step_end(self, targs: Any, state: Any, control: Any, **kwargs: Any) -> None:
        time.sleep(args.step_sleep)
        say(f"FOLD_STEP fold={self.fold} step={state.global_step} world={targs.world_size}")
        while args.hold_file and targs.world_size == 1 and os.path.exists(args.hold_file):
            time.sleep(0.05)


class Samples(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, fold: int) -> None:
        g = torch.Generator().manual_seed(fold)
        self.x = torch.randn(48, 8, generator=g)
        self.y = torch.randn(48, 4, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": ((self.net(x) - labels) ** 2).mean()}


def fold(k: int, end: bool = False) -> tuple[int, weakref.ref[Tiny], int]:
    torch.manual_seed(k)
    model = Tiny()
    targs = TrainingArguments(
        output_dir=f"{args.output_dir}/fold-{k}",
        per_device_train_batch_size=4,
        max_steps=args.max_steps,
        save_steps=3,
        logging_steps=1,
        learning_rate=1e-2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=2,
        dataloader_persistent_workers=True,
    )
    trainer = Trainer(model=model, args=targs, train_dataset=Samples(k), callbacks=[Progress(k)])
    trainer.train()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if end:
        trainer.end()  # as TRL's scripts end: the process group destroyed while DDP's model still holds it
    return trainer.state.global_step, weakref.ref(model), rank


steps0, model0, _ = fold(0)
say(f"FOLD_FREED {model0() is None} {len(multiprocessing.active_children())}")
time.sleep(args.fold_pause)
steps1, _, rank = fold(1, end=True)
say(f"DONE {rank} {steps0} {steps1}")
