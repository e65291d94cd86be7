"""The checksum that tells whether a receiver holds a frozen parameter bit for bit (elastrain.live.frozen)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elastrain.live.frozen import checksum, frozen_names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8])
@pytest.mark.parametrize("shape", [(0,), (1,), (3,), (7, 5), (64, 64), (1000,)])
def test_equal_bits_give_equal_checksums_and_a_changed_element_another(dtype: torch.dtype, shape: tuple[int]) -> None:
    t = (torch.arange(1, 1 + int(torch.tensor(shape).prod())) % 251).to(dtype).reshape(shape)
    assert checksum(t) == checksum(t.clone())
    if t.numel():
        changed = t.clone().reshape(-1)
        changed[-1] += 1
        assert checksum(changed.reshape(shape)) != checksum(t)


def test_words_moved_change_it_a_transposed_square_too() -> None:
    g = torch.Generator().manual_seed(0)
    square = torch.randn(96, 96, generator=g)
    assert checksum(square.t().contiguous()) != checksum(square)
    assert checksum(square.t()) == checksum(square.t().contiguous())  # a view reads as its values' order
    flat = square.reshape(-1)
    assert checksum(flat.roll(1)) != checksum(flat)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(allow_nan=False, width=32), min_size=1, max_size=200), st.integers(0, 199))
def test_any_single_change_is_seen(values: list[float], at: int) -> None:
    t = torch.tensor(values, dtype=torch.float32)
    other = t.clone()
    at %= len(values)
    other[at] = other[at] + 1.0 if abs(float(other[at])) < 1e6 else 0.5
    if torch.equal(other.view(torch.int32), t.view(torch.int32)):
        return  # the change rounded away
    assert checksum(other) != checksum(t)


def test_frozen_names_are_the_state_dict_keys_of_parameters_without_grad_tied_ones_under_each_name() -> None:
    m = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False), torch.nn.Linear(10, 2))
    m[1].weight = torch.nn.Parameter(torch.randn(10, 4))
    m[0].weight = m[1].weight  # tied
    m[0].requires_grad_(False)
    m.register_buffer("steps", torch.zeros(1))
    assert frozen_names(m) == ["0.weight", "1.weight"]
    assert set(frozen_names(m)) <= set(m.state_dict())
