"""A Trainer that stops early (transformers' ``EarlyStoppingCallback``); it imports nothing from elastrain.

It evaluates and saves every 5 steps; its metric never improves after the first evaluation (a constant), so the
patience counter grows by one at each evaluation and training stops at the evaluation that makes it 3 (step 20),
whatever the world size. Each rank prints ``ES_STEP step=<n> world=<size>`` after each step (after sleeping
``ES_STEP_SLEEP`` seconds, ``HOLD_S`` more while the file ``ES_HOLD`` exists), ``ES_EVAL step=<n> patience=<counter>
world=<size>`` after each evaluation, and ``ES_DONE rank=<r> step=<n>`` at the end.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from transformers import EarlyStoppingCallback, Trainer, TrainerCallback, TrainingArguments

STEP_SLEEP = float(os.environ.get("ES_STEP_SLEEP", "0"))
HOLD = os.environ.get("ES_HOLD", "")
HOLD_S = 5.0  # 10 steps held (the second evaluation to the stop at step 20) outlast a joiner's start on a loaded box


class Samples(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randn(n, 4, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x)
        return {"loss": ((out - labels) ** 2).mean(), "logits": out}


class Report(TrainerCallback):
    def __init__(self, stopper: EarlyStoppingCallback) -> None:
        self.stopper = stopper

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        time.sleep(STEP_SLEEP + (HOLD_S if HOLD and os.path.exists(HOLD) else 0.0))
        print(f"ES_STEP step={state.global_step} world={args.world_size}", flush=True)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        counter = self.stopper.early_stopping_patience_counter
        print(f"ES_EVAL step={state.global_step} patience={counter} world={args.world_size}", flush=True)


def main() -> None:
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=os.environ["ES_OUTPUT_DIR"],
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        max_steps=200,
        eval_strategy="steps",
        eval_steps=5,
        save_strategy="steps",
        save_steps=5,
        load_best_model_at_end=True,
        metric_for_best_model="const",
        logging_steps=5,
        learning_rate=1e-2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    stopper = EarlyStoppingCallback(early_stopping_patience=3)
    trainer = Trainer(
        model=Tiny(),
        args=args,
        train_dataset=Samples(64, 0),
        eval_dataset=Samples(16, 1),
        compute_metrics=lambda prediction: {"const": 1.0},
        callbacks=[stopper, Report(stopper)],
    )
    trainer.train()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    print(f"ES_DONE rank={rank} step={trainer.state.global_step}", flush=True)


if __name__ == "__main__":
    main()
