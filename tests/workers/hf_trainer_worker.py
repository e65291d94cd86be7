"""A tiny Hugging Face Trainer job made elastic with ElasticTrainerRun; it records which samples each step used.

Every rank appends ``{"rank", "step", "world_size", "ids"}`` per optimizer step to ``--ledger``: the
dataset indices its forward passes saw during that step.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from elastrain.integrations.hf_trainer import ElasticTrainerRun

p = argparse.ArgumentParser()
p.add_argument("--max-steps", type=int, required=True)
p.add_argument("--save-steps", type=int, default=2)
p.add_argument("--ledger", required=True)
args = p.parse_args()

N = 50  # not a multiple of the global batch: steps cross epoch boundaries


class Samples(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(N, 8, generator=g)
        self.y = torch.randn(N, 4, generator=g)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i], "sample_id": torch.tensor(i)}


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor, labels: torch.Tensor, sample_id: torch.Tensor) -> dict[str, torch.Tensor]:
        self.seen.extend(int(i) for i in sample_id)
        return {"loss": ((self.net(x) - labels) ** 2).mean()}


class Ledger(TrainerCallback):
    def __init__(self, model: Tiny) -> None:
        self.model = model

    def on_step_end(self, targs: Any, state: Any, control: Any, **kwargs: Any) -> None:
        row = {"rank": targs.process_index, "world_size": targs.world_size, "step": state.global_step}
        row["ids"] = self.model.seen
        row["epoch"] = state.epoch
        with open(args.ledger, "a") as f:
            f.write(json.dumps(row) + "\n")
        self.model.seen = []


elastic = ElasticTrainerRun(global_batch=12, micro_batch=3, max_steps=args.max_steps, seed=3)
model = Tiny()
targs = TrainingArguments(
    **elastic.training_args(),
    learning_rate=1e-2,
    save_strategy="steps",
    save_steps=args.save_steps,
    logging_steps=1,
    report_to=[],
    use_cpu=True,
    disable_tqdm=True,
    remove_unused_columns=False,
)
trainer = Trainer(
    model=model,
    args=targs,
    train_dataset=elastic.dataset(Samples()),
    callbacks=[elastic.callback, Ledger(model)],
)
trainer.train(resume_from_checkpoint=elastic.resume_from())
if targs.process_index == 0:
    print("FINAL_STEP", trainer.state.global_step, "WORLD", os.environ.get("WORLD_SIZE"), flush=True)
