"""A model's meta skeleton (elastrain.live.sharded): no data, tied parameters kept, non-persistent buffers named."""

from __future__ import annotations

import torch
from support.sharded_net import Net

from elastrain.live.sharded import meta_skeleton, non_persistent_buffers


def test_the_skeleton_holds_no_data_and_keeps_the_non_persistent_buffers() -> None:
    net = Net()
    skeleton = meta_skeleton(net)
    assert all(t.device.type == "meta" for t in [*skeleton.parameters(), *skeleton.buffers()])
    assert all(t.device.type == "cpu" for t in net.parameters())  # the original is untouched
    assert set(non_persistent_buffers(net)) == {"scale"}
    tied = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    tied[1].weight = tied[0].weight
    copy = meta_skeleton(tied)
    assert copy[0].weight is copy[1].weight  # a tied parameter stays tied
