"""The thread of a warm worker's receive pool (elastrain/live/receive_pool.py): it touches the memory for the
optimizer state while the worker waits, and stops when the transfer starts."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elastrain.live.receive_pool import ReceivePool


def _model(widths: list[int]) -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in itertools.pairwise(widths)])


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=2, max_size=5), st.sampled_from([torch.optim.Adam, torch.optim.AdamW]))
def test_the_pool_holds_one_touched_tensor_for_each_state_tensor_the_optimizer_makes(
    widths: list[int], optimizer_class: type[torch.optim.Adam]
) -> None:
    model = _model(widths)
    pool = ReceivePool.for_optimizer(optimizer_class(model.parameters()))
    assert pool.ready(timeout_s=60.0), "the thread did not touch every tensor"
    pool.stop()
    trained = optimizer_class(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    trained.step()
    wanted = [v for s in trained.state.values() for v in s.values() if v.dim()]  # the step counters are scalars
    taken = [pool.take(tuple(v.shape), v.dtype, v.device) for v in wanted]
    tensors = [t for t, touched in (x for x in taken if x is not None) if touched]
    assert len(tensors) == len(wanted) and all(t.count_nonzero() == 0 for t in tensors)
    assert len({t.data_ptr() for t in tensors}) == len(wanted), "a tensor was handed out twice"
    assert pool.left() == [] and pool.bytes == 0


def test_after_stop_every_tensor_is_handed_out_touched_or_not() -> None:
    pool = ReceivePool([torch.empty(4) for _ in range(3)], touch=True)
    pool.close()  # at once: the thread may have touched none, some or all of them
    pool = ReceivePool([torch.empty(4) for _ in range(3)], touch=True)
    pool.stop()
    taken = [pool.take((4,), torch.float32, torch.device("cpu")) for _ in range(3)]
    flags = [touched for _, touched in (t for t in taken if t is not None)]
    assert len(flags) == 3 and all(t.count_nonzero() == 0 for t, touched in (x for x in taken if x) if touched)


def test_take_before_the_transfer_stopped_the_thread_is_an_error() -> None:
    pool = ReceivePool([torch.empty(1 << 20) for _ in range(4)], touch=True)
    try:
        with pytest.raises(RuntimeError, match="before stop"):
            pool.take((1 << 20,), torch.float32, torch.device("cpu"))
    finally:
        pool.close()
