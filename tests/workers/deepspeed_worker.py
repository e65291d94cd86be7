"""A tiny DeepSpeed ZeRO job for the integration tests: restore, train, save, and hooks that kill it mid-save.

Rank 0 appends one JSON line per step to ``--ledger``: the attempt, world size, step, the step's
global mean loss and the samples it used.

    --kill-save-at S   on the first attempt, rank 1 writes half of its optimizer shard of step S and
                       SIGKILLs itself (a preemption in the middle of DeepSpeed's save)
    --kill-convert     on the first attempt, rank 0 SIGKILLs itself while the universal conversion runs
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import threading
import time

import deepspeed
import torch
import torch.distributed as dist

from elastrain.data import ElasticSampler
from elastrain.integrations import deepspeed as eds
from elastrain.train_state import TrainState

p = argparse.ArgumentParser()
p.add_argument("--stage", type=int, default=2)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--save-at", type=int, nargs="*", default=[])
p.add_argument("--kill-save-at", type=int, default=None)
p.add_argument("--kill-convert", action="store_true")
p.add_argument("--ledger", required=True)
args = p.parse_args()

env = eds.init_distributed()
ckpt_dir = env.checkpoint_dir or ""
user_config = {
    "train_batch_size": 12,
    "train_micro_batch_size_per_gpu": 6,
    "zero_optimization": {"stage": args.stage},
    "steps_per_print": 10**9,
    "zero_allow_untested_optimizer": True,
}
config, batch = eds.elastic_config(user_config, env.world_size, log=env.rank == 0)

torch.manual_seed(0)
N = 240
X = torch.randn(N, 8)
Y = torch.randn(N, 4)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

sampler = ElasticSampler(N, batch.plan, env.rank, seed=1)
state = TrainState()
ckpt = eds.DeepSpeedCheckpointer(engine, keep_last=3)
ckpt.register(sampler=sampler, train_state=state)

if args.kill_convert and env.restart_count == 0 and env.rank == 0:

    def kill_when_converting() -> None:
        while not glob.glob(os.path.join(ckpt_dir, "step-*", ".universal-*", "*")):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=kill_when_converting, daemon=True).start()

if args.kill_save_at is not None and env.restart_count == 0 and env.rank == 1:
    real_save = engine.checkpoint_engine.save
    kill_tag = f"step-{args.kill_save_at:010d}"

    def dying_save(state_dict: object, path: str) -> None:
        if kill_tag in path and "optim_states" in path:
            with open(path, "wb") as f:
                f.write(b"\0" * 100)
                f.flush()
                os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        real_save(state_dict, path)

    engine.checkpoint_engine.save = dying_save

info = ckpt.restore()
restored = info.step if info else 0
state.start(env.world_size)

ledger = open(args.ledger, "a") if env.rank == 0 else None  # noqa: SIM115
while state.step < args.steps:
    rank_step = next(sampler.steps())
    local = torch.zeros(())
    for micro in rank_step.micro_batches:
        idx = torch.tensor(micro)
        loss = ((engine(X[idx]) - Y[idx]) ** 2).mean()
        local += loss.detach() * len(micro)
        engine.backward(loss * eds.loss_multiplier(len(micro), batch, rank_step.global_size))
        engine.step()
    dist.all_reduce(local)
    sampler.commit(rank_step)
    state.advance(rank_step.global_size, sampler.epoch)
    if ledger is not None:
        row = {
            "attempt": env.restart_count,
            "world_size": env.world_size,
            "restored": restored,
            "step": state.step,
            "loss": float(local) / rank_step.global_size,
            "start": [rank_step.range.start.epoch, rank_step.range.start.cursor],
        }
        ledger.write(json.dumps(row) + "\n")
        ledger.flush()
    if state.step in args.save_at or (state.step == args.kill_save_at and env.restart_count == 0):
        ckpt.save(state.step)
ckpt.close()
