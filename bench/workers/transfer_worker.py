"""A Session job with a model of a chosen size, for ``bench/state_transfer.py``: prints a line per completed step.

The model is a stack of ``XW_LAYERS`` 2048x2048 linear layers (4.2M parameters each) trained with AdamW, so
the state a new member receives is about 12 bytes per parameter. Lines (rank-tagged):
  XW_STEP rank= ws= step= t=
  XW_DONE rank= step=
With XW_STOP_FILE=path: once the file exists, it holds a step number at which every rank stops.
With XW_DIE_FILE=path and XW_DIE_NODE=<group rank>: in the first step that starts once the file exists, that node's
worker SIGKILLs its agent, the agent's zygote (its parent) and itself, the whole node, in the step's first backward
pass, from the gradient hook of layer XW_DIE_LAYER (the first layer's hook runs last in backward).
With XW_DIE_RANK=<rank> instead of XW_DIE_NODE: that rank's worker SIGKILLs itself alone (a crash; its node lives on),
once: it removes the file first.
With XW_OVERLAP=0: the Session's ``overlap_state_transfer=False`` (the whole state arrives before the next step).
With XW_PHASE_BYTES=N: the Session's ``catch_up_phase_bytes`` (a catch-up's state in phases of about N bytes).
With XW_PHASES=1: also ``XW_PHASES rank= step= start= mbs=[...] opt=`` (seconds into the step at the end of each
micro-batch's backward and of the optimizer step), to see where a step's time goes.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch
from torch.utils.data import TensorDataset

from bench.support.node_kill import kill_own_node, kill_this_worker
from elastrain.session import Session

WIDTH = 2048


def main() -> None:
    layers = int(os.environ.get("XW_LAYERS", "6"))
    stop_file = os.environ.get("XW_STOP_FILE", "")
    die_file = os.environ.get("XW_DIE_FILE", "")
    die_node = int(os.environ.get("XW_DIE_NODE", "-1"))
    die_layer = int(os.environ.get("XW_DIE_LAYER", "0"))
    die_rank = int(os.environ.get("XW_DIE_RANK", "-1"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(2048, WIDTH, generator=g), torch.randn(2048, WIDTH, generator=g))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    overlap = os.environ.get("XW_OVERLAP", "1") != "0"
    phases = {"catch_up_phase_bytes": int(os.environ["XW_PHASE_BYTES"])} if os.environ.get("XW_PHASE_BYTES") else {}
    session = Session(
        model,
        optimizer,
        data,
        global_batch=12,
        micro_batch=2,
        max_steps=100_000,
        overlap_state_transfer=overlap,
        **phases,
    )
    armed = {"now": False}

    def die(grad: torch.Tensor) -> torch.Tensor:
        if armed["now"] and die_rank >= 0:  # this worker alone (a crash): its agent replaces it, once
            with contextlib.suppress(FileNotFoundError):
                os.unlink(die_file)
            kill_this_worker()
        if armed["now"]:  # the whole node: the agent, its zygote (this worker's parent), this worker
            kill_own_node()
        return grad

    model[min(die_layer, layers - 1)].weight.register_hook(die)
    stop_at: int | None = None
    with session:
        for step in session:
            if stop_at is None and stop_file and os.path.exists(stop_file):
                stop_at = int(open(stop_file).read() or "0")  # noqa: SIM115 - a tiny file the bench writes
            if stop_at is not None and session.state.step >= stop_at:
                break
            dies = session.rank == die_rank if die_rank >= 0 else session.env.group_rank == die_node
            armed["now"] = dies and bool(die_file) and os.path.exists(die_file)
            t_start = time.time()
            marks = []
            for mb in step:
                x, y = mb.data
                step.backward(torch.nn.functional.mse_loss(session.model(x), y), mb)
                marks.append(round(time.time() - t_start, 2))
            step.optimizer_step()
            if os.environ.get("XW_PHASES"):
                print(
                    f"XW_PHASES rank={session.rank} step={session.state.step} start={t_start:.3f} "
                    f"mbs={marks} opt={time.time() - t_start:.2f}",
                    flush=True,
                )
            if not step.abandoned:
                print(
                    f"XW_STEP rank={session.rank} ws={session.world_size} step={session.state.step} "
                    f"t={time.time():.3f}",
                    flush=True,
                )
        print(f"XW_DONE rank={session.rank} step={session.state.step}", flush=True)


if __name__ == "__main__":
    main()
