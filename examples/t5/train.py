"""Fine-tune T5 to summarise Python functions (code → first line of its docstring), elastically.

    python examples/t5/train.py --preset tiny --max-steps 300                    # one process
    elastrain-run --nnodes 1:3 --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29400 examples/t5/train.py --output-dir runs/t5     # on every node

Offline by default: ~6k pairs from the standard library, a BPE tokenizer trained on them, and a
T5 built from a preset config. ``--model t5-small`` and ``--dataset cnn_dailymail`` fine-tune a
real checkpoint on a real dataset where a network is available.

The elastrain parts are marked ``# elastrain``: the Session restores the newest checkpoint at any
world size, feeds each rank its share of a world-size-independent sample order, keeps the global
batch constant, saves asynchronously, and logs metrics keyed by global step. Kill any node, or all
of them, and run the same command again: training continues from the last checkpoint.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers  # noqa: F401 - imported here, at the top, so that elastrain-run's zygote preloads it
from transformers import T5ForConditionalGeneration  # noqa: F401 - (its lazy parts too): restarts skip ~7 s

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import build_dataset, collate, rouge_l
from model import PRESETS, build_model, load_pretrained_tokenizer

from elastrain import WorkerEnv
from elastrain.metrics import read_events
from elastrain.metrics.events import append_json_line
from elastrain.scaling import warmup_cosine
from elastrain.session import Session, Step

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model size built from a config")
p.add_argument("--model", default=None, help="from_pretrained name or path instead of a preset (e.g. t5-small)")
p.add_argument("--dataset", default=None, help="a `datasets` name instead of the offline stdlib pairs")
p.add_argument("--max-steps", type=int, default=600, help="optimizer steps in the whole job")
p.add_argument("--global-batch-size", type=int, default=16, help="samples per optimizer step, at any world size")
p.add_argument("--micro-batch-size", type=int, default=16, help="most samples per forward pass on one rank")
p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
p.add_argument("--warmup-steps", type=int, default=30, help="linear warm-up, then cosine decay to 10%%")
p.add_argument("--output-dir", default="runs/t5", help="checkpoints, data, tokenizer, metrics, summary.json")
p.add_argument("--data-dir", default=None, help="cached pairs and tokenizer (default: OUTPUT_DIR/data)")
p.add_argument("--seed", type=int, default=0, help="model init and data order")
p.add_argument("--save-every", type=int, default=25, help="checkpoint every N steps (asynchronous)")
p.add_argument("--eval-every", type=int, default=100, help="held-out loss every N steps (0: only at the end)")
p.add_argument("--eval-size", type=int, default=256, help="held-out pairs")
p.add_argument("--rouge-samples", type=int, default=32, help="held-out pairs decoded for ROUGE-L at the end")
p.add_argument("--train-limit", type=int, default=None, help="use only the first N training pairs")
p.add_argument("--ledger", action="store_true", help="record every sample id each rank trains on (tests)")
p.add_argument("--step-sleep", type=float, default=0.0, help="pause after each step (benchmarks pace a trace with it)")
args = p.parse_args()

# elastrain: rank, world size and why this start happened. Under --live they can change while the process
# runs, and a warm worker (started before its node joined) has no rank yet: after the Session is built, use
# session.rank and session.world_size.
env = WorkerEnv.from_environ()
out = Path(args.output_dir)
data_dir = Path(args.data_dir) if args.data_dir else out / "data"
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

# Data and tokenizer: built by rank 0 on the first start, then read from data_dir by every rank and restart
# (warm workers all say rank 0: each builds the same files, written atomically).
tokenizer = load_pretrained_tokenizer(args.model) if args.model else None
train_set, eval_set, tokenizer = build_dataset(
    data_dir, tokenizer, rank=env.rank, eval_size=args.eval_size, limit=args.train_limit, dataset=args.dataset
)
model = build_model(args.model or args.preset, tokenizer, seed=args.seed)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
pad_id = tokenizer.pad_token_id
samples_total = args.max_steps * args.global_batch_size


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}


@torch.no_grad()
def evaluate(net: torch.nn.Module, rouge_samples: int = 0, shard: tuple[int, int] = (0, 1)) -> dict[str, float]:
    """Token-weighted loss over the held-out set; ROUGE-L of greedy summaries of its first pairs.

    With ``shard=(rank, world_size)`` every rank evaluates its share of the batches and the sums are
    all-reduced: no rank idles in a collective while another evaluates alone.
    """
    net.eval()
    rank, world_size = shard
    starts = range(0, len(eval_set), 64)[rank::world_size]
    batches = [collate(pad_id)([eval_set[j] for j in range(i, min(i + 64, len(eval_set)))]) for i in starts]
    sums = torch.zeros(2, dtype=torch.float64)  # loss × tokens, tokens
    for b in batches:
        n = int((b["labels"] != -100).sum())
        sums += torch.tensor([float(net(**model_inputs(b)).loss) * n, n], dtype=torch.float64)
    if world_size > 1:
        torch.distributed.all_reduce(sums)
    result = {"eval_loss": float(sums[0] / sums[1])}
    if rouge_samples:
        b = collate(pad_id)([eval_set[i] for i in range(min(rouge_samples, len(eval_set)))])
        gen = net.generate(input_ids=b["input_ids"], attention_mask=b["attention_mask"], max_new_tokens=32)
        preds = tokenizer.batch_decode(gen, skip_special_tokens=True)
        scores = [rouge_l(pr, ref) for pr, ref in zip(preds, eval_set.targets, strict=False)]
        result["rouge_l"] = sum(scores) / len(scores)
    net.train()
    return result


# elastrain: the session owns the process group, DDP, the elastic sampler, checkpoints and metrics.
session = Session(
    model,
    optimizer,
    train_set,
    global_batch=args.global_batch_size,  # constant policy: the same batch at every world size
    micro_batch=args.micro_batch_size,
    collate_fn=collate(pad_id),
    token_count=lambda b: int((b["labels"] != -100).sum()),  # normalise by tokens: exact at any split
    lr_schedule=warmup_cosine(min(args.warmup_steps, args.max_steps) * args.global_batch_size, samples_total, 0.1),
    max_steps=args.max_steps,
    seed=args.seed,
    checkpoint_dir=env.checkpoint_dir or str(out / "checkpoints"),  # elastrain-run --checkpoint-dir wins
    save_every_steps=args.save_every,
    metrics_dir=str(out),
)


def progress_bar(initial: int, world_size: int) -> Any:
    """A tqdm bar on rank 0 where tqdm is installed (``None`` elsewhere: then a line every 50 steps)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=args.max_steps, initial=initial, disable=session.rank != 0, mininterval=2.0, ncols=100,
                desc=f"t5 ws={world_size}", file=sys.stdout)  # fmt: skip


def record_ids(step: Step, ids: torch.Tensor) -> None:
    """--ledger: which samples this rank trains on at which step, for the exactly-once test.

    Written before the micro-batch's backward, under the segment (world) that computes the step: a rank
    SIGKILLed right after the step's gradient sync contributed its samples to a step its peers commit, so its
    row must already be there; a step that a regroup gives up or rolls back is re-run in a new segment that
    starts before it, which supersedes these rows (as it does the metrics' points)."""
    row = {"segment": session.segment, "step": step.number, "epoch": step.epoch, "ids": ids.tolist()}
    append_json_line(out / f"ledger-rank{session.rank}.jsonl", row)


with session:
    if session.rank == 0:
        restored = session.restored.step if session.restored else None
        why = session.env.start_reason.value
        print(f"world size {session.world_size}, {why}, restored step {restored}", flush=True)
    bar = progress_bar(session.state.step, session.world_size)
    for step in session:  # elastrain: stops at --max-steps, wherever the job restarted
        for mb in step:  # this rank's share of the global batch
            if args.ledger:  # before the backward, whose gradient sync may be the last thing this rank does
                record_ids(step, mb.data["ids"])
            loss = session.model(**model_inputs(mb.data)).loss
            step.backward(loss, mb)  # elastrain: scaled so the gradient is the global batch's mean
        step.optimizer_step()  # elastrain: optimizer, data cursor, train state, checkpoint when due
        if step.abandoned:  # elastrain --live: a membership change gave this step up; the next one redoes it
            continue
        if args.step_sleep:
            time.sleep(args.step_sleep)
        mean_loss = step.mean_loss()
        step.log(loss=mean_loss, samples=session.state.samples_seen, world_size=session.world_size, lr=step.lr)
        if args.eval_every and step.number % args.eval_every == 0 and step.number < args.max_steps:
            metrics = evaluate(session.module, shard=(session.rank, session.world_size))  # on every rank
            step.log(samples=session.state.samples_seen, **metrics)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{mean_loss:.3f}", refresh=False)
        elif session.rank == 0 and step.number % 50 == 0:
            print(f"step {step.number} loss {mean_loss:.4f}", flush=True)
    if bar is not None:
        bar.close()


# The process group is closed: rank 0 evaluates alone, nobody waits on it.
if session.rank == 0:
    final = evaluate(session.module, rouge_samples=args.rouge_samples)
    session.log(session.state.step, samples=session.state.samples_seen, **final)
    # Every start of this job is in the events file, whatever killed the ones before.
    starts = read_events(session.events.path, "start") if session.events.path else []
    # A live regroup changes the world without a start: the world sizes the job trained at, starts and regroups.
    regroups = read_events(session.events.path, "regroup") if session.events.path else []
    worlds = sorted(
        [(s["time"], int(s["world_size"])) for s in starts]
        + [(r["time"], int(str(r["world_size"]).rpartition("->")[2])) for r in regroups],
    )
    resumes = [
        {
            "step": s["restored_step"],
            "world_size_before": prev["world_size"],
            "world_size_after": s["world_size"],
            "why": s.get("start_reason"),
            "time": s["time"],
        }
        for prev, s in itertools.pairwise(starts)
        if s.get("restored_step") is not None
    ]
    summary = {
        "final_eval_loss": final["eval_loss"],
        "final_rouge_l": final.get("rouge_l"),
        "global_step": session.state.step,
        "samples_seen": session.state.samples_seen,
        "epoch": session.state.epoch,
        "world_sizes": [w for _, w in worlds],  # one per start and per live regroup
        "regroups": len(regroups),
        "resumes": resumes,
        "restarts": max(len(starts) - 1, 0),
        "elapsed_s": round(time.time() - starts[0]["time"], 2) if starts else None,
        "model": args.model or args.preset,
        "seed": args.seed,
        "global_batch_size": args.global_batch_size,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(
        f"final eval loss {final['eval_loss']:.4f}, ROUGE-L {final.get('rouge_l', math.nan):.3f}, "
        f"step {session.state.step}, world sizes {summary['world_sizes']}",
        flush=True,
    )
