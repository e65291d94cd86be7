"""A Hugging Face Trainer script with a GPT-2 of a chosen size, for ``bench/state_transfer.py --workload trainer``.

Written the way Trainer users write scripts: it imports nothing from elastrain (under ``elastrain-run`` the
zero-code integration makes it elastic). The model is built from a config (no download): GPT-2 with
``XT_LAYERS`` blocks of width 1024 (12.6M parameters each), a 1,024-token vocabulary, sequences of 64 tokens of
random ids. Lines: ``XW_STEP rank= ws= step= t=`` per optimizer step, from a callback. With ``XW_STOP_FILE``: once
the file exists it holds a step at which training stops. With ``XW_DIE_FILE=path`` and ``XW_DIE_NODE=<group rank>``
(the bench's instrument, as in ``transfer_worker.py``): in the first step that starts once the file exists, that
node's worker SIGKILLs its agent, its zygote and itself at the end of the step's first backward pass, from the
embedding's gradient hook (the last to run in a backward pass).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from datasets import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


class StepLines(TrainerCallback):
    def __init__(self, stop_file: str) -> None:
        self.stop_file = stop_file
        self.stop_at: int | None = None

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        ready = dist.is_available() and dist.is_initialized()
        rank, world = (dist.get_rank(), dist.get_world_size()) if ready else (0, 1)
        print(f"XW_STEP rank={rank} ws={world} step={state.global_step} t={time.time():.3f}", flush=True)
        if self.stop_at is None and self.stop_file and os.path.exists(self.stop_file):
            with open(self.stop_file) as f:
                self.stop_at = int(f.read() or "0")
        if self.stop_at is not None and state.global_step >= self.stop_at:
            control.should_training_stop = True
        return control


class DieAt(TrainerCallback):
    """The bench's SIGKILL of this whole node (group rank ``node``) at the end of the first backward pass of the first
    step that starts once ``file`` exists."""

    def __init__(self, model: GPT2LMHeadModel, file: str, node: int) -> None:
        self.file, self.node, self.armed = file, node, False
        model.transformer.wte.weight.register_hook(self._hook)

    def _hook(self, grad: torch.Tensor) -> torch.Tensor:
        if self.armed:
            from bench.support.node_kill import kill_own_node

            kill_own_node()
        return grad

    def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.armed = os.environ.get("GROUP_RANK") == str(self.node) and os.path.exists(self.file)


def main() -> None:
    layers = int(os.environ.get("XT_LAYERS", "2"))
    out = sys.argv[1] if len(sys.argv) > 1 else "runs/trainer-size"
    config = GPT2Config(n_embd=1024, n_layer=layers, n_head=16, vocab_size=1024, n_positions=64)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (4096, 64), generator=g)
    train = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=100_000,
        learning_rate=1e-4,
        save_strategy="no",
        logging_steps=10,
        report_to="none",
        use_cpu=True,
        dataloader_num_workers=0,
        seed=0,
    )
    callbacks: list[TrainerCallback] = [StepLines(os.environ.get("XW_STOP_FILE", ""))]
    if os.environ.get("XW_DIE_FILE"):
        callbacks.append(DieAt(model, os.environ["XW_DIE_FILE"], int(os.environ.get("XW_DIE_NODE", "-1"))))
    trainer = Trainer(model=model, args=args, train_dataset=train, callbacks=callbacks)
    trainer.train()


if __name__ == "__main__":
    main()
