"""accelerate's multi-CPU device (``cpu:0``) made ``cpu`` before a live world's ``prepare``: the optimizer's state is
then wrapped where it is, not copied (elastrain/integrations/trainer/placement.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.state import AcceleratorState, PartialState

from elastrain.integrations.trainer.placement import canonical_cpu_device


@pytest.fixture
def accelerator() -> Iterator[Accelerator]:
    """An accelerator whose device is ``cpu:0``, as accelerate sets it for every CPU process of a distributed run."""
    AcceleratorState._reset_state(True)
    acc = Accelerator(cpu=True)
    PartialState().device = torch.device("cpu", 0)
    AcceleratorState().device = torch.device("cpu", 0)
    yield acc
    AcceleratorState._reset_state(True)


def _optimizer_with_state() -> torch.optim.Optimizer:
    model = torch.nn.Linear(32, 32)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    return optimizer


def _state_ptrs(optimizer: torch.optim.Optimizer) -> list[int]:
    return [t.data_ptr() for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]


def test_a_cpu0_device_copies_the_optimizer_state_at_every_wrap_and_cpu_copies_none(accelerator: Accelerator) -> None:
    optimizer = _optimizer_with_state()
    before = _state_ptrs(optimizer)
    AcceleratedOptimizer(optimizer)
    assert _state_ptrs(optimizer) != before  # the premise: torch copies a CPU tensor moved to cpu:0

    canonical_cpu_device(accelerator)
    assert accelerator.device == torch.device("cpu") and AcceleratorState().device == torch.device("cpu")
    before = _state_ptrs(optimizer)
    AcceleratedOptimizer(optimizer)
    assert _state_ptrs(optimizer) == before


def test_a_device_that_is_not_an_indexed_cpu_is_left_alone(accelerator: Accelerator) -> None:
    PartialState().device = torch.device("cpu")
    AcceleratorState().device = torch.device("cpu")
    canonical_cpu_device(accelerator)
    assert accelerator.device == torch.device("cpu")
