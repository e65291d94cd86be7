"""A tiny elastic worker for the partition tests: one gloo all_reduce per ~0.1 s, one line per step.

    PW_START t=<after init_process_group> rank=.. ws=.. round=.. gen=.. world=<MASTER_ADDR:MASTER_PORT> pid=..
    PW_STEP t=<after the step> step=.. rank=.. ws=.. round=.. gen=.. world=.. pid=..

``world`` names the process group a step ran in (the rank-0 node picks a fresh MASTER_PORT per round),
so a test can tell two worlds apart even if both call their round the same number. The job ends once
the file named by PW_STOP_FILE exists. Save requests (ELASTRAIN_CONTROL_DIR) are answered as the real
checkpointer answers them (elastrain/checkpoint/schedule.py), with a pretend checkpoint: every rank
agrees on the step, each node acknowledges it to its own agent, then holds for the restart and answers
requests that arrive meanwhile (another agent saw the change later) with the same checkpoint.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from elastrain.checkpoint.schedule import hold_for_restart
from elastrain.control import ControlChannel, SaveAck
from elastrain.env import WorkerEnv
from elastrain.log import format_event

HOLD_S = 5.0  # the checkpointer's default hold_after_request_s


def main() -> None:
    timeout = float(os.environ.get("PW_TIMEOUT", "60"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    rank, ws = dist.get_rank(), dist.get_world_size()
    tag = (
        f"rank={rank} ws={ws} round={os.environ.get('ELASTRAIN_ROUND', '-')} "
        f"gen={os.environ.get('ELASTRAIN_GENERATION') or '-'} "
        f"world={os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} pid={os.getpid()}"
    )
    print(f"PW_START t={time.time():.3f} {tag}", flush=True)
    stop_file = os.environ.get("PW_STOP_FILE")
    channel = ControlChannel(os.environ["ELASTRAIN_CONTROL_DIR"]) if os.environ.get("ELASTRAIN_CONTROL_DIR") else None
    env = WorkerEnv.from_environ()

    def log(event: str, level: int, **fields: object) -> None:
        print(format_event(event, **fields, t=round(time.time(), 3)), flush=True)

    step = 0
    while True:
        stop = 1.0 if (rank == 0 and stop_file and os.path.exists(stop_file)) else 0.0
        req = channel.pending() if channel is not None else None
        flags = torch.tensor([stop, 1.0 if req is not None else 0.0])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        step += 1
        print(f"PW_STEP t={time.time():.3f} step={step} {tag}", flush=True)
        if flags[1] > 0 and channel is not None:
            ack = SaveAck(step=step, checkpoint=f"mem://step-{step}", current_at=time.time())
            channel.ack(ack.step, ack.checkpoint, ack.current_at)
            hold_for_restart(HOLD_S, step, log, channel, ack, live_round=env.round if env.live else None)
        if flags[0] > 0:
            break
        time.sleep(0.1)
    dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
