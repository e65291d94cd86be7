"""Broadcast a worker's training state from one rank to all: model, optimizer, and small ``Stateful`` objects.

The source sends a skeleton (the state dicts with every tensor replaced by its shape and dtype, plus the
plain values) as one pickled object, then the tensors packed into one flat buffer per dtype; receivers
allocate from the skeleton, so a rank whose optimizer has no state yet (a new member) receives it too.
Everything travels on the current default group; all ranks call :func:`broadcast_state` together.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class _TensorSlot:
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _skeleton(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach())
        return _TensorSlot(len(tensors) - 1, tuple(obj.shape), obj.dtype)
    if isinstance(obj, Mapping):
        return {k: _skeleton(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_skeleton(v, tensors) for v in obj)
    return obj


def _fill(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, _TensorSlot):
        return tensors[obj.index]
    if isinstance(obj, Mapping):
        return {k: _fill(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill(v, tensors) for v in obj)
    return obj


def _slots(obj: Any) -> list[_TensorSlot]:
    out: list[_TensorSlot] = []
    stack = [obj]
    while stack:
        cur = stack.pop()
        if isinstance(cur, _TensorSlot):
            out.append(cur)
        elif isinstance(cur, Mapping):
            stack.extend(cur.values())
        elif isinstance(cur, (list, tuple)):
            stack.extend(cur)
    return sorted(out, key=lambda s: s.index)


def broadcast_tree(tree: Any, src: int, device: torch.device) -> tuple[Any, int]:
    """``tree`` (nested dicts/lists of tensors and plain values) of rank ``src`` on every rank; bytes sent."""
    rank = dist.get_rank()
    tensors: list[torch.Tensor] = []
    box = [_skeleton(tree, tensors) if rank == src else None]
    dist.broadcast_object_list(box, src=src)
    skeleton = box[0]
    slots = _slots(skeleton)
    received: list[torch.Tensor] = [torch.empty(0)] * len(slots)
    sent = 0
    for dtype in sorted({s.dtype for s in slots}, key=str):
        mine = [s for s in slots if s.dtype == dtype]
        numel = sum(int(torch.Size(s.shape).numel()) for s in mine)
        if rank == src:
            flat = torch.cat([tensors[s.index].reshape(-1).to(device) for s in mine])
        else:
            flat = torch.empty(numel, dtype=dtype, device=device)
        dist.broadcast(flat, src=src)
        sent += flat.numel() * flat.element_size()
        offset = 0
        for s in mine:
            n = int(torch.Size(s.shape).numel())
            received[s.index] = flat[offset : offset + n].view(s.shape).clone()
            offset += n
    return _fill(skeleton, received), sent


def broadcast_state(
    src: int,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    objects: Mapping[str, Any],
    device: torch.device,
) -> int:
    """Make every rank's ``module``, ``optimizer`` and ``objects`` (``Stateful``s) equal to rank ``src``'s;
    returns the bytes of tensors broadcast."""
    mine = dist.get_rank() == src
    tree = (
        {
            "model": module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "objects": {name: obj.state_dict() for name, obj in objects.items()},
        }
        if mine
        else None
    )
    state, sent = broadcast_tree(tree, src, device)
    if not mine:
        with torch.no_grad():
            module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        for name, obj in objects.items():
            obj.load_state_dict(state["objects"][name])
    return sent
