"""A script that trains one Trainer after another (a k-fold loop), under elastrain-run and under torchrun.

    python bench/trainer_folds.py              # 3 runs per launcher, alternating (≈ 2 min on 2 idle cores)
    python bench/trainer_folds.py --repeat 1 --nproc-per-node 1

The script is ``tests/workers/hf_sequential_trainers.py``: two folds, each an unmodified ``transformers.Trainer`` of 6
steps on a tiny model, its training DataLoader with two persistent worker processes
(``dataloader_persistent_workers``), the first fold's Trainer dropped before the second is built; it imports nothing
from elastrain. One node (``--standalone``), OMP_NUM_THREADS=1. Per launcher it prints the median wall time of the
whole command, and the ratio elastrain-run / torchrun. What it measures: what a finished Trainer costs the script
after ``train()`` returns (its memory and DataLoader workers freed as the script drops it, or left to a garbage
collection: see ``elastrain/integrations/trainer/weak_trainer.py``), plus elastrain's start and end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "workers" / "hf_sequential_trainers.py"


def launcher(name: str, nproc: int, work: Path) -> list[str]:
    bindir = Path(sys.executable).parent
    if name == "torchrun":
        return [str(bindir / "torchrun"), "--standalone", f"--nproc-per-node={nproc}"]
    return [str(bindir / "elastrain-run"), "--standalone", f"--nproc-per-node={nproc}", f"--checkpoint-dir={work}/ckpt"]


def once(name: str, nproc: int) -> float:
    work = Path(tempfile.mkdtemp(prefix=f"folds-{name}-"))
    try:
        cmd = [*launcher(name, nproc, work), str(SCRIPT), f"--output-dir={work / 'out'}"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        started = time.monotonic()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        took = time.monotonic() - started
        if proc.returncode != 0 or proc.stdout.count("DONE ") != nproc:
            raise SystemExit(f"{name} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
        return took
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--nproc-per-node", type=int, default=2)
    args = p.parse_args()
    times: dict[str, list[float]] = {"torchrun": [], "elastrain-run": []}
    for i in range(args.repeat):
        for name in times:
            took = once(name, args.nproc_per_node)
            times[name].append(took)
            print(f"run {i + 1} {name}: {took:.1f} s", flush=True)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"torchrun median {med['torchrun']:.1f} s, elastrain-run median {med['elastrain-run']:.1f} s")
    print(f"ratio elastrain-run / torchrun: {med['elastrain-run'] / med['torchrun']:.2f}x")


if __name__ == "__main__":
    main()
