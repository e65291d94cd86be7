"""A tiny worker for launcher-compatibility tests.

Writes what the launcher told it (the torch and elastrain variables, argv, how it was started) to
$PROBE_DIR/start-<RANK>-<pid>.json, runs one gloo all_reduce, prints a marker line, and fails on
purpose when PROBE_FAIL_RANK names its rank.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

from torch.distributed.elastic.multiprocessing.errors import record

KEYS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "OMP_NUM_THREADS",
    "TORCHELASTIC_ERROR_FILE",
)


def _wait_for_peers(out: str, world_size: int, restart: str | None, timeout_s: float = 60.0) -> None:
    import glob
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen = 0
        for path in glob.glob(os.path.join(out, "start-*.json")):
            try:
                with open(path) as fh:
                    seen += json.load(fh)["env"]["TORCHELASTIC_RESTART_COUNT"] == restart
            except (OSError, ValueError):
                continue  # being written
        if seen >= world_size:
            return
        time.sleep(0.05)


@record
def main() -> None:
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    record_ = {
        "env": {k: os.environ.get(k) for k in KEYS},
        "elastrain": {k: v for k, v in os.environ.items() if k.startswith("ELASTRAIN_")},
        "argv": sys.argv[1:],
        "module": __name__ if __spec__ is None else __spec__.name,
    }
    out = os.environ.get("PROBE_DIR")
    if out:
        with open(os.path.join(out, f"start-{rank}-{os.getpid()}.json"), "w") as fh:
            json.dump(record_, fh)
    if os.environ.get("PROBE_FAIL_RANK") == str(rank):
        # Before any collective: torchrun's own restarts race in gloo's connectFullMesh when a rank
        # fails after one, and that race is torchrun's, not what this test compares. But only once every
        # rank of this start has recorded it: a loaded machine may not have started the others yet.
        if out:
            _wait_for_peers(out, int(os.environ["WORLD_SIZE"]), os.environ.get("TORCHELASTIC_RESTART_COUNT"))
        raise RuntimeError(f"probe failure on purpose at rank {rank}")
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    print(f"PROBE rank={rank} local_rank={os.environ['LOCAL_RANK']} sum={int(t.item())}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
