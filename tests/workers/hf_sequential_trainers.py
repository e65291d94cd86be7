"""Two Trainers, one after the other, in one process (as a k-fold or a sweep script does), their training
DataLoaders with persistent worker processes; it imports nothing from elastrain.

After the first fold it drops its Trainer and model and prints ``FOLD_FREED <bool>``: whether the model was freed
(by the garbage collector, as a script that trains the next fold expects of its memory). At the end each rank prints
``DONE <rank> <steps of fold 0> <steps of fold 1>``.
"""

from __future__ import annotations

import argparse
import gc
import weakref

import torch
from transformers import Trainer, TrainingArguments

p = argparse.ArgumentParser()
p.add_argument("--output-dir", required=True)
p.add_argument("--max-steps", type=int, default=6)
args = p.parse_args()


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


def fold(k: int) -> tuple[int, weakref.ref[Tiny]]:
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
    trainer = Trainer(model=model, args=targs, train_dataset=Samples(k))
    trainer.train()
    return trainer.state.global_step, weakref.ref(model)


steps0, model0 = fold(0)
gc.collect()
print("FOLD_FREED", model0() is None, flush=True)
steps1, _ = fold(1)
rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
print("DONE", rank, steps0, steps1, flush=True)
