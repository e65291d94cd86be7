"""A sharded model (FSDP2) that moves to a new world in place: rebuilt and resharded, its state from the checkpoint.

With data-parallel replicas every member holds the whole state, so a regroup sends it from a member
(:mod:`elastrain.live.transfer`). With FSDP2 each rank holds a shard; a member that died took its
shards with it, and the survivors' shards are bound to the old world's device mesh, whose process
group is gone. So at every entry into a world the model is sharded anew on the new mesh, and its
state comes from the newest committed checkpoint (DCP reshards it to the new world size):

1. :class:`ShardedModel` keeps a *skeleton* of the script's unsharded module, taken before it is first
   sharded: the same module tree with every parameter and buffer on the ``meta`` device (no memory),
   plus the values of the non-persistent buffers, which no checkpoint holds.
2. In the first world the script's module itself is sharded by the script's ``shard(module, mesh)``
   (the ``fully_shard`` calls it would make anyway); in every later world a fresh module is built from
   the skeleton (``to_empty`` on the device, the non-persistent buffers put back) and sharded the same way.
3. The script's optimizer is pointed at the new module's parameters in place (same object, same
   parameter groups and hyper-parameters, by parameter name) and its state cleared: the checkpoint
   load that follows refills it.

The cost of a change is a checkpoint load (and the steps since the last commit after a member died
without warning; an announced change saves first). The rebuilt module is not initialised: its values
are garbage until the load, which must follow. Peer replicas of shards (a survivor holding a copy of
its neighbour's shard) would replace the load; :meth:`ShardedModel.build` is where they would plug in.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from elastrain.errors import ElastrainError

ShardFn = Callable[[torch.nn.Module, DeviceMesh], Any]
"""The script's sharding: ``shard(module, mesh)`` calls ``fully_shard`` on the submodules and the root."""


class ShardingError(ElastrainError):
    """The script's ``shard`` function did not shard the model, or the optimizer does not fit it."""


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether any parameter of ``module`` is a ``DTensor`` (FSDP2, or any other DTensor parallelism)."""
    return any(isinstance(p, DTensor) for p in module.parameters())


def meta_skeleton(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module``'s tree whose parameters and buffers are on ``meta`` (their data is never copied)."""
    memo: dict[int, Any] = {}
    for param in module.parameters():  # a tied parameter once: the copy ties it the same way
        memo[id(param)] = torch.nn.Parameter(torch.empty_like(param, device="meta"), param.requires_grad)
    for buf in module.buffers():
        memo.setdefault(id(buf), torch.empty_like(buf, device="meta"))
    return copy.deepcopy(module, memo)


def non_persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers no state dict holds (rotary frequencies, causal masks), copied to the CPU, by full name."""
    out: dict[str, torch.Tensor] = {}
    for prefix, sub in module.named_modules():
        for name in getattr(sub, "_non_persistent_buffers_set", ()):
            buf = sub._buffers.get(name)
            if buf is not None:
                out[f"{prefix}.{name}" if prefix else name] = buf.detach().to("cpu", copy=True)
    return out


class ShardedModel:
    """The script's unsharded module's skeleton and sharding, to build the sharded module of each world."""

    def __init__(self, module: torch.nn.Module, shard: ShardFn) -> None:
        if is_sharded(module):
            raise ShardingError(
                "Session(shard=...) needs the model unsharded: pass the module before fully_shard, and let the "
                "session call shard(module, mesh) in every world"
            )
        self.shard = shard
        self.skeleton = meta_skeleton(module)
        self.buffers = non_persistent_buffers(module)
        self.worlds = 0
        """How many worlds a module was sharded for (the first shards the script's module itself)."""

    def build(self, module: torch.nn.Module, mesh: DeviceMesh, device: torch.device) -> torch.nn.Module:
        """The module sharded on ``mesh``: ``module`` itself in the first world, a fresh one from the skeleton
        after (uninitialised: load the checkpoint next)."""
        if self.worlds == 0:
            out = module.to(device)
        else:
            out = copy.deepcopy(self.skeleton)
            out.to_empty(device=device)
            for name, value in self.buffers.items():
                owner, _, leaf = name.rpartition(".")
                out.get_submodule(owner)._buffers[leaf] = value.to(device)
        self.shard(out, mesh)
        if not is_sharded(out):
            raise ShardingError("Session(shard=...): after shard(module, mesh) no parameter is a DTensor")
        self.worlds += 1
        return out


def parameter_names(module: torch.nn.Module) -> dict[int, str]:
    """Each parameter object's name in ``module`` (take it before sharding: ``fully_shard`` replaces them)."""
    return {id(p): n for n, p in module.named_parameters()}


def repoint_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str], new: torch.nn.Module) -> None:
    """Point ``optimizer``'s parameter groups at ``new``'s parameters, in place, and clear its state (a checkpoint
    load refills it). ``names``: :func:`parameter_names` of the module whose parameters the optimizer holds now
    (the script's module before its first sharding, or the previous world's)."""
    by_name = dict(new.named_parameters())
    for group in optimizer.param_groups:
        try:
            group["params"] = [by_name[names[id(p)]] for p in group["params"]]
        except KeyError as exc:
            raise ShardingError(
                f"the optimizer holds a parameter the model does not ({exc}): build it from model.parameters()"
            ) from None
    optimizer.state.clear()
