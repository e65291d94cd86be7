"""The session's learning rate: the batch plan's scale, ramped after a world-size change, times the schedule."""

from __future__ import annotations

import torch

from elastrain.scaling import BatchPlan, Policy, ramped_scale
from elastrain.session.config import SessionConfig
from elastrain.train_state import TrainState


class LearningRate:
    """Sets each parameter group's LR from its base LR (``initial_lr``, else ``lr`` when the session starts).

    With neither an LR policy nor a schedule the script's own LR (or scheduler) stands: nothing is set."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: SessionConfig) -> None:
        self.optimizer = optimizer
        self.config = config
        self.base_lrs = [float(g.get("initial_lr", g["lr"])) for g in optimizer.param_groups]

    def multiplier(self, plan: BatchPlan | None, state: TrainState) -> float | None:
        schedule = self.config.lr_schedule
        if plan is None or (schedule is None and plan.policy is Policy.CONSTANT):
            return None
        scale = ramped_scale(
            state.previous_lr_scale(),
            plan.lr_scale,
            state.steps_since_change,
            self.config.scaling.rescale_warmup_steps,
        )
        return scale * (schedule(state.samples_seen) if schedule is not None else 1.0)

    def for_next_step(self, plan: BatchPlan | None, state: TrainState) -> float | None:
        """The first parameter group's LR for the next step (``None``: the session leaves LR alone)."""
        mult = self.multiplier(plan, state)
        return None if mult is None else self.base_lrs[0] * mult

    def apply(self, plan: BatchPlan | None, state: TrainState) -> float | None:
        """Set every group's LR for the next step; the first group's (``None``: left alone)."""
        mult = self.multiplier(plan, state)
        if mult is None:
            return None
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * mult
        return float(self.optimizer.param_groups[0]["lr"])
