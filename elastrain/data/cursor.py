"""Where the data stream stands, and which samples the next step takes: pure, world-size independent.

The stream is a seeded permutation of the dataset per epoch, read front to back by a global
cursor. A step takes the next ``global_batch`` positions of that stream whoever the workers are,
so after any change of world size training resumes at exactly the next unseen sample.

At the end of an epoch, fewer than ``global_batch`` samples may remain (the *tail*).
:class:`EpochEnd` says what happens to it:

``partial`` (default)
    The last step of the epoch takes the tail as a smaller batch (its loss is normalised by its own
    size). A tail smaller than the world size cannot give every worker a sample and is skipped.
``drop``
    The tail is skipped; every step has exactly ``global_batch`` samples.
``wrap``
    The last step is completed with the first samples of the next epoch's permutation: every step
    has exactly ``global_batch`` samples and no sample is skipped.

In every mode each sample is used at most once per epoch, and exactly once except for a skipped tail.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from elastrain.errors import DataStateError


class EpochEnd(str, enum.Enum):
    PARTIAL = "partial"
    DROP = "drop"
    WRAP = "wrap"


@dataclass(frozen=True, order=True)
class Position:
    """The next unread place in the stream: ``cursor`` positions into epoch ``epoch``'s permutation."""

    epoch: int
    cursor: int


@dataclass(frozen=True)
class Segment:
    """Positions ``start:stop`` of epoch ``epoch``'s permutation."""

    epoch: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class StepRange:
    """The stream positions one global step consumes."""

    start: Position
    end: Position
    segments: tuple[Segment, ...]

    @property
    def size(self) -> int:
        return sum(s.size for s in self.segments)

    @property
    def finishes_epoch(self) -> bool:
        return self.end.epoch > self.start.epoch


def check_fits(num_samples: int, global_batch: int, world_size: int, epoch_end: EpochEnd) -> None:
    """Raise :class:`DataStateError` when no step could ever be formed from this dataset."""
    if num_samples < 1:
        raise DataStateError("the dataset is empty")
    if global_batch < world_size:
        raise DataStateError(f"global batch {global_batch} is smaller than the world size {world_size}")
    if epoch_end is EpochEnd.DROP and num_samples < global_batch:
        raise DataStateError(
            f"the dataset has {num_samples} samples, fewer than one global batch ({global_batch}), and "
            f"epoch_end='drop' skips them all: use epoch_end='partial' or 'wrap', or a smaller global batch"
        )
    if epoch_end is EpochEnd.PARTIAL and num_samples < world_size:
        raise DataStateError(
            f"the dataset has {num_samples} samples, fewer than the {world_size} workers: "
            "use epoch_end='wrap' or fewer workers"
        )


def normalize(pos: Position, num_samples: int, global_batch: int, world_size: int, epoch_end: EpochEnd) -> Position:
    """``pos``, moved to the next epoch when the rest of its epoch is a tail that will be skipped."""
    remaining = num_samples - pos.cursor
    if remaining < 0:
        raise DataStateError(f"cursor {pos.cursor} is past the end of a {num_samples}-sample epoch")
    if remaining == 0:
        return Position(pos.epoch + 1, 0)
    if epoch_end is EpochEnd.DROP and remaining < global_batch:
        return Position(pos.epoch + 1, 0)
    if epoch_end is EpochEnd.PARTIAL and remaining < world_size:
        return Position(pos.epoch + 1, 0)
    return pos


def step_range(pos: Position, num_samples: int, global_batch: int, world_size: int, epoch_end: EpochEnd) -> StepRange:
    """The positions the step starting at ``pos`` consumes, and where the next step starts."""
    check_fits(num_samples, global_batch, world_size, epoch_end)
    start = normalize(pos, num_samples, global_batch, world_size, epoch_end)
    segments: list[Segment] = []
    need = global_batch
    epoch, cursor = start.epoch, start.cursor
    while need > 0:
        take = min(need, num_samples - cursor)
        segments.append(Segment(epoch, cursor, cursor + take))
        need -= take
        cursor += take
        if cursor == num_samples:
            epoch, cursor = epoch + 1, 0
            if epoch_end is not EpochEnd.WRAP:
                break
    end = Position(epoch, cursor)
    if end.cursor:
        end = normalize(end, num_samples, global_batch, world_size, epoch_end)
    return StepRange(start=start, end=end, segments=tuple(segments))
