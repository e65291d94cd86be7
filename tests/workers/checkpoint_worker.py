"""Training script for the checkpoint integration tests (launched by ``python -m elastrain``).

A small model trained on data that depends only on (step, rank), so that a resumed run is
reproducible. ``--kill INSTANT`` makes one rank SIGKILL itself at an instant of a save.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from elastrain import WorkerEnv, storage
from elastrain.checkpoint import Checkpointer, dcp_write, layout
from elastrain.log import configure

KILL_INSTANTS = ("before_write", "mid_write", "before_marker", "marker_tmp")


def die() -> None:
    print(f"KILLING rank {WorkerEnv.from_environ().rank}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def arm(instant: str, step: int, rank: int) -> None:
    """Patch the library so that ``rank`` kills itself at ``instant`` of the save of ``step``."""
    if WorkerEnv.from_environ().rank != rank:
        return
    if instant == "before_write":
        orig_save = dcp_write.dcp_save

        def save(*a: Any, **k: Any) -> Any:
            if str(k["storage_writer"].path).endswith(layout.step_dir_name(step)):
                die()
            return orig_save(*a, **k)

        dcp_write.dcp_save = save
    elif instant == "mid_write":
        from torch.distributed.checkpoint import filesystem

        orig_item = filesystem._write_item
        calls = {"n": 0, "armed": False}
        orig_save2 = dcp_write.dcp_save

        def save2(*a: Any, **k: Any) -> Any:
            calls["armed"] = str(k["storage_writer"].path).endswith(layout.step_dir_name(step))
            return orig_save2(*a, **k)

        def item(*a: Any, **k: Any) -> Any:
            out = orig_item(*a, **k)
            if calls["armed"]:
                calls["n"] += 1
                if calls["n"] == 2:
                    a[1].flush()
                    die()
            return out

        filesystem._write_item = item
        dcp_write.dcp_save = save2
    elif instant == "before_marker":
        orig_marker = layout.write_commit_marker

        def marker(path: str, *a: Any, **k: Any) -> Any:
            if path.endswith(layout.step_dir_name(step)):
                die()
            return orig_marker(path, *a, **k)

        layout.write_commit_marker = marker  # type: ignore[assignment]
    elif instant == "marker_tmp":
        orig_write = storage.LocalStorage.write_atomic

        def write(self: Any, path: str, data: bytes) -> None:
            if path.endswith(f"{layout.step_dir_name(step)}/{layout.MARKER}"):
                tmp = os.path.join(os.path.dirname(path), f".{layout.MARKER}.{os.getpid()}.tmp")
                with open(tmp, "wb") as f:
                    f.write(data)
                die()
            orig_write(self, path, data)

        storage.LocalStorage.write_atomic = write  # type: ignore[method-assign]


class TrainState:
    def __init__(self) -> None:
        self.step = 0
        self.world_sizes: list[int] = []

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "world_sizes": list(self.world_sizes)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])
        self.world_sizes = list(sd["world_sizes"])


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    msd, osd = get_state_dict(model, [opt], options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": msd, "optim": osd}


def dump(model: torch.nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    full = full_state(model, opt)
    if WorkerEnv.from_environ().rank == 0:
        torch.save(full, path)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha1()
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        h.update(local.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--dir", default=None, help="checkpoint directory (default: --checkpoint-dir of elastrain-run)")
    p.add_argument("--interval", type=int, default=None)
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--parallel", choices=("fsdp", "ddp"), default="ddp")
    p.add_argument("--dump-dir", default=None, help="rank 0 saves the full state after restore and --dump-steps")
    p.add_argument("--dump-steps", type=int, nargs="*", default=[])
    p.add_argument("--kill", choices=KILL_INSTANTS, default=None)
    p.add_argument("--kill-step", type=int, default=0)
    p.add_argument("--kill-rank", type=int, default=0)
    p.add_argument("--sleep", type=float, default=0.0)
    args = p.parse_args()
    configure()
    env = WorkerEnv.from_environ()
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo", timeout=timedelta(seconds=env.collective_timeout_s or 60))
    rank, world = env.rank, env.world_size
    torch.manual_seed(0)
    model: torch.nn.Module = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.Tanh(), torch.nn.Linear(33, 7))
    if not distributed:
        pass
    elif args.parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    state = TrainState()
    ckpt = Checkpointer(args.dir, interval_steps=args.interval, keep_last=args.keep_last)
    ckpt.register(model=model, optimizer=opt, scheduler=sched, train_state=state)
    info = ckpt.restore()
    state.world_sizes.append(world)
    if rank == 0:
        print("RESTORED", json.dumps(None if info is None else info.__dict__), flush=True)
        print("CONTROL", env.control_dir, flush=True)
        print("DIGEST", digest(model), flush=True)
    if args.dump_dir:
        dump(model, opt, os.path.join(args.dump_dir, f"restored-ws{world}.pt"))
    if args.kill:
        arm(args.kill, args.kill_step, args.kill_rank)
    start = info.step + 1 if info else 1
    for step in range(start, args.steps + 1):
        g = torch.Generator().manual_seed(step * 100 + rank)
        x = torch.randn(8, 16, generator=g)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        state.step = step
        if args.parallel == "ddp" and rank == 0:
            print(f"STEP {step} {digest(model)}", flush=True)
        ckpt.maybe_save(step)
        if args.dump_dir and step in args.dump_steps:
            dump(model, opt, os.path.join(args.dump_dir, f"step-{step}.pt"))
        if args.sleep:
            time.sleep(args.sleep)
    ckpt.close()
    if rank == 0:
        print("DONE", state.step, json.dumps(state.world_sizes), flush=True)
    if distributed:
        dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
