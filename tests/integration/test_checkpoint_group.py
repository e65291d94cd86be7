"""checkpoint/group.py: a process that built a checkpoint Group ends with its process groups destroyed."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from support.processes import free_port

SCRIPT = """
import atexit, os
import torch.distributed as dist
# Registered before the Group's hook, so it runs after it (atexit is last in, first out).
atexit.register(lambda: print("AT_EXIT initialized=" + str(dist.is_initialized()), flush=True))
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}")
dist.init_process_group("gloo", rank=0, world_size=1)
from elastrain.checkpoint.group import Group
g = Group(timeout_s=30)
print("ALL_MAX", g.all_max([3, 4]), flush=True)
"""


def test_process_groups_are_destroyed_at_exit_while_the_interpreter_is_whole() -> None:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT.format(port=free_port()))],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ALL_MAX [3, 4]" in out.stdout, out.stdout + out.stderr
    assert "AT_EXIT initialized=False" in out.stdout, out.stdout + out.stderr
