"""A lost step's finished micro-batches, kept by the members that computed them: the new world's split of that step.

A peer dies while a step is in flight. Each survivor may have finished some of the step's micro-batches already:
their gradients sit in its parameters' ``.grad`` (accumulated locally, not yet all-reduced). Only the step's last
micro-batch synchronises, so those gradients are exactly what the survivor would hold had the world not changed.
The new world trains the same step on the same global batch (the stream's next ``global_batch`` samples), so a
survivor whose model is the agreed one keeps those gradients and its finished micro-batches are not computed again:
the new world's split of the step gives each such member its own finished samples as its first micro-batch (read,
counted and logged, but neither forward nor backward runs for it), and the rest of the step's samples are split so
that every member computes about the same number of samples. Every member still runs the same number of
micro-batches (the Trainer's ``gradient_accumulation_steps``), and at least one it computes, whose backward carries
the step's gradient all-reduce.

Pure: :func:`split_step` decides the split from every member's :class:`Offer`; :func:`rescale` is the factor by which
kept gradients count in the new world, from what the Trainer did to a micro-batch's loss in each (:class:`LossScale`).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Offer:
    """What one member kept of the step in flight when its world broke."""

    step: int
    """Optimizer steps completed before the lost step (its gradients would have made step ``step + 1``)."""
    cursor: int
    """The stream position where the lost step's global batch starts."""
    global_batch: int
    offsets: tuple[int, ...]
    """Positions in the step's global batch (0 .. global_batch - 1) whose gradients this member holds."""


@dataclass(frozen=True)
class StepSplit:
    """The new world's split of the step: per rank its micro-batches, as positions in the step's global batch."""

    micro_batches: tuple[tuple[tuple[int, ...], ...], ...]
    kept: tuple[bool, ...]
    """Per rank: its first micro-batch is the one it kept (its gradients are in memory: no forward, no backward)."""

    @property
    def kept_samples(self) -> int:
        return sum(len(mbs[0]) for mbs, k in zip(self.micro_batches, self.kept, strict=True) if k)


def usable(offers: Sequence[Offer | None], step: int, cursor: int, global_batch: int) -> list[tuple[int, ...]]:
    """Per rank, the positions it may keep: its offer's, when the offer is for the agreed step at the agreed
    position with the same global batch, lies within it and overlaps no lower rank's; else none."""
    taken: set[int] = set()
    out: list[tuple[int, ...]] = []
    for offer in offers:
        ok = (
            offer is not None
            and offer.offsets
            and (offer.step, offer.cursor, offer.global_batch) == (step, cursor, global_batch)
            and all(0 <= o < global_batch for o in offer.offsets)
            and len(set(offer.offsets)) == len(offer.offsets)
            and not taken.intersection(offer.offsets)
        )
        if ok and offer is not None:
            taken.update(offer.offsets)
            out.append(tuple(sorted(offer.offsets)))
        else:
            out.append(())
    return out


def split_step(
    offers: Sequence[Offer | None], step: int, cursor: int, global_batch: int, micro_batch: int, accumulation: int
) -> StepSplit | None:
    """The split of the step starting at stream position ``cursor`` after optimizer step ``step`` among
    ``len(offers)`` ranks, each running ``accumulation`` micro-batches of at most ``micro_batch`` samples; None when
    no member can keep anything (the batch plan's own split applies)."""
    world = len(offers)
    if world < 1 or accumulation < 2 or micro_batch < 1:
        return None  # a member that keeps must still compute one micro-batch: its backward carries the all-reduce
    kept = usable(offers, step, cursor, global_batch)
    while any(kept):
        slots = [accumulation - (1 if k else 0) for k in kept]
        held = {o for k in kept for o in k}
        rest = [o for o in range(global_batch) if o not in held]
        if sum(slots) <= len(rest) <= micro_batch * sum(slots):
            return _assign(kept, rest, slots, micro_batch)
        # Not every micro-batch left could hold a sample (or the rest does not fit): the smallest keeper computes
        # its samples again.
        smallest = min((len(k), r) for r, k in enumerate(kept) if k)[1]
        kept[smallest] = ()
    return None


def _assign(kept: list[tuple[int, ...]], rest: list[int], slots: list[int], micro_batch: int) -> StepSplit:
    """The rest of the step's positions, in stream order, in rank order: every rank computes about as many samples
    (each micro-batch it computes between 1 and ``micro_batch``), its micro-batches' sizes at most one apart."""
    counts = list(slots)  # one sample per micro-batch at least
    heap = [(c, r) for r, c in enumerate(counts) if c < slots[r] * micro_batch]
    heapq.heapify(heap)
    for _ in range(len(rest) - sum(counts)):
        c, r = heapq.heappop(heap)
        counts[r] = c + 1
        if counts[r] < slots[r] * micro_batch:
            heapq.heappush(heap, (counts[r], r))
    micro_batches: list[tuple[tuple[int, ...], ...]] = []
    at = 0
    for r, n in enumerate(counts):
        mine = rest[at : at + n]
        at += n
        base, extra = divmod(n, slots[r])
        parts: list[tuple[int, ...]] = [kept[r]] if kept[r] else []
        i = 0
        for s in range(slots[r]):
            size = base + (1 if s < extra else 0)
            parts.append(tuple(mine[i : i + size]))
            i += size
        micro_batches.append(tuple(parts))
    return StepSplit(micro_batches=tuple(micro_batches), kept=tuple(bool(k) for k in kept))


@dataclass(frozen=True)
class LossScale:
    """What the Trainer did to a micro-batch's loss before its backward, in one world (None: not done)."""

    items: float | None = None
    """Divided by the step's item count (the model takes ``num_items_in_batch``, or a ``compute_loss_func``)."""
    world: int | None = None
    """Multiplied by the world size (that count is the whole world's: ``average_tokens_across_devices``)."""
    accumulation: int | None = None
    """Divided by the step's number of micro-batches (a mean loss)."""

    @property
    def weight(self) -> float:
        w = 1.0
        if self.items:
            w /= self.items
        if self.world:
            w *= self.world
        if self.accumulation:
            w /= self.accumulation
        return w


def rescale(old: LossScale, new: LossScale) -> float:
    """The factor that makes gradients kept from a world where the loss was scaled ``old`` count as if computed in one
    where it is scaled ``new`` (DDP's division by the world size comes after, on the whole step's gradients)."""
    return new.weight / old.weight
