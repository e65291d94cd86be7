"""A tiny elastic worker for membership tests and bench/membership.py.

Every ~0.1 s it runs one gloo all_reduce (a "step") and prints a marker line with wall-clock
timestamps, so a test or the bench can see when training goes on at which world size:

    MW_START t0=<process start> init=<after init_process_group> rank=.. ws=.. round=.. restart=.. pid=..
    MW_STEP t=<after the step> step=.. rank=.. ws=.. round=.. restart=.. pid=..

A worker exits 3 (this node's own failure) once the file named by MW_FAIL_FILE exists.
The job ends cleanly (exit 0 on every rank) once the file named by MW_STOP_FILE exists (rank 0 sees
it and tells the others through the all_reduce). If ELASTRAIN_CONTROL_DIR is set it answers save
requests like a real worker would (after agreeing on the step with all ranks) and prints MW_SAVED.
Works under plain torchrun too (the elastrain variables are then missing).
"""

from __future__ import annotations

import time

T0 = time.time()

import os  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> None:
    timeout = float(os.environ.get("ELASTRAIN_COLLECTIVE_TIMEOUT") or os.environ.get("MW_TIMEOUT") or 30)
    imported = time.time()
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    rank, ws = dist.get_rank(), dist.get_world_size()
    rnd = os.environ.get("ELASTRAIN_ROUND", "-")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "-")
    zygote = os.environ.get("ELASTRAIN_ZYGOTE", "0")
    tag = f"rank={rank} ws={ws} round={rnd} restart={restart} zygote={zygote} pid={os.getpid()}"
    print(f"MW_START t0={T0:.3f} imported={imported:.3f} init={time.time():.3f} {tag}", flush=True)
    stop_file = os.environ.get("MW_STOP_FILE")
    channel = None
    if os.environ.get("ELASTRAIN_CONTROL_DIR"):
        from elastrain.control import ControlChannel

        channel = ControlChannel(os.environ["ELASTRAIN_CONTROL_DIR"])
    step = 0
    fail_file = os.environ.get("MW_FAIL_FILE")
    while True:
        if fail_file and os.path.exists(fail_file):
            print(f"MW_FAIL t={time.time():.3f} {tag}", flush=True)
            sys.exit(3)  # this node's own failure (a bad GPU, say)
        stop = 1.0 if (rank == 0 and stop_file and os.path.exists(stop_file)) else 0.0
        req = channel.pending() if channel is not None else None
        save = 1.0 if req is not None else 0.0
        flags = torch.tensor([stop, save])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        step += 1
        print(f"MW_STEP t={time.time():.3f} step={step} {tag}", flush=True)
        if flags[1] > 0 and req is not None and channel is not None:
            # Every rank saved at this step (a real checkpoint); each node acks its own agent's request.
            channel.ack(step, f"mem://step-{step}", time.time())
            print(f"MW_SAVED request={req.request_id} step={step} {tag}", flush=True)
        if flags[0] > 0:
            break
        time.sleep(float(os.environ.get("MW_STEP_S", "0.1")))
    dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
