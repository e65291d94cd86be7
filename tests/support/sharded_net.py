"""A small model for the sharded-model tests: two linear layers, a non-persistent buffer and a persistent one."""

from __future__ import annotations

import torch


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 4)
        self.register_buffer("scale", torch.full((4,), 2.0), persistent=False)  # no checkpoint holds it
        self.register_buffer("count", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))) * self.scale
