"""A minimal training script: two ranks agree on a sum with gloo, and rank 0 prints its WorkerEnv."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from elastrain import WorkerEnv

env = WorkerEnv.from_environ()
dist.init_process_group("gloo", timeout=timedelta(seconds=env.collective_timeout_s or 60))
t = torch.tensor([float(env.rank + 1)])
dist.all_reduce(t)
if env.rank == 0:
    print(
        f"world_size={env.world_size} sum={int(t.item())} start_reason={env.start_reason.value} "
        f"restart_count={env.restart_count} pid={os.getpid()}",
        flush=True,
    )
dist.destroy_process_group()
