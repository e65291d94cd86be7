"""A logging step whose loss was lost with its world, logged again in the next one.

The Trainer logs the mean loss of a logging window (``logging_steps``) with an all-gather after the window's last
step. A peer that dies after that step's gradient sync and before the log (in the step-end callbacks' collectives,
or in the gather itself) leaves the step complete on every survivor but its log line unwritten, and
``Trainer.train``, entered again for the next world, starts a new window: the log history would lack that step,
unlike an uninterrupted run's.

So each rank keeps its own sum of the window's losses (what ``training_step`` returned, as the Trainer's
``tr_loss`` sums them), cleared whenever the Trainer logs. Every member enters a new world through the driver,
collectively: there the members that completed the agreed step sum their windows, and if that step was a logging
step their history lacks, every member logs its loss at that step the way the Trainer would have, once
``Trainer.train`` has set up its state from memory again (a window in which the world changed logs the members that
were left, as the Trainer logs the steps since a change). Every member decides alike, from the members that
trained: a worker new to the job may be the one that writes the history into the checkpoints.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from elastrain.log import lifecycle


def has_loss_at(history: list[dict[str, Any]], step: int) -> bool:
    """Pure: whether a Trainer's log history holds the training loss logged at ``step`` (looked for from the end)."""
    for entry in reversed(history):
        at = entry.get("step")
        if at == step and "loss" in entry:
            return True
        if isinstance(at, int) and at < step:
            return False
    return False


def logging_due(args: Any, state: Any, step: int) -> bool:
    """Whether the Trainer logs the training loss at ``step`` (``state``: one a ``train()`` call set up, which holds
    the logging interval in steps)."""
    return bool(args.logging_strategy == "steps" and step > 0 and step % int(state.logging_steps) == 0)


def lost_window_loss(total: float, members: float, since_sum: float, lacking: float, step: int) -> float | None:
    """Pure: the mean loss per step of a logging window lost at ``step``, from the sums over the members that
    trained up to it (their window losses, their count, the steps they last logged at, how many lack the log);
    None when no member lacks it."""
    if members == 0 or lacking == 0:
        return None
    since = round(since_sum / members)
    return total / members / max(step - since, 1)


class LostLog:
    """This rank's loss since the Trainer last logged, and the step it last logged."""

    def __init__(self) -> None:
        self.window: torch.Tensor | None = None
        self.logged_at = 0
        self.recovered: tuple[int, dict[str, float]] | None = None
        """The lost window's log, written once ``Trainer.train`` has set up its state again (:meth:`emit`)."""

    def add(self, loss: Any) -> None:
        """One ``training_step``'s loss (a detached scalar tensor; no device sync)."""
        if isinstance(loss, torch.Tensor):
            step_loss = loss.detach().float().sum()
            self.window = step_loss if self.window is None else self.window + step_loss

    def begin(self, step: int) -> None:
        """``Trainer.train`` set up its state at ``step`` (from memory or from a checkpoint): its first logging window
        starts there, as the Trainer's own does."""
        self.window, self.logged_at = None, step

    def logged(self, trainer: Any) -> None:
        """After the Trainer's log call (it may have logged, or not): a new window once it did.

        The Trainer marks the step logged (``_globalstep_last_logged``) before two more collectives (``store_flos``,
        then the log itself); a peer lost between them leaves the mark without the log line. So the window is
        closed only when the history holds that step's loss: else the next world logs it (:meth:`relog`)."""
        last = int(trainer._globalstep_last_logged)
        if last > self.logged_at and has_loss_at(trainer.state.log_history, last):
            self.logged_at, self.window = last, None

    def relog(self, trainer: Any, device: torch.device, own_step: int, agreed_step: int | None) -> None:
        """Collective, on every member entering a world: log a window the last world lost at the agreed step.

        ``own_step``: the step this member had completed before the members agreed (its window covers the steps
        after ``logged_at`` up to it); ``agreed_step``: the step the world goes on from in memory (None: from a
        checkpoint). Whether that step's log was lost is decided by the members that trained up to it, for every
        member alike: a worker new to the job (restarted, or a joiner) holds a ``TrainerState`` of no ``train()``
        call yet (its step 0, its default logging interval, no history) until the next ``train()`` sets it up from
        the state it received, and it may be the rank that writes the history into the checkpoints."""
        if agreed_step is None:  # every member alike: the world loads a checkpoint, where begin() starts the window
            self.window = None
            return
        state = trainer.state
        mine = (
            self.window is not None
            and own_step == agreed_step  # not a member a step ahead (it rolls back) or behind
            and agreed_step > self.logged_at
        )
        lacks = mine and logging_due(trainer.args, state, own_step) and not has_loss_at(state.log_history, own_step)
        noted = torch.tensor(
            [float(self.window.item()) if mine and self.window is not None else 0.0, 1.0 if mine else 0.0,
             float(self.logged_at) if mine else 0.0, 1.0 if lacks else 0.0],
            dtype=torch.float64,
            device=device,
        )  # fmt: skip
        dist.all_reduce(noted)
        self.window, self.logged_at = None, agreed_step  # Trainer.train, entered again, starts its window here
        total, members, since_sum, lacking = noted.tolist()
        loss = lost_window_loss(total, members, since_sum, lacking, agreed_step)
        if loss is None:
            return
        self.recovered = (agreed_step, {"loss": loss})
        if dist.get_rank() == 0:
            lifecycle("trainer_log_recovered", step=agreed_step, members=int(members), loss=round(loss, 6))

    def emit(self, trainer: Any) -> None:
        """In the state ``Trainer.train`` set up again (from memory): the recovered log, as the Trainer logs."""
        recovered, self.recovered = self.recovered, None
        if recovered is not None and recovered[0] == int(trainer.state.global_step):
            trainer.log(recovered[1])
