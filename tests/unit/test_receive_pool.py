"""The memory a warm worker makes ready for the optimizer state it will receive (elastrain/live/receive_pool.py);
its touching thread: tests/integration/test_receive_pool_thread.py."""

from __future__ import annotations

import itertools

import pytest
import torch

from elastrain.live.receive_pool import ReceivePool, state_tensors_per_parameter
from elastrain.live.stream import canonical_device


class Odd(torch.optim.SGD):
    """A user's optimizer of its own: its state is not known."""


@pytest.mark.parametrize(
    ("optimizer_class", "tensors"),
    [
        (torch.optim.Adam, 2),
        (torch.optim.AdamW, 2),
        (torch.optim.NAdam, 2),
        (torch.optim.RAdam, 2),
        (torch.optim.Adamax, 2),
        (torch.optim.SGD, 0),
        (torch.optim.Adagrad, 0),
        (torch.optim.RMSprop, 0),
        (Odd, 0),
        (object, 0),
        ("AdamW", 0),
    ],
)
def test_only_the_adam_family_state_is_known(optimizer_class: object, tensors: int) -> None:
    assert state_tensors_per_parameter(optimizer_class) == tensors  # type: ignore[arg-type]


def _model(widths: list[int]) -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in itertools.pairwise(widths)])


def test_an_optimizer_with_state_or_of_another_kind_gets_an_empty_pool() -> None:
    model = _model([3, 4])
    adam = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    adam.step()
    assert ReceivePool.for_optimizer(adam).left() == []  # it receives into its own state
    assert ReceivePool.for_optimizer(torch.optim.SGD(model.parameters(), lr=0.1)).left() == []


def test_parameters_off_the_cpu_or_frozen_get_no_memory() -> None:
    meta = torch.nn.Linear(4, 4, device="meta")
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    pool = ReceivePool.for_parameters([*meta.parameters(), *frozen.parameters()], torch.optim.AdamW)
    assert pool.left() == []


def test_take_matches_shape_dtype_and_device_and_runs_out() -> None:
    pool = ReceivePool([torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bfloat16)])
    cpu0 = torch.device("cpu", 0)  # accelerate's name for the CPU
    assert pool.take((3, 2), torch.float32, cpu0) is None
    first = pool.take((2, 3), torch.float32, cpu0)
    assert first is not None and first[0].dtype == torch.float32 and first[1], "given touched: it is"
    assert pool.take((2, 3), torch.float32, cpu0) is None
    assert pool.take((2, 3), torch.bfloat16, torch.device("cpu")) is not None
    pool.close()
    assert pool.left() == []


@pytest.mark.parametrize(
    ("given", "canonical"),
    [(torch.device("cpu", 0), torch.device("cpu")), (torch.device("cpu"), torch.device("cpu"))],
)
def test_the_cpu_is_named_as_its_tensors_name_it(given: torch.device, canonical: torch.device) -> None:
    assert canonical_device(given) == canonical == torch.zeros(1).device
