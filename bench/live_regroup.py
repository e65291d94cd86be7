"""Live reconfiguration vs restart: the stall after a node dies inside the backward pass, and the steps redone.

    python bench/live_regroup.py                      # live and restart mode, deaths at steps 8, 13, 17
    python bench/live_regroup.py --modes live --die-at 13

Three "nodes" (elastrain-run agents with one gloo worker each, tests/workers/live_worker.py) on
127.0.0.1, checkpoints every 10 steps; node 2's worker SIGKILLs its agent and itself from a gradient
hook in the middle of step N's backward pass. From rank 0's per-step timestamps the bench prints the
longest gap between two completed steps (the stall) and how many steps rank 0 completed twice.
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from elastrain import binding

REPO = Path(__file__).resolve().parents[1]
SCRIPT = str(REPO / "tests" / "workers" / "live_worker.py")
NODES = 3


def free_port() -> int:
    return binding.free_port("127.0.0.1")


def run(live: bool, die_at: int, timeout_s: float = 300.0) -> str:
    out = Path(tempfile.mkdtemp(prefix="elastrain-live-bench-"))
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "LW_MAX_STEPS": str(die_at + 20),
        "LW_SLEEP": "0.02",
        "LW_DIE_AT_STEP": str(die_at),
        "LW_DIE_NODE": "2",
        "LW_SAVE_EVERY": "10",
    }
    procs = []
    for i in range(NODES):
        cmd = [
            sys.executable, "-m", "elastrain", "--nnodes", f"2:{NODES}", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "live-bench",
            "--rdzv-conf", "last_call_timeout=1", "--max-restarts", "0", "--live", str(live).lower(),
            "--checkpoint-dir", str(out / "ckpt"), SCRIPT,
        ]  # fmt: skip
        log = open(out / f"node{i}.log", "wb")  # noqa: SIM115 - closed with the process
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
        time.sleep(0.3)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
    steps: list[tuple[float, int]] = []
    for i in range(NODES):
        for line in (out / f"node{i}.log").read_text(errors="replace").splitlines():
            if line.startswith("LW_STEP ") and " rank=0 " in line:
                f = dict(x.split("=", 1) for x in line.split()[1:])
                steps.append((float(f["t"]), int(f["step"])))
    steps.sort()
    gaps = sorted((b[0] - a[0], a[1], b[1]) for a, b in itertools.pairwise(steps))
    longest = gaps[-1]
    median = gaps[len(gaps) // 2][0]
    twice = len(steps) - len({s for _, s in steps})
    return (
        f"{'live' if live else 'restart':8} die_at={die_at:3d} stall_s={longest[0]:5.2f} (step {longest[1]}->"
        f"{longest[2]}) median_step_s={median:.3f} steps_redone={twice} exit_codes={[p.returncode for p in procs]}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="live,restart")
    p.add_argument("--die-at", default="8,13,17")
    a = p.parse_args()
    for mode in a.modes.split(","):
        for n in a.die_at.split(","):
            print(run(mode == "live", int(n)), flush=True)


if __name__ == "__main__":
    main()
