"""A warm worker's heap (elastrain/live/heap.py), in a process of its own (``mallopt`` is process-wide): grown once,
it stays mapped, and the allocations of a step come out of it without the process mapping more."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_PROBE = r"""
import json, sys, torch
from elastrain.live import heap

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

before = rss()
grown = heap.grow(288 << 20)
after_grow = rss()
# A step's worth of allocations below what was grown: gradients' temporaries (16 MiB), DDP's buckets (just over
# 32 MiB, glibc's largest mmap threshold: mapped anew each time unless mmap is off), a 64 MiB gradient.
step = [torch.ones(4 << 20) for _ in range(8)] + [torch.ones(33_570_816 // 4) for _ in range(2)]
step.append(torch.ones(16 << 20))
after_step = rss()
del step
print(json.dumps({"grown": grown, "before": before, "after_grow": after_grow, "after_step": after_step,
                  "kept": heap.keep_freed_memory()}))
"""


def _probe(extra_env: dict[str, str]) -> dict[str, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env.update(extra_env, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and /proc: Linux only")
def test_a_grown_heap_stays_mapped_and_a_step_allocates_from_it() -> None:
    got = _probe({})
    assert got["kept"] and got["grown"] >= 256 << 20
    assert got["after_grow"] - got["before"] >= 240 << 20, got  # written, and not given back when freed
    assert got["after_step"] - got["after_grow"] < 32 << 20, got  # 256 MiB of tensors, from the grown heap


def test_an_allocator_the_user_tuned_is_left_alone() -> None:
    got = _probe({"MALLOC_ARENA_MAX": "4"})
    assert not got["kept"] and got["grown"] == 0
