"""Broadcast a worker's training state from one rank to all: model, optimizer, and small ``Stateful`` objects.

The source sends a skeleton (the state dicts with every tensor replaced by its index, shape and dtype, plus the
plain values) as JSON (:mod:`elastrain.wire`: what a peer sends is parsed, never unpickled), then the tensors
packed into one flat buffer per dtype; receivers allocate from the skeleton, so a rank whose optimizer has no
state yet (a new member) receives it too. The state may hold tensors and plain data (None, bool, int, float,
str, list, tuple, dict), as a checkpoint may. Everything travels on the current default group; all ranks call
:func:`broadcast_state` together.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastrain import wire
from elastrain.errors import WireFormatError


@dataclass(frozen=True)
class _TensorSlot:
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def parse(cls, payload: Any) -> _TensorSlot:
        """A placeholder's payload, ``[index, shape, dtype]``, checked (it came from a peer)."""
        if not (isinstance(payload, list) and len(payload) == 3 and isinstance(payload[0], int)):
            raise WireFormatError(f"a tensor placeholder must be [index, shape, dtype], got {payload!r:.80}")
        index, shape, dtype = payload
        if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
            raise WireFormatError(f"tensor {index}: its shape {shape!r:.80} is not a list of sizes")
        return cls(index, tuple(shape), wire.dtype_of(dtype))


def broadcast_tree(tree: Any, src: int, device: torch.device) -> tuple[Any, int]:
    """``tree`` (nested dicts/lists of tensors and plain values) of rank ``src`` on every rank; bytes sent."""
    rank = dist.get_rank()
    tensors: list[torch.Tensor] = []

    def slot(t: torch.Tensor, path: tuple[str, ...]) -> list[Any]:
        tensors.append(t.detach())
        return [len(tensors) - 1, list(t.shape), wire.dtype_name(t.dtype)]

    data: bytes | None = None
    if rank == src:
        try:
            data = wire.dumps({"state": wire.to_plain(tree, slot)})
        except WireFormatError as exc:  # every rank hears of it: none waits for tensors that never come
            data = wire.dumps({"error": f"rank {src}: {exc}"})
    message = wire.loads(wire.broadcast_bytes(data, src, device=device))
    if not isinstance(message, dict) or not ("state" in message or "error" in message):
        raise WireFormatError(f"rank {src} sent no state ({str(message)[:80]})")
    if "error" in message:
        raise WireFormatError(f"the live state cannot be sent: {message['error']}")
    skeleton = message["state"]
    slots = sorted((_TensorSlot.parse(p) for p in wire.placeholders(skeleton)), key=lambda s: s.index)
    if [s.index for s in slots] != list(range(len(slots))):
        raise WireFormatError("the state's tensor placeholders are not numbered 0, 1, 2, ...")
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
    return wire.from_plain(skeleton, lambda payload: received[payload[0]]), sent


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
