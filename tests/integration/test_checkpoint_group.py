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


def _python(script: str) -> subprocess.CompletedProcess[str]:
    """``script`` (its ``{port}`` a free one) run to its end by a fresh interpreter, which must exit 0."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script.format(port=free_port()))],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def test_process_groups_are_destroyed_at_exit_while_the_interpreter_is_whole() -> None:
    out = _python(SCRIPT)
    assert "ALL_MAX [3, 4]" in out.stdout, out.stdout + out.stderr
    assert "AT_EXIT initialized=False" in out.stdout, out.stdout + out.stderr


PINNED_SCRIPT = """
import atexit, os, sys
# Registered before elastrain is imported, so it runs after group_pins' hook: the pins are gone by then.
atexit.register(lambda: print("AFTER_RELEASE pinned=" + str(sys.modules["elastrain.group_pins"].pinned()), flush=True))
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}")
dist.init_process_group("gloo", rank=0, world_size=1)
from elastrain import group_pins
# Registered after group_pins' hook, so it runs before the pins go (atexit is last in, first out).
atexit.register(lambda: print("AT_EXIT pinned=" + str(group_pins.pinned()), flush=True))
from elastrain.checkpoint.group import Group
g = Group(timeout_s=30)
model = DistributedDataParallel(torch.nn.Linear(4, 4))
model(torch.ones(2, 4)).sum().backward()
dist.destroy_process_group()  # as Trainer.end() does: the model's Reducer now holds the group
print("AFTER_DESTROY pinned=" + str(group_pins.pinned()), flush=True)
del model
print("MODEL_FREED", flush=True)
"""


def test_the_default_group_outlives_a_model_whose_script_destroyed_it_and_goes_at_exit() -> None:
    """A DDP model freed after the script destroyed its group does not free the group (a gloo group freed by DDP's
    Reducer is freed with the GIL held, which can hang the worker: elastrain.group_pins); the pin goes at exit."""
    out = _python(PINNED_SCRIPT)
    text = out.stdout + out.stderr
    assert "AFTER_DESTROY pinned=1" in out.stdout, text
    assert "MODEL_FREED" in out.stdout, text
    assert "AT_EXIT pinned=1" in out.stdout, text
    assert "AFTER_RELEASE pinned=0" in out.stdout, text
