"""A member that sits a step out joins DDP's gradient all-reduce with zeros, and the next step with everyone.

Three gloo processes, each in the live training group (:class:`~elastrain.live.group.TrainingGroup`) with the
session's comm hook, DDP over a model in several buckets. In the first step ranks 0 and 2 compute and rank 1 sits
out (:func:`~elastrain.session.catch_up.sync_idle`): every rank must end with the same gradient, the holders' mean,
bit for bit, and the step's flags agreed. In the second step all three compute: DDP rebuilds its buckets there (a
broadcast from rank 0 that the idle rank joins), and every rank's gradient is the three's mean.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from support.processes import spawned_ranks
from torch.nn.parallel import DistributedDataParallel

from elastrain.live.group import TrainingGroup
from elastrain.session.catch_up import CatchUp, sync_idle
from elastrain.session.runtime import ddp_kwargs
from elastrain.step_flags import StepFlags

HOLDERS = (0, 2)


def _model() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(6)))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g)


def _local_grads(rank: int, step: int) -> list[torch.Tensor]:
    model = _model()
    x, y = _batch(rank, step)
    torch.nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _worker(rank: int, port: int, out: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    group = TrainingGroup("gloo", timeout_s=60.0)
    group.join(0, rank, 3, "127.0.0.1", port)
    flags = StepFlags()
    flags.add("raised", lambda: rank == 1)  # only the idle rank raises it: every rank must see it
    model = _model()
    ddp = DistributedDataParallel(model, **ddp_kwargs({"bucket_cap_mb": 0.02}, in_sync=True))
    shares: dict[str, CatchUp | None] = {"now": CatchUp(HOLDERS, rank, 0)}

    def hook(state: object, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        share = shares["now"]
        if share is None:
            return group.comm_hook(state, bucket, flags)
        return group.comm_hook(state, bucket, flags, share.contributors, share.idle)

    ddp.register_comm_hook(None, lambda state, bucket: hook(state, bucket))
    results: dict[str, Any] = {"rank": rank}
    for step in (1, 2):
        flags.begin_step()
        share = shares["now"]
        if share is not None and share.idle:
            sync_idle(ddp)
        else:
            x, y = _batch(rank, step)
            torch.nn.functional.mse_loss(ddp(x), y).backward()  # type: ignore[no-untyped-call]
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        contributors = HOLDERS if step == 1 else (0, 1, 2)
        local = [_local_grads(r, step) for r in contributors]
        expected = [sum(gs) / len(contributors) for gs in zip(*local, strict=True)]
        results[f"step{step}"] = {
            "count": len(grads),
            "bits": [g.numpy().tobytes().hex()[:64] + str(float(g.double().sum())) for g in grads],
            "close": all(torch.allclose(g, e, atol=1e-6) for g, e in zip(grads, expected, strict=True)),
            "flags": flags.agreed(),
        }
        model.zero_grad(set_to_none=True)
        shares["now"] = None  # the world is whole from the second step on
    group.leave()
    out.put(results)


def test_an_idle_member_gets_the_holders_mean_gradient_and_joins_the_next_step() -> None:
    results = spawned_ranks(_worker, 3)
    n_params = len(list(_model().parameters()))
    for step in ("step1", "step2"):
        seen = [r[step] for r in results]
        assert all(s["count"] == n_params for s in seen), seen  # the idle rank got every parameter's gradient
        assert seen[0]["bits"] == seen[1]["bits"] == seen[2]["bits"]  # the same gradient on every rank, bit for bit
        assert all(s["close"] for s in seen)  # the contributors' mean: the idle rank's zeros not counted
        assert all(s["flags"] == {"raised": True} for s in seen)  # the idle rank's flag rode along
