"""Frozen parameters a state transfer need not send: those every receiver already holds bit for bit.

A model fine-tuned with adapters (LoRA) trains a small part of itself; the rest is frozen (``requires_grad`` off)
and every member loaded it the same way (``from_pretrained``). Sending it to a joiner moves the whole model for
what is often a thousandth of it. Before a transfer, the source and each receiver checksum their frozen parameters
(reading them about 1.5 times, in place, on their own device); the source's checksums go to every rank as one
tensor, and a parameter is left out of the transfer when every receiver's checksum equals the source's. A parameter
some receiver holds otherwise (another seed, another file) is sent as before. The agreement is three collectives of a
few integers each, on every rank of the group, also when nothing is frozen; none when nobody receives.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist

_MASK = (1 << 64) - 1
_STRIDES = ((0, 1), (0, 3), (1, 7))  # the whole, then two strided samples: a transposed square differs


def frozen_names(module: torch.nn.Module) -> list[str]:
    """The ``state_dict`` keys of ``module``'s frozen parameters (tied ones under each name), in a fixed order."""
    return sorted(name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad)


def checksum(t: torch.Tensor) -> int:
    """A 64-bit checksum of a tensor's bytes: sums of its 8-byte words (modulo 2^64, exact in any order), whole and
    at two strides, so that words moved (a transposed square matrix) change it too. Reads the tensor about 1.5 times,
    in place, on its own device."""
    data = t.detach().reshape(-1).view(torch.uint8)
    n = data.numel()
    if n == 0:
        return 0
    words = data.view(torch.int64) if n % 8 == 0 else data.to(torch.int64)
    total = n
    for start, step in _STRIDES:
        total = (total * 1_000_003 + int(words[start::step].sum().item())) & _MASK
    return total


def held_alike(
    names: list[str], own: Mapping[str, torch.Tensor], src: int, receivers: Iterable[int] | None, device: torch.device
) -> set[str]:
    """The frozen ``names`` (every rank's own list) that every receiver holds as rank ``src`` does. Collective: every
    rank of the group calls it. ``receivers`` None: every rank other than ``src`` receives."""
    rank = dist.get_rank()
    targets = None if receivers is None else set(receivers) - {src}
    if targets is not None and not targets:
        return set()  # nobody receives (the same on every rank: the receivers are agreed)
    counts = torch.tensor([len(names), -len(names)], dtype=torch.int64, device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    if int(counts[0]) != -int(counts[1]) or not names:
        return set()  # the ranks freeze different parameters (or none): each is sent
    receives = rank != src and (targets is None or rank in targets)
    if rank == src or receives:  # only they read their frozen parameters
        sums = [zlib.crc32(n.encode()) for n in names] + [_signed(checksum(own[n])) for n in names]
        mine = torch.tensor(sums, dtype=torch.int64, device=device)
    else:
        mine = torch.zeros(2 * len(names), dtype=torch.int64, device=device)
    source = mine.clone()
    dist.broadcast(source, src)
    alike = torch.eq(mine, source).to(torch.int64) if receives else torch.ones_like(mine)
    dist.all_reduce(alike, op=dist.ReduceOp.MIN)
    n = len(names)
    return {name for i, name in enumerate(names) if int(alike[i]) and int(alike[n + i])}


def _signed(value: int) -> int:
    """``value`` modulo 2^64, as an int64."""
    value &= _MASK
    return value - (1 << 64) if value >= 1 << 63 else value
