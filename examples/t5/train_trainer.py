"""Fine-tune T5 with the Hugging Face ``Trainer``, elastically: the Trainer variant of train.py.

    elastrain-run --standalone --nproc-per-node 2 --checkpoint-dir runs/t5-trainer/ckpt \\
        examples/t5/train_trainer.py --output-dir runs/t5-trainer

An ordinary Trainer script plus the four ``# elastrain`` lines: batch settings that keep the global
batch at any world size, a training set read as a world-size independent stream from the
checkpoint's sample cursor, a callback that commits complete checkpoints and keeps metrics keyed by
global step, and the resume point every rank verified. Kill it and start it again with any number
of processes: it continues at the next global step and the next unseen sample. Runs offline on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import build_dataset, collate
from model import PRESETS, build_model

from elastrain import WorkerEnv
from elastrain.integrations.hf_trainer import ElasticTrainerRun

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model size built from a config")
p.add_argument("--max-steps", type=int, default=300, help="optimizer steps in the whole job")
p.add_argument("--global-batch-size", type=int, default=16, help="samples per optimizer step, at any world size")
p.add_argument("--micro-batch-size", type=int, default=8, help="most samples per forward pass on one rank")
p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
p.add_argument("--warmup-steps", type=int, default=20, help="linear warm-up, then linear decay")
p.add_argument("--output-dir", default="runs/t5-trainer", help="data, tokenizer, summary.json")
p.add_argument("--data-dir", default=None, help="cached pairs and tokenizer (default: OUTPUT_DIR/data)")
p.add_argument("--seed", type=int, default=0, help="model init and data order")
p.add_argument("--save-every", type=int, default=25, help="checkpoint every N steps")
p.add_argument("--eval-size", type=int, default=256, help="held-out pairs")
p.add_argument("--train-limit", type=int, default=None, help="use only the first N training pairs")
args = p.parse_args()

env = WorkerEnv.from_environ()
out = Path(args.output_dir)
data_dir = Path(args.data_dir) if args.data_dir else out / "data"
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

train_set, eval_set, tokenizer = build_dataset(
    data_dir, rank=env.rank, eval_size=args.eval_size, limit=args.train_limit
)
model = build_model(args.preset, tokenizer, seed=args.seed)
pad_collate = collate(tokenizer.pad_token_id)


def collate_for_t5(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    batch = pad_collate(items)
    batch.pop("ids")  # sample ids are for audits; T5's forward does not take them
    return batch


elastic = ElasticTrainerRun(  # elastrain: global batch, data stream, checkpoints, metrics
    global_batch=args.global_batch_size,
    micro_batch=args.micro_batch_size,
    max_steps=args.max_steps,
    output_dir=env.checkpoint_dir or out / "checkpoints",
    seed=args.seed,
)
training_args = TrainingArguments(
    **elastic.training_args(),  # elastrain
    learning_rate=args.lr,
    warmup_steps=args.warmup_steps,
    weight_decay=0.01,
    max_grad_norm=1.0,
    save_strategy="steps",
    save_steps=args.save_every,
    logging_steps=10,
    report_to=[],
    use_cpu=True,
    disable_tqdm=True,
    remove_unused_columns=False,
    seed=args.seed,
)
trainer = Trainer(
    model=model,
    args=training_args,
    train_dataset=elastic.dataset(train_set),  # elastrain
    data_collator=collate_for_t5,
    callbacks=[elastic.callback],  # elastrain
)
result = trainer.train(resume_from_checkpoint=elastic.resume_from())  # elastrain
eval_loss = trainer.evaluate(eval_dataset=eval_set)["eval_loss"] if args.eval_size else float("nan")
if trainer.is_world_process_zero():
    # The world now (under elastrain-run's live mode a worker may have regrouped since the script read its env).
    summary = {"step": trainer.state.global_step, "restored_step": elastic.start_step}
    summary.update(world_size=training_args.world_size, train_loss=result.training_loss, eval_loss=eval_loss)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary))
    print("done", json.dumps(summary), flush=True)
