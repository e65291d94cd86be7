"""TrainState: the counters that must survive restarts, independent of the world size.

It is a Stateful (``state_dict``/``load_state_dict`` of plain JSON data) registered with the
checkpointer next to the model, optimizer and sampler. RNG states are the checkpointer's job.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from elastrain.errors import CheckpointMismatchError

_STATE_VERSION = 1


@dataclass(frozen=True)
class WorldSizeChange:
    """From ``step`` on (the first step run at this size), the job ran with ``world_size`` workers."""

    step: int
    world_size: int
    time: float
    lr_scale: float = 1.0


@dataclass
class TrainState:
    step: int = 0
    """Optimizer steps completed."""
    samples_seen: int = 0
    """Samples learnt from (the LR schedule's clock)."""
    epoch: int = 0
    history: list[WorldSizeChange] = field(default_factory=list)

    @property
    def world_size(self) -> int | None:
        """The world size of the latest start, None before the first."""
        return self.history[-1].world_size if self.history else None

    @property
    def reference_world_size(self) -> int | None:
        """The world size of the first start (the default reference for LR scaling)."""
        return self.history[0].world_size if self.history else None

    @property
    def steps_since_change(self) -> int:
        return self.step - self.history[-1].step if self.history else self.step

    def previous_lr_scale(self) -> float | None:
        """The LR scale in force before the latest change, None if there was none."""
        return self.history[-2].lr_scale if len(self.history) >= 2 else None

    def start(self, world_size: int, lr_scale: float = 1.0, now: float | None = None) -> int | None:
        """Record a start at ``world_size``; return the previous world size when it changed, else None.

        A restart at the same size adds nothing: the history lists changes, not restarts.
        """
        previous = self.world_size
        if previous == world_size:
            return None
        self.history.append(WorldSizeChange(self.step, world_size, time.time() if now is None else now, lr_scale))
        return previous

    def advance(self, samples: int, epoch: int) -> None:
        """One optimizer step of ``samples`` samples is done; the data stream now stands in ``epoch``."""
        self.step += 1
        self.samples_seen += samples
        self.epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "step": self.step,
            "samples_seen": self.samples_seen,
            "epoch": self.epoch,
            "history": [
                {"step": h.step, "world_size": h.world_size, "time": h.time, "lr_scale": h.lr_scale}
                for h in self.history
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            self.step = int(state["step"])
            self.samples_seen = int(state["samples_seen"])
            self.epoch = int(state["epoch"])
            self.history = [
                WorldSizeChange(int(h["step"]), int(h["world_size"]), float(h["time"]), float(h.get("lr_scale", 1.0)))
                for h in state.get("history", [])
            ]
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointMismatchError(f"the checkpoint's train state is malformed ({exc!r}): {state!r}") from None
