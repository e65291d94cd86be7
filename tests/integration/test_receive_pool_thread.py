"""The thread of a warm worker's receive pool (elastrain/live/receive_pool.py): it touches the memory for the
optimizer state while the worker waits, and stops when the transfer starts."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.state_dict import get_state_dict

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


def test_gradients_are_made_zeroed_for_the_first_backward_and_it_adds_into_them_exactly() -> None:
    torch.manual_seed(0)
    model, twin = _model([5, 7, 3]), _model([5, 7, 3])
    twin.load_state_dict(model.state_dict())
    kept = torch.full_like(model[0].bias, 2.0)
    model[0].bias.grad = kept  # a gradient the script made itself stays as it is
    pool = ReceivePool.for_optimizer(torch.optim.AdamW(model.parameters()), gradients=True)
    assert pool.ready(timeout_s=60.0), "the thread did not touch every tensor"
    pool.stop()
    assert model[0].bias.grad is kept
    made = [p for p in model.parameters() if p is not model[0].bias]
    assert all(p.grad is not None and p.grad.shape == p.shape and p.grad.count_nonzero() == 0 for p in made)
    model[0].bias.grad = None
    x = torch.randn(4, 5)
    model(x).square().sum().backward()
    twin(x).square().sum().backward()
    for mine, theirs in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(mine.grad, theirs.grad)  # type: ignore[arg-type]


def test_the_gradients_are_made_on_the_calling_thread_before_the_pool_is_returned() -> None:
    """The training thread's own arena holds them (glibc): freed by ``zero_grad``, they are what that thread's next
    backward allocates from. No parameter gets one later, from the touching thread."""
    for _ in range(3):
        model = _model([64] * 12)
        pool = ReceivePool.for_optimizer(torch.optim.AdamW(model.parameters()), gradients=True)
        given = [p.grad for p in model.parameters()]
        assert all(g is not None and g.count_nonzero() == 0 for g in given)
        pool.close()
        assert [p.grad for p in model.parameters()] == given


def test_gradients_only_when_asked_and_for_an_optimizer_of_unknown_state_too() -> None:
    model = _model([3, 4])
    pool = ReceivePool.for_optimizer(torch.optim.AdamW(model.parameters()))
    assert pool.ready(timeout_s=60.0)
    pool.close()
    assert all(p.grad is None for p in model.parameters())
    pool = ReceivePool.for_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), gradients=True)
    assert pool.left() == [] and pool.ready(timeout_s=60.0)
    pool.close()
    assert all(p.grad is not None and p.grad.count_nonzero() == 0 for p in model.parameters())


def test_taken_back_gradients_let_torch_build_the_optimizer_state_a_checkpoint_loads_into() -> None:
    model = _model([4, 6, 2])
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pool = ReceivePool.for_optimizer(sgd, gradients=True)
    assert pool.ready(timeout_s=60.0)
    mine = torch.ones_like(model[1].bias)
    model[1].bias.grad = mine  # changed since the pool gave it: not the pool's any more
    pool.take_back_gradients()
    pool.close()
    assert model[1].bias.grad is mine
    model[1].bias.grad = None
    assert all(p.grad is None for p in model.parameters())
    _, optim_state = get_state_dict(model, sgd)
    assert all("momentum_buffer" in s for s in optim_state["state"].values()) and optim_state["state"]
