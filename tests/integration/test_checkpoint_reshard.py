"""Save at world size 2 (FSDP2), resume at 1 and 3 bit-exactly; a truncated shard falls back."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from support.processes import REPO, elastrain_cmd, run

from elastrain.checkpoint import layout
from elastrain.log import parse_event_line

WORKER = str(REPO / "tests" / "workers" / "checkpoint_worker.py")
pytestmark = pytest.mark.slow


def launch(nproc: int, ckpt: Path, *args: str, expect_rc: int = 0) -> str:
    cmd = elastrain_cmd(f"--nproc-per-node={nproc}", f"--checkpoint-dir={ckpt}", WORKER, *args)
    proc = run(cmd, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == expect_rc, out
    return out


def events(out: str, name: str) -> list[dict[str, str]]:
    parsed = (parse_event_line(line) for line in out.splitlines())
    return [e for e in parsed if e is not None and e.get("event") == name]


def restored(out: str) -> Any:
    line = next(line for line in out.splitlines() if line.startswith("RESTORED "))
    return json.loads(line.split(" ", 1)[1])


def assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}/{i}")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def test_resume_at_other_world_sizes_and_fall_back_past_a_truncated_shard(tmp_path: Path) -> None:
    ckpt, dumps = tmp_path / "ckpt", tmp_path / "dumps"
    dumps.mkdir()
    common = ["--parallel=fsdp", f"--dump-dir={dumps}"]

    out = launch(2, ckpt, "--steps=6", "--interval=3", "--dump-steps", "3", "6", *common)
    assert [int(e["step"]) for e in events(out, "checkpoint_committed")] == [3, 6]
    assert [d.step for d in layout.list_step_dirs(str(ckpt)) if d.committed] == [3, 6]

    # World size 1 loads the world-size-2 checkpoint bit-exactly (parameters and AdamW state).
    out = launch(1, ckpt, "--steps=6", *common)
    assert restored(out)["step"] == 6 and restored(out)["world_size"] == 2
    assert_same(torch.load(dumps / "step-6.pt"), torch.load(dumps / "restored-ws1.pt"), "ws1")

    # Truncate one shard of step 6: world size 3 falls back to step 3, warns naming step 6, and
    # then replaces the bad step 6 with a good one.
    step6 = ckpt / layout.step_dir_name(6)
    shard = next(p for p in sorted(step6.iterdir()) if p.suffix == ".distcp")
    os.truncate(shard, shard.stat().st_size // 2)
    out = launch(3, ckpt, "--steps=6", "--interval=3", *common)
    assert restored(out)["step"] == 3
    fallbacks = events(out, "checkpoint_fallback")
    assert fallbacks and fallbacks[0]["bad"] == str(step6) and "truncated" in fallbacks[0]["reason"]
    assert_same(torch.load(dumps / "step-3.pt"), torch.load(dumps / "restored-ws3.pt"), "ws3")
    assert "DONE 6 [2, 1, 3]" not in out  # world-size history comes from the restored step 3
    assert "DONE 6 [2, 3]" in out
    assert [int(e["step"]) for e in events(out, "checkpoint_committed")] == [6]
    layout.verify_step(str(step6))
