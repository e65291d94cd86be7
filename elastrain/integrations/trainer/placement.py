"""accelerate's CPU device, made the one CPU tensors report, so that a live world's ``prepare`` copies nothing.

With more than one CPU process accelerate's device is ``cpu:0`` (an index, as for a GPU), while a CPU tensor's is
``cpu``; the two compare unequal, and ``Tensor.to(cpu:0)`` copies a CPU tensor. ``Trainer.train`` is entered again in
every live world, and each time ``Accelerator.prepare`` wraps the optimizer, whose wrapper moves the whole optimizer
state "to the device" and loads the copy: at 100M parameters with AdamW, 0.8 GB copied into fresh memory, 1.1 s of
every rank's first step after each join or departure (py-spy on the Trainer join in ``bench/state_transfer.py``).
On a first start the state is still empty, which is why nobody pays it there. ``cpu`` is accelerate's own device for
one CPU process, and the same device as ``cpu:0``: only the needless copies go.
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate.state import AcceleratorState, PartialState

from elastrain.log import lifecycle

_CPU = torch.device("cpu")


def canonical_cpu_device(accelerator: Any) -> None:
    """Before ``Trainer.train`` in a live world: accelerate's device ``cpu`` where it is ``cpu:0`` (no-op otherwise)."""
    device = accelerator.device
    if device.type != "cpu" or device == _CPU:
        return
    PartialState().device = _CPU  # accelerate's shared state: every AcceleratorState made from now on reads it
    AcceleratorState().device = _CPU
    lifecycle("trainer_device_canonical", was=str(device), now=str(_CPU), why="a prepare copies nothing already there")
