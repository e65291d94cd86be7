"""A Hugging Face ``Trainer`` with elastrain's settings given explicitly: the same machinery as the zero-code
integration (:mod:`elastrain.integrations.trainer`), which infers them.

Under ``elastrain-run`` an unmodified Trainer script is elastic already. Use this when you want to say what
the integration would otherwise infer: the global batch (instead of ``per_device × accumulation × first world
size``), the largest micro-batch, the data order's seed, how many checkpoints to keep, the output directory
(default ``--checkpoint-dir``). It also makes the Trainer elastic under plain ``torchrun`` or with
``elastrain-run --trainer-integration false``::

    from elastrain.integrations.hf_trainer import ElasticTrainerRun

    elastic = ElasticTrainerRun(global_batch=32, micro_batch=8, max_steps=200)
    args = TrainingArguments(**elastic.training_args(), learning_rate=3e-4, save_steps=20)
    trainer = Trainer(model=model, args=args, train_dataset=elastic.dataset(train_set),
                      data_collator=collate, callbacks=[elastic.callback])
    trainer.train(resume_from_checkpoint=elastic.resume_from())

``elastic.callback`` carries the settings to the Trainer it is given to; the integration's driver
(:class:`~elastrain.integrations.trainer.driver.ElasticTrainer`) does the rest: the exact global batch at every
world size, the data as a world-size independent stream from the checkpoint's sample cursor, committed
``checkpoint-N`` folders, resume from the newest committed one, live regroup under ``--live``, and metrics
keyed by global step.
"""

from __future__ import annotations

import os
from typing import Any

from elastrain.env import WorkerEnv
from elastrain.errors import CheckpointError, ScalingError
from elastrain.integrations.trainer import hook
from elastrain.integrations.trainer.batch import TrainerSettings, device_batch, trainer_plan
from elastrain.integrations.trainer.checkpoints import choose
from elastrain.integrations.trainer.settings import SettingsCallback
from elastrain.log import configure

__all__ = ["ElasticTrainerRun", "SettingsCallback", "TrainerSettings"]


class ElasticTrainerRun:
    """Explicit elastic settings for one Trainer; build it before the ``TrainingArguments``."""

    def __init__(
        self,
        global_batch: int,
        micro_batch: int,
        max_steps: int | None = None,
        *,
        num_train_epochs: float | None = None,
        output_dir: str | os.PathLike[str] | None = None,
        keep_last: int = 2,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        configure()
        hook.install()  # the Trainer's patches, also without elastrain-run's bootstrap
        self.env = WorkerEnv.from_environ()
        root = output_dir if output_dir is not None else self.env.checkpoint_dir
        if root is None:
            raise CheckpointError(
                "no output directory: launch with elastrain-run --checkpoint-dir DIR or pass output_dir=..."
            )
        if max_steps is None and num_train_epochs is None:
            raise ScalingError("give max_steps or num_train_epochs (the run's length must not depend on world size)")
        if keep_last < 1:
            raise CheckpointError(f"keep_last must be >= 1, got {keep_last}")
        if global_batch < 1 or micro_batch < 1:
            raise ScalingError(f"global_batch and micro_batch must be >= 1, got {global_batch} and {micro_batch}")
        self.root = os.path.abspath(os.fspath(root))
        self.global_batch = global_batch
        self.max_steps = max_steps
        self.num_train_epochs = num_train_epochs
        self.settings = TrainerSettings(global_batch, micro_batch, seed, shuffle, keep_last)
        self.callback = SettingsCallback(self.settings)

    def training_args(self) -> dict[str, Any]:
        """Keyword arguments for ``TrainingArguments`` (pass the rest yourself). The batch settings are the ones
        for the current world size; the integration sets them again at every world size."""
        env = self.env
        p = trainer_plan(self.global_batch, self.settings.micro_batch, env.world_size)
        micro, accumulation = device_batch(p, env.rank)
        out: dict[str, Any] = {
            "output_dir": self.root,
            "per_device_train_batch_size": micro,
            "gradient_accumulation_steps": accumulation,
            "save_total_limit": self.settings.keep_last,
            "dataloader_drop_last": False,
        }
        if self.max_steps is not None:
            out["max_steps"] = self.max_steps
        if self.num_train_epochs is not None:
            out["num_train_epochs"] = self.num_train_epochs
        return out

    def dataset(self, train_dataset: Any) -> Any:
        """The training set, as given: the integration reads it as elastrain's stream."""
        return train_dataset

    def resume_from(self) -> str | None:
        """The newest committed checkpoint (``trainer.train`` would resume from it anyway)."""
        return choose(None, self.root).path

    @property
    def start_step(self) -> int:
        """The step the first ``trainer.train()`` call resumed from (0: a fresh start)."""
        return self.callback.start_step or 0
