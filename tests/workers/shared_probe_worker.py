"""Worker for the node-local checkpoint directory test: runs the start-time probe and says what it found."""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from elastrain import WorkerEnv
from elastrain.checkpoint.group import Group
from elastrain.errors import EX_CONFIG, CheckpointError
from elastrain.storage import check_shared


def main() -> int:
    env = WorkerEnv.from_environ()
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    group = Group(None, 30)
    root = env.checkpoint_dir or ""
    try:
        check_shared(root, group)
    except CheckpointError as e:
        print(f"NOT_SHARED rank={env.rank} {e}", flush=True)
        if os.environ.get("PROBE_SLOW_RANK") == str(env.rank):
            time.sleep(3)  # a rank slow to exit: its peer's node leaves first
        return EX_CONFIG  # a setting to fix: restarting cannot help, the node leaves at once
    finally:
        group.destroy()
        dist.destroy_process_group()
    print(f"SHARED rank={env.rank}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
