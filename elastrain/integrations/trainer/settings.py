"""The callback that carries an ``ElasticTrainerRun``'s explicit settings to the Trainer it is given to."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from elastrain.integrations.trainer.batch import TrainerSettings


class SettingsCallback(TrainerCallback):
    """Hands :class:`TrainerSettings` to the Trainer it is given to: the driver reads them from its callbacks."""

    def __init__(self, settings: TrainerSettings) -> None:
        self.settings = settings
        self.start_step: int | None = None
        """The step the first ``trainer.train()`` call resumed from (0: a fresh start)."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.start_step is None:
            self.start_step = int(state.global_step)
