"""A Session job with an FSDP2-sharded model (``Session(shard=...)``), for the sharded live tests.

Lines (parsed by tests/integration/test_sharded_live.py):
  SW_STEP rank= ws= step= pid= loss=
  SW_DONE rank= step= samples= pid= norm= total=   (norm/total: of the full, unsharded parameters)
With SW_SLOW_UNTIL=<file>: 1 s per step until the file exists, then SW_SLEEP.
With SW_DIE_NODE=<group rank> and SW_DIE_AFTER=k: that node's worker SIGKILLs its agent and itself inside the
backward pass of its k-th step (a node vanishing with its shards between two checkpoints, its peers inside
the step's reduce-scatters).
"""

from __future__ import annotations

import os
import signal
import time

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import TensorDataset

from elastrain.session import Session


def shard(model: torch.nn.Module, mesh: DeviceMesh) -> None:
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def main() -> None:
    max_steps = int(os.environ.get("SW_MAX_STEPS", "30"))
    die_after = int(os.environ.get("SW_DIE_AFTER", "0"))
    die_node = int(os.environ.get("SW_DIE_NODE", "-1"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Linear(64, 1)
    )
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(2048, 16, generator=g), torch.randn(2048, 1, generator=g))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    done = [0]  # steps this worker completed

    def die(*_: object) -> None:
        if done[0] + 1 == die_after and int(os.environ.get("GROUP_RANK", "-1")) == die_node:
            os.kill(int(os.environ["ELASTRAIN_AGENT_PID"]), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)

    model[2].register_full_backward_hook(die)
    session = Session(
        model,
        optimizer,
        data,
        global_batch=24,
        micro_batch=4,
        max_steps=max_steps,
        save_every_steps=int(os.environ.get("SW_SAVE_EVERY", "5")),
        shard=shard,
    )
    with session:
        for step in session:
            for mb in step:
                x, y = mb.data
                step.backward(torch.nn.functional.mse_loss(session.model(x), y), mb)
            step.optimizer_step()
            loss = step.mean_loss()
            if step.abandoned:
                continue
            print(
                f"SW_STEP rank={session.rank} ws={session.world_size} step={session.state.step} pid={os.getpid()} "
                f"loss={loss:.10f}",
                flush=True,
            )
            done[0] += 1
            slow = os.environ.get("SW_SLOW_UNTIL", "")  # a file: paced slowly until it exists (a joiner builds)
            time.sleep(1.0 if slow and not os.path.exists(slow) else float(os.environ.get("SW_SLEEP", "0.05")))
        full = get_model_state_dict(session.model, options=StateDictOptions(full_state_dict=True))
        flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for _, t in sorted(full.items())])
        print(
            f"SW_DONE rank={session.rank} step={session.state.step} samples={session.state.samples_seen} "
            f"pid={os.getpid()} norm={flat.norm().item():.10f} total={flat.sum().item():.10f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
