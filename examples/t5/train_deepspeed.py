"""Fine-tune T5 with DeepSpeed ZeRO, elastically: the DeepSpeed variant of train.py.

    elastrain-run --standalone --nproc-per-node 2 --checkpoint-dir runs/t5-ds/ckpt \\
        examples/t5/train_deepspeed.py --deepspeed examples/t5/ds_zero2.json --output-dir runs/t5-ds

Kill it and start it again with any number of processes or nodes: it resumes from the newest
complete checkpoint, converting it to DeepSpeed's universal format when the world size changed,
with the same global batch and the exact next samples. Runs offline on CPU (gloo). The elastrain
parts are marked ``# elastrain``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import build_dataset, collate
from model import PRESETS, build_model

from elastrain.data import ElasticSampler
from elastrain.integrations import deepspeed as eds
from elastrain.metrics import METRICS_FILENAME, MetricsWriter
from elastrain.scaling import warmup_cosine
from elastrain.train_state import TrainState

DEFAULT_CONFIG: dict[str, Any] = {"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0, "steps_per_print": 10**9}

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument(
    "--deepspeed", default=None, help="DeepSpeed config JSON (default: ZeRO-2); its batch keys are the intent"
)
p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model size built from a config")
p.add_argument("--max-steps", type=int, default=300, help="optimizer steps in the whole job")
p.add_argument("--global-batch-size", type=int, default=16, help="samples per step unless the config sets it")
p.add_argument(
    "--micro-batch-size", type=int, default=8, help="most samples per forward pass unless the config sets it"
)
p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
p.add_argument("--warmup-steps", type=int, default=20, help="linear warm-up, then cosine decay to 10%%")
p.add_argument("--output-dir", default="runs/t5-deepspeed", help="data, tokenizer, metrics, summary.json")
p.add_argument("--data-dir", default=None, help="cached pairs and tokenizer (default: OUTPUT_DIR/data)")
p.add_argument("--seed", type=int, default=0, help="model init and data order")
p.add_argument("--save-every", type=int, default=25, help="checkpoint every N steps")
p.add_argument("--eval-size", type=int, default=256, help="held-out pairs")
p.add_argument("--train-limit", type=int, default=None, help="use only the first N training pairs")
args = p.parse_args()

env = eds.init_distributed()  # elastrain: gloo on CPU, the launcher's collective timeout, no op compile
out = Path(args.output_dir)
data_dir = Path(args.data_dir) if args.data_dir else out / "data"
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

train_set, eval_set, tokenizer = build_dataset(
    data_dir, rank=env.rank, eval_size=args.eval_size, limit=args.train_limit
)
model = build_model(args.preset, tokenizer, seed=args.seed)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

user_config = json.loads(Path(args.deepspeed).read_text()) if args.deepspeed else dict(DEFAULT_CONFIG)
user_config.setdefault("train_batch_size", args.global_batch_size)
user_config.setdefault("train_micro_batch_size_per_gpu", args.micro_batch_size)
user_config.setdefault("zero_allow_untested_optimizer", True)
config, batch = eds.elastic_config(user_config, env.world_size, log=env.rank == 0)  # elastrain: same global batch
engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

sampler = ElasticSampler(train_set, batch.plan, env.rank, seed=args.seed)  # elastrain: world-size independent order
state = TrainState()
ckpt_dir = env.checkpoint_dir or out / "checkpoints"
ckpt = eds.DeepSpeedCheckpointer(engine, directory=ckpt_dir, keep_last=2, interval_steps=args.save_every)  # elastrain
ckpt.register(sampler=sampler, train_state=state)
restored = ckpt.restore()  # elastrain: newest complete checkpoint, any world size
state.start(env.world_size)
schedule = warmup_cosine(args.warmup_steps * batch.plan.global_batch, args.max_steps * batch.plan.global_batch, 0.1)
metrics = None
if env.rank == 0:
    metrics = MetricsWriter(out / METRICS_FILENAME, uuid.uuid4().hex[:12], state.step)
    print(f"start step={state.step} world_size={env.world_size} {batch.plan.describe()}", flush=True)
fn = collate(tokenizer.pad_token_id)

t0 = time.perf_counter()
loss_sum, step_loss = torch.zeros(()), float("nan")
while state.step < args.max_steps:
    for group in engine.optimizer.param_groups:
        group["lr"] = args.lr * schedule(state.samples_seen)
    rank_step = next(sampler.steps())
    loss_sum.zero_()
    for micro in rank_step.micro_batches:
        b = fn([train_set[i] for i in micro])
        loss = engine(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"]).loss
        loss_sum += loss.detach() * len(micro)
        engine.backward(loss * eds.loss_multiplier(len(micro), batch, rank_step.global_size))  # elastrain
        engine.step()
    dist.all_reduce(loss_sum)
    sampler.commit(rank_step)  # elastrain: the data cursor moves only once the step is learnt
    state.advance(rank_step.global_size, sampler.epoch)
    step_loss = float(loss_sum) / rank_step.global_size
    if metrics is not None:
        metrics.log(state.step, loss=step_loss, world_size=env.world_size, samples=state.samples_seen)
        if state.step % 10 == 0:
            print(f"step {state.step} loss {step_loss:.4f} {(time.perf_counter() - t0) / 10:.2f}s/step", flush=True)
            t0 = time.perf_counter()
    ckpt.maybe_save(state.step)  # elastrain: every --save-every steps, or when the launcher asks
ckpt.save(state.step)
ckpt.close()
if env.rank == 0:
    summary = {"step": state.step, "loss": step_loss, "world_size": env.world_size, "samples": state.samples_seen}
    summary["restored_step"] = restored.step if restored else 0
    (out / "summary.json").write_text(json.dumps(summary))
    print("done", json.dumps(summary), flush=True)
