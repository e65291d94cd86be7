"""A sharded model rebuilt for a new world (elastrain.live.sharded), in one process (a gloo world of one)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from support.processes import free_port
from support.sharded_net import Net
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from elastrain.live.sharded import (
    ShardedModel,
    ShardingError,
    is_sharded,
    parameter_names,
    repoint_optimizer,
)


def shard(module: torch.nn.Module, mesh: DeviceMesh) -> None:
    fully_shard(module.a, mesh=mesh)
    fully_shard(module, mesh=mesh)


@pytest.fixture
def world() -> Iterator[DeviceMesh]:
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_each_world_gets_a_sharded_module_and_the_optimizer_follows_it(world: DeviceMesh) -> None:
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.1, weight_decay=0.01)
    sharded = ShardedModel(net, shard)
    names = parameter_names(net)
    first = sharded.build(net, world, torch.device("cpu"))
    assert first is net and is_sharded(first)
    repoint_optimizer(opt, names, first)
    assert {id(p) for p in opt.param_groups[0]["params"]} == {id(p) for p in first.parameters()}
    first(torch.randn(2, 4)).sum().backward()
    opt.step()
    assert opt.state  # stepped on the sharded parameters

    names = parameter_names(first)
    second = sharded.build(first, world, torch.device("cpu"))
    assert second is not first and is_sharded(second)
    assert torch.equal(second.scale, torch.full((4,), 2.0))  # put back: no checkpoint would
    repoint_optimizer(opt, names, second)
    assert not opt.state and opt.param_groups[0]["weight_decay"] == 0.01  # state cleared, settings kept
    assert {id(p) for p in opt.param_groups[0]["params"]} == {id(p) for p in second.parameters()}


def test_a_model_sharded_already_or_by_a_shard_that_does_nothing_is_refused(world: DeviceMesh) -> None:
    net = Net()
    shard(net, world)
    with pytest.raises(ShardingError, match="needs the model unsharded"):
        ShardedModel(net, shard)
    lazy = ShardedModel(Net(), lambda module, mesh: None)
    with pytest.raises(ShardingError, match="no parameter is a DTensor"):
        lazy.build(Net(), world, torch.device("cpu"))
