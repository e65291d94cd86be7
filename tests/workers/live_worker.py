"""A Session job for the live-reconfiguration tests: prints its pid, a state hash per step and after regroups.

Lines (rank-tagged, parsed by tests/integration/test_live_regroup.py):
  LW_START rank= ws= pid= round=
  LW_STEP  rank= ws= step= hash= samples= cursor= t=
  LW_AGREED rank= ws= step= hash= regroups=
  LW_DONE  rank= step= samples= hash=
With LW_CHECKPOINT_DIR=path: the Session's checkpoint_dir (the workers fence it: no --checkpoint-dir needed).
With LW_BUILD_UNTIL_FILE=path: the build (before the Session) lasts until the file exists (120 s at most).
With LW_STOP_FILE=path: once the file exists, it holds a step number at which every rank stops.
With LW_STOP_AT_WS=W: every rank stops LW_EXTRA_STEPS steps after the world first reaches W workers.
With LW_HANG_NODE=g, LW_HANG_AT_STEP=N: that node's worker sleeps LW_HANG_S in its first round's step N.
With LW_DIE_AT_STEP=N and LW_DIE_NODE=<group rank>: that node's worker SIGKILLs its agent and itself in the
middle of step N's backward (from the gradient hook of layer LW_DIE_LAYER: 0, 2 or 3), between DDP's bucket
all-reduces.
With LW_DIE_RANK=<rank> (instead of LW_DIE_NODE): the worker of that rank in round 0 SIGKILLs itself alone, as
above (its node's agent and other workers live on).
With LW_FIRST_FORWARD_S=s: the worker's first forward pass (of its life: a joiner's after it sat its catch-up out)
takes s seconds longer, as the first call of a ``torch.compile``d model does (it compiles).
With LW_COMPILE=1: the model is compiled in place (``Module.compile``, dynamo's eager backend: no C++ compiler).
With LW_DIE_JOINING=1: the worker SIGKILLs its whole node (agent, zygote, itself) as it starts to join its first
round's process group: a member that died after its round formed and before it joined.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time

import torch
from torch.utils.data import TensorDataset

from elastrain.session import Session


def say(line: str) -> None:
    """One line to stdout in one write: print() writes the line and its newline apart, and a log line of another
    thread (to the same file) can land between them."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def state_hash(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    for idx, st in sorted(optimizer.state_dict()["state"].items()):
        for key, v in sorted(st.items()):
            h.update(f"{idx}.{key}".encode())
            h.update(v.detach().contiguous().numpy().tobytes() if isinstance(v, torch.Tensor) else repr(v).encode())
    return h.hexdigest()[:16]


def main() -> None:
    max_steps = int(os.environ.get("LW_MAX_STEPS", "60"))
    sleep = float(os.environ.get("LW_SLEEP", "0.05"))
    die_at = int(os.environ.get("LW_DIE_AT_STEP", "0"))
    die_node = int(os.environ.get("LW_DIE_NODE", "-1"))
    die_rank = int(os.environ.get("LW_DIE_RANK", "-1"))
    stop_at_ws = int(os.environ.get("LW_STOP_AT_WS", "0"))
    extra = int(os.environ.get("LW_EXTRA_STEPS", "10"))
    stop_at: int | None = None
    stop_file = os.environ.get("LW_STOP_FILE", "")
    hang_node = int(os.environ.get("LW_HANG_NODE", "-1"))
    hang_at = int(os.environ.get("LW_HANG_AT_STEP", "0"))
    hang_s = float(os.environ.get("LW_HANG_S", "60"))
    first_forward_s = float(os.environ.get("LW_FIRST_FORWARD_S", "0"))
    if os.environ.get("LW_DIE_JOINING"):
        from elastrain.live.group import TrainingGroup

        def die_joining(*args: object, **kwargs: object) -> None:
            say("LW_DIE_JOINING")
            repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            sys.path.insert(0, os.path.join(repo, "bench", "support"))
            from node_kill import kill_own_node

            kill_own_node()

        TrainingGroup.join = die_joining  # type: ignore[method-assign]
    time.sleep(float(os.environ.get("LW_BUILD_S", "0")))  # a slow build (a big model, a dataset to read)
    build_until = os.environ.get("LW_BUILD_UNTIL_FILE", "")
    deadline = time.monotonic() + 120
    while build_until and not os.path.exists(build_until) and time.monotonic() < deadline:
        time.sleep(0.05)  # a build that ends when the test says (a node that joins late, on cue)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Linear(64, 1)
    )
    if os.environ.get("LW_COMPILE"):
        model.compile(backend="eager")
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(4096, 16, generator=g), torch.randn(4096, 1, generator=g))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    decay = float(os.environ.get("LW_LR_DECAY_SAMPLES", "0"))
    session = Session(
        model,
        optimizer,
        data,
        global_batch=24,
        micro_batch=4,
        max_steps=max_steps,
        save_every_steps=int(os.environ.get("LW_SAVE_EVERY", "1000000")),
        checkpoint_dir=os.environ.get("LW_CHECKPOINT_DIR") or None,  # default: elastrain-run --checkpoint-dir
        ddp_kwargs={"bucket_cap_mb": 0.005},  # several buckets: a death can fall between their all-reduces
        lr_schedule=(lambda seen: 1.0 / (1.0 + seen / decay)) if decay else None,  # an LR that changes every step
        # A catch-up's state in several phases even for this tiny model (LW_PHASE_BYTES=4096: three).
        **({"catch_up_phase_bytes": int(os.environ["LW_PHASE_BYTES"])} if os.environ.get("LW_PHASE_BYTES") else {}),
    )
    dying = {"armed": False}

    def die(grad: torch.Tensor) -> torch.Tensor:
        if dying["armed"]:
            if die_rank < 0:
                os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        return grad

    # Which layer's gradient triggers the death: the first layer's comes last in backward, after the later
    # buckets' all-reduces were launched; the last layer's comes first, before any.
    # LW_DIE_LAYER=-1: after the whole backward (every all-reduce done), before optimizer_step().
    die_layer = int(os.environ.get("LW_DIE_LAYER", "0"))
    if die_layer >= 0:
        model[die_layer].weight.register_hook(die)
    with session:
        rank = session.rank
        group_rank = int(os.environ.get("GROUP_RANK", "0"))
        say(f"LW_START rank={rank} ws={session.world_size} pid={os.getpid()} round={session.env.round}")
        seen_regroups = 0
        for step in session:
            live = session.live
            if live is not None and live.regroups != seen_regroups:
                seen_regroups = live.regroups
                say(
                    f"LW_AGREED rank={session.rank} ws={session.world_size} step={session.state.step} "
                    f"hash={state_hash(model, optimizer)} regroups={seen_regroups}"
                )
            if stop_at_ws and stop_at is None and session.world_size >= stop_at_ws:
                stop_at = session.state.step + extra
            if stop_file and stop_at is None and os.path.exists(stop_file):
                stop_at = int(open(stop_file).read())  # noqa: SIM115 - tiny test file
            if stop_at is not None and session.state.step >= stop_at:
                break
            if hang_node == group_rank and step.number == hang_at and session.env.round == 0:
                say(f"LW_HANG rank={session.rank} step={step.number}")
                time.sleep(hang_s)  # deaf to the regroup notice: the agent must restart this worker
            alone = rank == die_rank and session.env.round == 0
            dying["armed"] = step.number == die_at and (group_rank == die_node or alone)
            for mb in step:
                x, y = mb.data
                if first_forward_s:
                    say(f"LW_COMPILING rank={session.rank} step={step.number} s={first_forward_s:g}")
                    time.sleep(first_forward_s)
                    first_forward_s = 0.0
                step.backward(torch.nn.functional.mse_loss(session.model(x), y), mb)
            if die_layer < 0 and dying["armed"]:
                die(torch.zeros(1))
            step.optimizer_step()
            if not step.abandoned:
                say(
                    f"LW_STEP rank={session.rank} ws={session.world_size} step={session.state.step} "
                    f"hash={state_hash(model, optimizer)} samples={session.state.samples_seen} "
                    f"cursor={session.sampler.position.cursor if session.sampler else -1} t={time.time():.3f} "
                    f"whole={int(session.caught_up)}"
                )
            time.sleep(sleep)
        say(
            f"LW_DONE rank={session.rank} step={session.state.step} samples={session.state.samples_seen} "
            f"hash={state_hash(model, optimizer)}"
        )
    hold_file = os.environ.get("LW_END_HOLD_FILE", "")
    if hold_file:  # the session closed; the process is still busy (uploading results, say) until the file exists
        say(f"LW_CLOSED rank={rank}")
        deadline = time.monotonic() + 120
        while not os.path.exists(hold_file) and time.monotonic() < deadline:
            time.sleep(0.05)


if __name__ == "__main__":
    main()
