"""A lost step's forward pass stops at the next block once the round is broken (trainer/forward_stop.py). Pure:
a small torch model, no processes."""

from __future__ import annotations

import pytest
import torch

from elastrain.integrations.trainer.forward_stop import blocks_of, forward_stops
from elastrain.live.group import GroupBrokenError


class _Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(4, 4)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4))
        self.ran: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for i, layer in enumerate(self.layers):
            self.ran.append(i)
            x = layer(x)
        return x


def test_the_blocks_are_the_members_of_the_model_s_module_lists() -> None:
    model = _Stack()
    assert blocks_of(model) == list(model.layers)
    assert blocks_of(torch.nn.Linear(2, 2)) == []


def test_a_broken_round_stops_the_forward_at_the_next_block_and_only_inside() -> None:
    model, broken = _Stack(), [False]
    notice = model.layers[1].register_forward_hook(lambda *_: broken.append(True))  # the notice comes during block 1
    x = torch.randn(2, 4)
    with forward_stops(model, lambda: broken[-1]):
        with pytest.raises(GroupBrokenError, match="forward pass stops"):
            model(x)
        assert model.ran == [0, 1, 2]  # block 2 was entered by the loop, its forward never ran
        notice.remove()
        broken.append(False)
        model.ran.clear()
        model(x)  # a whole round again: the forward runs through
        assert model.ran == [0, 1, 2, 3]
    broken.append(True)
    model.ran.clear()
    model(x)  # outside train(): no hooks left
    assert model.ran == [0, 1, 2, 3]
