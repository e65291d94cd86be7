"""A member that sits out the first step of a world while the state streams to it: the running workers never wait.

At a join (and at a SIGKILL that rolls a member back) the members that need the agreed state (``needy``: joiners,
members ahead of the agreed step) receive it from those that hold it. Sent before the step, the running workers wait
for every byte of it: a stall that grows with the model. With a catch-up (live mode, gloo, the default
``overlap_state_transfer=True``), the new world's first step is the *holders'* step:

- the holders compute it alone, on their data plan (:func:`~elastrain.scaling.plan` for as many workers as hold the
  state, each at its index among them), and their gradient average divides by their number;
- every tensor of the state, the model's too, streams to the needy in the background while the holders' forward and
  backward run (each holder's optimizer step waits only for its own send, as before);
- a needy member takes no sample: it joins the step's gradient all-reduce with zeros, bucket by bucket as DDP's own
  join shadowing does (:func:`sync_idle`), so it receives the holders' averaged gradient; once its state has arrived
  it applies the same optimizer step to the same state with the same gradient, and holds the holders' state of that
  step bit for bit (any optimizer whose step is a function of its state and the gradient);
- from the next step on, the world is whole: every member trains on the plan of the full world
  (:meth:`~elastrain.session.world.World.finish_catch_up`).

A larger state arrives in phases (:mod:`elastrain.live.phases`), a run of parameters per step: the needy sit out as
many steps as there are phases, and each steps only the parameters whose state has arrived.

:func:`eligible` says when the world's first step can run so: DDP's collectives in that step must be the gradient
buckets and nothing else (no module buffers broadcast in the forward, no unused-parameter search, no static graph).
Otherwise the state arrives before the step, as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel


@dataclass(frozen=True)
class CatchUp:
    """The first steps of a world, which its needy members sit out (the same on every member but for ``index``)."""

    holders: tuple[int, ...]
    """The ranks that hold the agreed state: they compute the step."""
    rank: int
    """This member's rank."""
    after: int
    """The agreed step: the steps sat out are the next ones."""
    steps: int = 1
    """How many steps the needy sit out: the phases their state arrives in (:mod:`elastrain.live.phases`)."""

    @property
    def contributors(self) -> int:
        """How many members contribute samples and gradients to the step (the gradient average divides by it)."""
        return len(self.holders)

    @property
    def idle(self) -> bool:
        """Whether this member sits the step out (it receives the state meanwhile)."""
        return self.rank not in self.holders

    @property
    def index(self) -> int:
        """A holder's index among the holders: its part of the step's data plan (an idle member's: 0, unused)."""
        return self.holders.index(self.rank) if not self.idle else 0


def worth_it(holders: int, trained_at: int | None) -> bool:
    """Pure: whether the needy should sit out rather than receive the whole state before the step. The holders
    compute the steps sat out alone, each its share of the global batch: no more than before the change when there
    are as many of them as trained the agreed step (a join), more otherwise (a survivor rolled back, a spare promoted
    after a death: a step at twice the time costs more than moving the whole state first). Unknown: sit out."""
    return trained_at is None or holders >= trained_at


def eligible(module: torch.nn.Module, ddp_kwargs: Mapping[str, Any]) -> bool:
    """Pure: whether DDP's only collectives in a step over ``module`` (with the session's ``ddp_kwargs``) are its
    gradient buckets, which a member with no data can join with zeros. Not when DDP broadcasts module buffers in the
    forward (``broadcast_buffers``, on by default, with any buffer), searches for unused parameters (an all-reduce of
    its own) or runs a static graph (its first steps defer their all-reduce)."""
    if ddp_kwargs.get("find_unused_parameters") or ddp_kwargs.get("static_graph"):
        return False
    broadcasts = ddp_kwargs.get("broadcast_buffers", True)
    return not (broadcasts and any(True for _ in module.buffers()))


def sync_idle(model: DistributedDataParallel) -> None:
    """An idle member's part of the step's gradient all-reduce: a zero bucket for each of DDP's buckets, in DDP's
    order, through the registered comm hook (which divides by the contributors and carries the step flags); the
    averaged result becomes each parameter's gradient (a view of its bucket). Afterwards the reducer counts every
    parameter as ready, so that the bucket rebuild at the next forward (a broadcast from rank 0) is joined as the
    holders join it, in that forward or, sitting the next step out too, here. Raises what the hook's futures raise
    (``GroupBrokenError``, a RuntimeError from gloo)."""
    reducer = model.reducer
    # As DDP's own join shadowing: the holders' second forward rebuilds the buckets (a broadcast from rank 0),
    # which a member that sits a second step out joins here (nothing in any other step).
    reducer._rebuild_buckets()
    buckets = reducer._get_zeros_like_grad_buckets()
    futures = [reducer._run_comm_hook(bucket) for bucket in buckets]
    for bucket, future in zip(buckets, futures, strict=True):
        future.wait()
        for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            param.grad = grad
    reducer._push_all_rebuilt_params()
