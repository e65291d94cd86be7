"""A catch-up's state in phases (pure plan), and why a receiver that steps only the parameters whose state arrived
holds the holders' state bit for bit once every phase has landed."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from elastrain.live.phases import PER_PARAMETER, parameter_groups, plan_phases
from elastrain.live.transfer import _tensors_by_path

KIB = 1 << 10


@pytest.mark.parametrize(
    ("sizes", "groups", "phase_bytes", "expected"),
    [
        ([], [], 10, []),
        ([5, 5], [None, None], 1, [0, 0]),  # no parameter: everything in the first phase
        ([10, 10, 10, 10], [0, 1, 2, 3], 100, [0, 0, 0, 0]),  # under one phase's bytes
        ([10, 10, 10, 10], [0, 1, 2, 3], 20, [0, 0, 1, 1]),
        ([10, 10, 10, 10], [0, 0, 1, 1], 10, [0, 0, 1, 1]),  # a parameter's tensors stay together
        ([10, 1, 10, 1], [0, None, 1, None], 10, [0, 0, 1, 0]),
        ([40, 1, 1], [0, 1, 2], 7, [0, 1, 1]),  # one large parameter: the phases are numbered without gaps
        ([10] * 20, list(range(20)), 1, [n * 8 // 20 for n in range(20)]),  # at most MAX_PHASES (8)
    ],
)
def test_phases_by_table(sizes: list[int], groups: list[int | None], phase_bytes: int, expected: list[int]) -> None:
    assert plan_phases(sizes, groups, phase_bytes) == expected


@given(
    st.lists(st.tuples(st.integers(0, 1 << 20), st.one_of(st.none(), st.integers(0, 30))), max_size=60),
    st.integers(1, 4 << 20),
    st.integers(1, 8),
)
def test_a_plan_keeps_parameters_whole_in_order_and_within_its_bound(
    slots: list[tuple[int, int | None]], phase_bytes: int, max_phases: int
) -> None:
    sizes, groups = [s for s, _ in slots], [g for _, g in slots]
    phases = plan_phases(sizes, groups, phase_bytes, max_phases)
    assert len(phases) == len(slots)
    used = sorted(set(phases))
    assert used == list(range(len(used))) and len(used) <= max_phases  # 0, 1, ... without gaps
    by_group: dict[int, set[int]] = {}
    for g, p in zip(groups, phases, strict=True):
        if g is None:
            assert p == 0
        else:
            by_group.setdefault(g, set()).add(p)
    assert all(len(ps) == 1 for ps in by_group.values())  # a parameter's tensors share a phase
    order = [next(iter(by_group[g])) for g in sorted(by_group)]
    assert order == sorted(order)  # parameters in index order
    total = sum(s for s, g in slots if g is not None)
    assert len(used) <= max(1, -(-total // phase_bytes))


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def test_each_state_path_names_its_parameter_by_the_optimizers_numbering() -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    paths = list(_tensors_by_path({"model": model.state_dict(), "optimizer": optimizer.state_dict()}))
    paths.append("objects/train_state/x")
    groups = dict(zip(paths, parameter_groups(paths, model, optimizer), strict=True))
    assert groups["model/0.weight"] == 0 and groups["model/2.bias"] == 3
    assert groups["optimizer/state/%232/exp_avg_sq"] == 2 and groups["optimizer/state/%230/step"] == 0
    assert groups["objects/train_state/x"] is None


@pytest.mark.parametrize("kind", PER_PARAMETER)
def test_a_receiver_stepping_only_what_arrived_ends_with_the_holders_state(kind: type[torch.optim.Optimizer]) -> None:
    """The argument behind the phases, on one process: the holder trains 3 steps from state s; the receiver starts
    from garbage, gets parameter i's state as the holder held it at step s+i (after i of those steps) and steps, with
    the holder's gradients, only the parameters whose state it has. After the 3 steps both hold the same bits."""
    holder = _model()
    opt_h = kind(holder.parameters(), lr=0.01)
    for _ in range(2):  # some state to start from
        holder(torch.randn(4, 8)).pow(2).sum().backward()
        opt_h.step()
        opt_h.zero_grad()
    receiver = copy.deepcopy(holder)
    with torch.no_grad():
        for p in receiver.parameters():
            p.mul_(-3.0).add_(1.0)  # not the holder's
    opt_r = kind(receiver.parameters(), lr=0.01)
    opt_r.load_state_dict(copy.deepcopy(opt_h.state_dict()))
    for state in opt_r.state.values():  # garbage where the state has not arrived
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                v.fill_(7.0)
    params_h, params_r = list(holder.parameters()), list(receiver.parameters())
    phase = [0, 0, 1, 2]  # parameter index -> the step (after s) whose boundary its state is sent at
    for step in range(3):
        for i, (ph, pr) in enumerate(zip(params_h, params_r, strict=True)):
            if phase[i] == step:  # this phase lands: the holder's current state of parameter i
                with torch.no_grad():
                    pr.copy_(ph)
                opt_r.state[pr] = copy.deepcopy(opt_h.state[ph])
        holder(torch.randn(4, 8)).pow(2).sum().backward()
        for i, (ph, pr) in enumerate(zip(params_h, params_r, strict=True)):
            pr.grad = ph.grad.clone() if phase[i] <= step else None  # the all-reduced gradient, or skipped
        opt_h.step()
        opt_r.step()
        opt_h.zero_grad()
        opt_r.zero_grad()
    for ph, pr in zip(params_h, params_r, strict=True):
        assert torch.equal(ph, pr)
        for key, value in opt_h.state[ph].items():
            other = opt_r.state[pr][key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other


def test_kib_plan_of_a_tiny_model_is_the_three_phases_the_integration_test_expects() -> None:
    """tests/integration/test_live_regroup.py (state-in-phases) runs live_worker.py's model at 4096 bytes a phase."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Linear(64, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    optimizer.step()
    tensors = _tensors_by_path({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    paths = list(tensors)
    sizes = [t.numel() * t.element_size() for t in tensors.values()]
    assert len(set(plan_phases(sizes, parameter_groups(paths, model, optimizer), 4 * KIB))) == 3
