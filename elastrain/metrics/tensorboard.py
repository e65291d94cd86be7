"""An optional TensorBoard writer that continues a run's curves from the restored step.

Needs the ``tensorboard`` package (``pip install elastrain[tensorboard]``). It uses
``SummaryWriter(purge_step=restored_step + 1)``, so TensorBoard hides the events an earlier start
wrote past the restored step: the same superseding as :mod:`elastrain.metrics.series`.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from elastrain.errors import ElastrainError


def tensorboard_available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


class TensorBoardWriter:
    def __init__(self, logdir: str | os.PathLike[str], restored_step: int = 0) -> None:
        if not tensorboard_available():
            raise ElastrainError(
                "TensorBoard logging needs the tensorboard package: pip install 'elastrain[tensorboard]'"
            )
        from torch.utils.tensorboard import SummaryWriter

        self._writer: Any = SummaryWriter(log_dir=str(logdir), purge_step=restored_step + 1 if restored_step else None)

    def log(self, step: int, **values: Any) -> None:
        for name, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
