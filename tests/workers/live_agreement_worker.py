"""One process of test_live_agreement.py: real gloo groups, states deliberately out of step.

``agree``: 3 ranks train the same model on the same data for K steps; rank 0 then applies one more step
(as a rank whose all-reduce completed before a peer died), rank 2 throws its state away (as a restarted
or joining node). After the vote and the broadcast every rank prints the hash of its state, and rank 1
prints the hash it had at step K.

``abort``: 2 ranks; rank 1 never joins rank 0's all-reduce (as a peer that already left for the next
round); rank 0's watchdog-style abort gets it out at once; both join a new round's group and train on,
and rank 0 exits normally although gloo still holds the abandoned collective (TrainingGroup.drain).

``stuck``: 2 ranks, collectives that wait 10 minutes; rank 1 stays in the group but never joins rank 0's all-reduce,
which rank 0 gives up; its round is left without severing its connections (as if severing had missed the one gloo
uses), so the collective stays pending in gloo. Rank 0 still frees its group and exits at once, with its own exit
code (3), after ``drain``'s bounded wait; rank 1 exits once rank 0's process has ended (its pid in ``$STUCK_PID_FILE``).
"""

from __future__ import annotations

import gc
import hashlib
import os
import sys
import threading
import time
from pathlib import Path

import torch

from elastrain.live.agreement import Ballot, vote
from elastrain.live.group import GroupBrokenError, TrainingGroup
from elastrain.live.transfer import send_state
from elastrain.train_state import TrainState


def state_hash(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainState) -> str:
    h = hashlib.sha256(repr(state.state_dict()).encode())
    for _, t in sorted(model.state_dict().items()):
        h.update(t.numpy().tobytes())
    for _, st in sorted(optimizer.state_dict()["state"].items()):
        for _, v in sorted(st.items()):
            h.update(v.numpy().tobytes())
    return h.hexdigest()[:16]


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainState, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
    torch.nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    optimizer.zero_grad()
    state.advance(8, 0)


def agree(rank: int, world: int, port: int) -> None:
    group = TrainingGroup("gloo", 30.0)
    group.join(0, rank, world, "127.0.0.1", port)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = TrainState()
    k = 5
    for step in range(1, k + 1):
        train_step(model, optimizer, state, step)
    print(f"AT_K rank={rank} hash={state_hash(model, optimizer, state)}", flush=True)
    has_state = True
    if rank == 0:
        train_step(model, optimizer, state, k + 1)  # ahead: must roll back
    if rank == 2:  # no state: a fresh model and an optimizer that never stepped
        torch.manual_seed(123)
        model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Linear(16, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        state, has_state = TrainState(), False
    agreement = vote(Ballot(has_state, state.step), torch.device("cpu"))
    if agreement.source is None:
        raise SystemExit("no source")
    send_state(agreement.source, model, optimizer, {"train_state": state}, torch.device("cpu"))
    print(
        f"AGREED rank={rank} step={agreement.step} source={agreement.source} "
        f"hash={state_hash(model, optimizer, state)}",
        flush=True,
    )
    # The agreed state trains on identically everywhere.
    train_step(model, optimizer, state, k + 1)
    print(f"NEXT rank={rank} hash={state_hash(model, optimizer, state)}", flush=True)
    group.leave()
    group.drain(10.0)  # free the left group now, not during interpreter finalisation (pytorch#179291)


def abort(rank: int, world: int, port: int, port2: int) -> None:
    group = TrainingGroup("gloo", 4.0)
    group.join(0, rank, world, "127.0.0.1", port)
    t = torch.ones(4)
    group.all_reduce(t)
    if rank == 0:
        threading.Timer(0.3, lambda: group.abort(GroupBrokenError("round 0 is over"), 0)).start()
        started = time.monotonic()
        try:
            group.all_reduce(torch.ones(4))
            print("ABORT rank=0 result=completed", flush=True)
        except GroupBrokenError:
            print(f"ABORT rank=0 result=given_up after_s={time.monotonic() - started:.2f}", flush=True)
    group.leave()
    group.join(1, rank, world, "127.0.0.1", port2)
    t = torch.full((4,), float(rank + 1))
    group.all_reduce(t)
    print(f"ROUND1 rank={rank} sum={t[0].item():.0f}", flush=True)
    group.leave()
    group.drain(10.0)
    print(f"EXIT rank={rank}", flush=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stuck(rank: int, world: int, port: int) -> None:
    group = TrainingGroup("gloo", 600.0)
    group.join(0, rank, world, "127.0.0.1", port)
    group.all_reduce(torch.ones(4))
    pid_file = Path(os.environ["STUCK_PID_FILE"])
    if rank == 1:  # in the group, alive, in no collective: until rank 0's process has ended (bounded)
        deadline = time.monotonic() + 300
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        while _alive(int(pid_file.read_text())) and time.monotonic() < deadline:
            time.sleep(0.05)
        print("PEER_GONE rank=1", flush=True)
        os._exit(0)
    pid_file.write_text(str(os.getpid()))
    threading.Timer(0.3, lambda: group.abort(GroupBrokenError("round 0 is over"), 0)).start()
    try:
        group.all_reduce(torch.ones(4))
    except GroupBrokenError:
        print("ABORT rank=0 result=given_up", flush=True)
    group._connections = frozenset()  # nothing to sever: the given-up all-reduce stays pending in gloo
    group.leave()
    group.drain()  # LiveMember.close's bound
    # What the interpreter's finalisation may do: free the group and its left rounds' (a gloo group freed with its
    # collective pending joins the thread that runs it, for 10 minutes here).
    group = None  # type: ignore[assignment]
    gc.collect()
    print("EXIT rank=0", flush=True)


if __name__ == "__main__":
    mode, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if mode == "agree":
        agree(rank, world, port)
    elif mode == "stuck":
        stuck(rank, world, port)
        sys.exit(3)
    else:
        abort(rank, world, port, int(sys.argv[5]))
