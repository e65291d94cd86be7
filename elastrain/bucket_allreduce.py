"""A gradient bucket's all-reduce, in pieces when the bucket is large: one implementation for every DDP comm hook.

DDP (torch >= 2.9) puts the whole gradient in ONE bucket in its first iteration, and rebuilds its buckets by
the order the gradients became ready only after it (``BucketCapacityConfig.compute_bucket_size_limits``). A
live regroup builds DDP anew in every world, so each world's first step all-reduces the model's whole gradient
as one tensor, which gloo moves several times slower than the same bytes in pieces (a 100M-parameter model's
403 MB bucket: about 3 s among three processes here, against about 0.6 s in 16 MiB pieces; see
``docs/benchmarks.md``). A bucket larger than :data:`SPLIT_ABOVE_BYTES` is all-reduced as views of at most
:data:`PIECE_BYTES` each, all in flight at once; the usual 25 MiB buckets go whole.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

PIECE_BYTES = 16 << 20
"""The most bytes one all-reduce of a split bucket carries."""
SPLIT_ABOVE_BYTES = 32 << 20
"""Buckets up to this size (DDP's default cap is 25 MiB) are all-reduced whole."""


def piece_sizes(
    numel: int, element_size: int, piece_bytes: int = PIECE_BYTES, above: int = SPLIT_ABOVE_BYTES
) -> list[int]:
    """Pure: the element counts of the pieces a flat tensor of ``numel`` elements is all-reduced in."""
    if numel * element_size <= above:
        return [numel]
    step = max(1, piece_bytes // element_size)
    return [min(step, numel - start) for start in range(0, numel, step)]


def all_reduce_pieces(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> list[dist.Work]:
    """Start the sum of the flat contiguous ``tensor`` over ``group``, in place, in pieces; their work handles."""
    flat = tensor.view(-1)
    works, start = [], 0
    for size in piece_sizes(flat.numel(), flat.element_size()):
        works.append(dist.all_reduce(flat[start : start + size], group=group, async_op=True))
        start += size
    if any(w is None for w in works):
        raise RuntimeError("internal: an asynchronous all-reduce returned no work handle")
    return [w for w in works if w is not None]


def completion(works: list[dist.Work]) -> torch.futures.Future[None]:
    """A future done when every one of ``works`` is (failed if any failed)."""
    if len(works) == 1:
        return works[0].get_future().then(lambda f: _settled([f]))
    return torch.futures.collect_all([w.get_future() for w in works]).then(lambda f: _settled(f.value()))


def _settled(futures: list[torch.futures.Future[object]]) -> None:
    for f in futures:
        f.value()  # raises the piece's error
