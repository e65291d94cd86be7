"""checkpoint/background.py: the save a checkpointer runs in the background, on its own daemon thread.

A save whose world broke is given up within the caller's bound, and holds nothing: two real gloo ranks save
together; rank 0 freezes itself (SIGSTOP) the moment its ``save()`` returns, as a node frozen mid-save does, so
rank 1's save waits in a DCP collective that gloo ends only at the I/O timeout (600 s). ``close(give_up_after_s=...)``
must return within its bound, log the save as given up, write and commit nothing more, and the process must end at
once (the save's thread never holds its exit). A save not given up still ends before the process does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from support.processes import events_in, free_port, kill_tree, wait_for, worker_env

from elastrain.checkpoint import layout
from elastrain.checkpoint.dcp_load import sidecar_name

BOUND = 120.0

SCRIPT = """
import os, signal, sys, time
import torch
import torch.distributed as dist
from elastrain.checkpoint import Checkpointer
from elastrain.log import configure

configure()
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2)
torch.manual_seed(0)
model = torch.nn.Linear(2048, 2048)  # 16 MB of state: a save that takes a while to write
opt = torch.optim.AdamW(model.parameters())
model(torch.ones(1, 2048)).sum().backward()
opt.step()
ckpt = Checkpointer(sys.argv[1], interval_steps=None)
ckpt.register(model=model, optimizer=opt)
ckpt.restore()
ckpt.save(1)
if rank == 0:
    os.kill(os.getpid(), signal.SIGSTOP)  # frozen with its save in flight: rank 1's waits on it
    sys.exit(0)
time.sleep(0.5)
started = time.monotonic()
ckpt.close(give_up_after_s=1.0)
print(f"CLOSED took={time.monotonic() - started:.3f}", flush=True)
"""


def test_a_save_waiting_on_a_frozen_member_is_given_up_and_never_holds_the_process(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = worker_env(
            {"RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
            | {"MASTER_PORT": str(port)}
        )
        cmd = [sys.executable, "-c", textwrap.dedent(SCRIPT), str(root)]
        out = subprocess.PIPE
        procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env))
    frozen, survivor = procs
    try:
        out, _ = survivor.communicate(timeout=BOUND)  # ends although rank 0 never finishes its part of the save
        wait_for(lambda: _stopped(frozen.pid), BOUND, what="rank 0 to freeze itself")
        assert survivor.returncode == 0, out
        (given_up,) = events_in(out, "checkpoint_save_given_up")
        assert given_up["step"] == "1" and float(given_up["waited_s"]) == 1.0, out
        assert any(line.startswith("CLOSED") for line in out.splitlines()), out
        assert not events_in(out, "checkpoint_committed"), out
        # Nothing committed, and rank 1 wrote no sidecar after it gave the save up.
        step_dir = root / layout.step_dir_name(1)
        assert not (step_dir / layout.MARKER).exists(), sorted(os.listdir(step_dir))
        assert not (step_dir / sidecar_name(1)).exists(), sorted(os.listdir(step_dir))
    finally:
        kill_tree(frozen.pid)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=BOUND)


EXIT_SCRIPT = """
import sys
import torch
from elastrain.checkpoint import Checkpointer

model = torch.nn.Linear(2048, 2048)
ckpt = Checkpointer(sys.argv[1], interval_steps=None)
ckpt.register(model=model)
ckpt.save(1)  # in the background; the script ends without wait() or close()
print("SAVE_STARTED", flush=True)
"""


def test_a_script_that_ends_without_closing_still_commits_its_save_in_flight(tmp_path: Path) -> None:
    """A daemon thread would die with the process: the exit waits for the save (bounded), as a pool's did."""
    root = tmp_path / "ckpt"
    cmd = [sys.executable, "-c", textwrap.dedent(EXIT_SCRIPT), str(root)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=worker_env(), timeout=BOUND)
    assert out.returncode == 0 and "SAVE_STARTED" in out.stdout, out.stdout + out.stderr
    assert (root / layout.step_dir_name(1) / layout.MARKER).exists(), out.stdout + out.stderr


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0] == "T"
