"""A Session job that counts the checkpointer's own agreement all-reduces, and asks for a save on one rank.

    SF_REQUEST_AT=<step>  group rank 1 writes a save request into its own node's control channel before
                          that step's backward (as its agent does for a leave): only that rank sees it.
Prints ``SF_DONE rank= agree_calls= loss_calls= losses= hash=`` at the end (``loss_calls``: the session's own
all-reduces made while ``step.mean_loss()`` ran; ``losses``: the mean losses, comma-separated; ``hash``: the
model's parameters).
"""

from __future__ import annotations

import hashlib
import os

import torch
from torch.utils.data import TensorDataset

from elastrain.checkpoint.group import Group
from elastrain.control import ControlChannel, SaveCause
from elastrain.session import Session
from elastrain.session.runtime import Runtime

CALLS = {"all_max": 0, "all_reduce": 0}
_all_max = Group.all_max
_all_reduce = Runtime.all_reduce


def _counted(self: Group, values: list[int]) -> list[int]:
    CALLS["all_max"] += 1
    return _all_max(self, values)


def _counted_reduce(self: Runtime, tensor: torch.Tensor) -> None:
    CALLS["all_reduce"] += 1
    _all_reduce(self, tensor)


Group.all_max = _counted  # type: ignore[method-assign]
Runtime.all_reduce = _counted_reduce  # type: ignore[method-assign]


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(256, 8, generator=g), torch.randn(256, 1, generator=g))
    request_at = int(os.environ.get("SF_REQUEST_AT", "0"))
    session = Session(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        data,
        global_batch=16,
        micro_batch=4,
        max_steps=int(os.environ.get("SF_MAX_STEPS", "12")),
        ddp_kwargs={"bucket_cap_mb": 0.0001},  # several buckets: the flags ride on the last one only
    )
    losses: list[float] = []
    loss_calls = 0
    with session:
        for step in session:
            if step.number == request_at and session.env.group_rank == 1 and session.env.control_dir:
                ControlChannel(session.env.control_dir).request_save(SaveCause.LEAVE, "leave: test")
            for mb in step:
                x, y = mb.data
                step.backward(torch.nn.functional.mse_loss(session.model(x), y), mb)
            step.optimizer_step()
            before = CALLS["all_reduce"]
            losses.append(step.mean_loss())
            loss_calls += CALLS["all_reduce"] - before
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
        print(
            f"SF_DONE rank={session.rank} agree_calls={CALLS['all_max']} loss_calls={loss_calls} "
            f"losses={','.join(repr(v) for v in losses)} hash={digest[:16]}",
            flush=True,
        )


if __name__ == "__main__":
    main()
