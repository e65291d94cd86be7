"""integrations/trainer/checkpoints.py: before the Trainer writes ``checkpoint-N``, the commit protocol prepares the
folder. The leftover of a save of that step cut short (a world that lost a member in its save, and runs the save
again: files of ranks the new world does not have) is removed, so that the folder commits; a committed folder is
never written again. A real gloo group of one process, as a worker's."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from support.processes import free_port

SCRIPT = """
import os, sys
import torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}")
dist.init_process_group("gloo", rank=0, world_size=1)
from elastrain.env import WorkerEnv
from elastrain.errors import CheckpointSaveError
from elastrain.integrations.trainer.checkpoints import TrainerCheckpoints, is_committed

root = sys.argv[1]
checkpoints = TrainerCheckpoints(root, WorkerEnv.from_environ(), keep_last=5)

def write(step, *names):
    folder = os.path.join(root, f"checkpoint-{{step}}")
    os.makedirs(folder, exist_ok=True)
    for name in names:
        with open(os.path.join(folder, name), "w") as f:
            f.write(name)
    return folder

# Without a prepare, a folder holding a rank's files that this world has no rank for does not commit.
write(30, "model.safetensors", "rng_state_0.pth", "rng_state_2.pth")
try:
    checkpoints.commit(30, 480, 16)
    print("COMMITTED_WITH_A_STRANGER", flush=True)
except CheckpointSaveError as e:
    print("REFUSED", "rng_state_2.pth" in str(e), flush=True)

# A save of step 40 cut short in a world of three, run again by a world of one: prepared, written, committed.
folder = write(40, "model.safetensors", "optimizer.pt", "rng_state_0.pth", "rng_state_2.pth")
print("PREPARED", checkpoints.prepare(40), sorted(os.listdir(folder)), flush=True)
write(40, "model.safetensors", "optimizer.pt", "rng_state_0.pth")
checkpoints.commit(40, 640, 16)
print("COMMITTED", is_committed(folder), flush=True)

# Committed: not prepared again, and the commit that follows the Trainer's (skipped) save changes nothing.
print("PREPARED_AGAIN", checkpoints.prepare(40), flush=True)
print("SKIPPED", checkpoints.commit(40, 640, 16) == folder, sorted(os.listdir(folder)), flush=True)
"""


def test_a_cut_short_save_run_again_commits_and_a_committed_folder_is_never_written_again(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT.format(port=free_port())), str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "REFUSED True" in out.stdout, text
    assert "PREPARED True " in out.stdout, text
    prepared = next(line for line in out.stdout.splitlines() if line.startswith("PREPARED True"))
    assert "rng_state_2.pth" not in prepared and "model.safetensors" not in prepared, text  # the leftover is gone
    assert "COMMITTED True" in out.stdout, text
    assert "PREPARED_AGAIN False" in out.stdout, text
    assert "SKIPPED True" in out.stdout, text
